"""Synthesize sysroot trees (the /sys and /proc files a real Linux exposes) for machines we do not have.

`Machine` describes sockets, cores, SMT numbering, NUMA nodes, cpuset and quota; `write(machine, dir)` lays the
files out exactly where deploykit.topology reads them. The MACHINES table holds the fixtures the issue names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from deploykit import cpulist

GiB = 1024**3
FLAGS_AMD_ZEN5 = "fpu sse sse2 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
FLAGS_SPR = FLAGS_AMD_ZEN5 + " avx512_fp16 amx_bf16 amx_tile amx_int8"
FLAGS_DESKTOP = "fpu sse sse2 avx avx2 fma"


@dataclass(frozen=True)
class Machine:
    sockets: int
    cores_per_socket: int
    threads_per_core: int = 2
    numbering: str = "offset"  # offset: sibling at +total_cores; adjacent: 2k,2k+1; roundrobin: sockets alternate
    nodes_per_socket: int = 1
    node_memory: int = 64 * GiB
    memory_only_nodes: tuple[int, ...] = ()  # sizes in bytes of extra CPU-less nodes (CXL)
    offline: tuple[int, ...] = ()
    cpuset: str | None = None  # cgroup cpuset (and affinity) of the process
    mems: str | None = None
    quota: tuple[int, int] | None = None  # (quota_us, period_us)
    cgroup: str = "v2"
    node_dir: bool = True
    flags: str = FLAGS_AMD_ZEN5
    model_name: str = "Synthetic CPU"
    node_cores: tuple[int, ...] = ()  # asymmetric nodes: cores per node in core order (default: equal split)
    node_memories: tuple[int, ...] = ()  # per CPU node (default: node_memory each)
    # Caches as the kernel shows them in cpuN/cache/index0-3 (L1d, L1i, L2 per core; L3 shared by `l3_cores`
    # consecutive cores of a socket with all their SMT siblings: 8 on AMD Zen 4/5 (a CCD), the whole socket on Intel).
    # 0 = no cache directory at all (old kernels, containers that hide it, snapshots from older deploykit).
    l3_cores: int = 0
    l3_size: int = 32 * 1024**2
    # Settings beyond the shape (deploykit.hostsettings); None / () = the file is not written.
    numa_balancing: int | None = None
    thp: str | None = None  # always | madvise | never
    seccomp: int | None = None  # Seccomp: line of /proc/self/status (0 off, 2 filter)
    cap_eff: int | None = None
    environ: tuple[tuple[str, str], ...] | None = None  # () writes an empty record: "nothing relevant was set"
    ld_so_preload: tuple[str, ...] = ()
    probe: dict | None = None  # deploykit/probe.json as `topology snapshot` records it

    @property
    def ncpus(self) -> int:
        return self.sockets * self.cores_per_socket * self.threads_per_core

    def layout(self) -> list[tuple[int, int, int, int]]:
        """[(cpu id, socket, global core index, node)] for every CPU."""
        ncores = self.sockets * self.cores_per_socket
        out = []
        for cpu in range(self.ncpus):
            if self.numbering == "adjacent":
                core, _thread = divmod(cpu, self.threads_per_core)
                socket = core // self.cores_per_socket
            elif self.numbering == "roundrobin":
                core = cpu % ncores
                socket = core % self.sockets
            else:
                core = cpu % ncores
                socket = core // self.cores_per_socket
            local = (core // self.sockets if self.numbering == "roundrobin" else core % self.cores_per_socket)
            node = socket * self.nodes_per_socket + local * self.nodes_per_socket // self.cores_per_socket
            if self.node_cores:
                node = next(i for i in range(len(self.node_cores)) if core < sum(self.node_cores[:i + 1]))
            out.append((cpu, socket, core, node))
        return out


def write(m: Machine, root: str | Path) -> Path:
    root = Path(root)

    def put(rel: str, text: str) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    lay = m.layout()
    online = [c for c, *_ in lay if c not in m.offline]
    cpu = "sys/devices/system/cpu"
    put(f"{cpu}/online", cpulist.format(online) + "\n")
    put(f"{cpu}/present", cpulist.format(range(m.ncpus)) + "\n")
    put(f"{cpu}/possible", cpulist.format(range(m.ncpus)) + "\n")
    put(f"{cpu}/offline", cpulist.format(m.offline) + "\n")
    siblings: dict[int, list[int]] = {}
    for c, _s, core, _n in lay:
        siblings.setdefault(core, []).append(c)
    for c, socket, core, _n in lay:
        if c in m.offline:
            continue  # the kernel removes an offline CPU's topology directory
        t = f"{cpu}/cpu{c}/topology"
        put(f"{t}/physical_package_id", f"{socket}\n")
        put(f"{t}/core_id", f"{core % m.cores_per_socket}\n")
        put(f"{t}/thread_siblings_list", cpulist.format(s for s in siblings[core] if s not in m.offline) + "\n")
    if m.l3_cores:
        _caches(m, lay, siblings, put)
    nnodes = m.sockets * m.nodes_per_socket
    all_nodes = list(range(nnodes + len(m.memory_only_nodes)))
    if m.node_dir:
        node = "sys/devices/system/node"
        put(f"{node}/online", cpulist.format(all_nodes) + "\n")
        for n in all_nodes:
            cpus = [c for c, _s, _core, nn in lay if nn == n and c not in m.offline]
            mem = ((m.node_memories[n] if m.node_memories else m.node_memory) if n < nnodes
                   else m.memory_only_nodes[n - nnodes])
            put(f"{node}/node{n}/cpulist", cpulist.format(cpus) + "\n")
            put(f"{node}/node{n}/meminfo", f"Node {n} MemTotal:       {mem // 1024} kB\n"
                                           f"Node {n} MemFree:        {mem // 2048} kB\n")
            dist = [10 if x == n else 12 if x < nnodes and n < nnodes and x // m.nodes_per_socket ==
                    n // m.nodes_per_socket else 32 for x in all_nodes]
            put(f"{node}/node{n}/distance", " ".join(map(str, dist)) + "\n")
    total = (sum(m.node_memories) if m.node_memories else m.node_memory * nnodes) + sum(m.memory_only_nodes)
    put("proc/meminfo", f"MemTotal:       {total // 1024} kB\nMemFree:        {total // 2048} kB\n")
    put("proc/cpuinfo", f"processor\t: 0\nvendor_id\t: Synthetic\nmodel name\t: {m.model_name}\n"
                        f"flags\t\t: {m.flags}\n\n")
    allowed = m.cpuset or cpulist.format(online)
    mems = m.mems or cpulist.format(all_nodes)
    status = f"Cpus_allowed_list:\t{allowed}\nMems_allowed_list:\t{mems}\n"
    if m.seccomp is not None:
        status += f"Seccomp:\t{m.seccomp}\nNoNewPrivs:\t{1 if m.seccomp == 2 else 0}\n"
    if m.cap_eff is not None:
        status += f"CapEff:\t{m.cap_eff:016x}\n"
    put("proc/self/status", status)
    if m.numa_balancing is not None:
        put("proc/sys/kernel/numa_balancing", f"{m.numa_balancing}\n")
    if m.thp is not None:
        modes = ["always", "madvise", "never"]
        put("sys/kernel/mm/transparent_hugepage/enabled", " ".join(f"[{x}]" if x == m.thp else x for x in modes) + "\n")
    if m.environ is not None:
        p = root / "proc/self/environ"
        p.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in m.environ))
    if m.ld_so_preload:
        put("etc/ld.so.preload", "\n".join(m.ld_so_preload) + "\n")
    if m.probe is not None:
        put("deploykit/probe.json", json.dumps(m.probe, sort_keys=True) + "\n")
    if m.cgroup == "v2":
        put("proc/self/cgroup", "0::/\n")
        put("sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
        put("sys/fs/cgroup/cpuset.cpus.effective", allowed + "\n")
        put("sys/fs/cgroup/cpuset.mems.effective", mems + "\n")
        put("sys/fs/cgroup/cpu.max", (f"{m.quota[0]} {m.quota[1]}" if m.quota else "max 100000") + "\n")
        put("sys/fs/cgroup/memory.max", "max\n")
    else:
        put("proc/self/cgroup", "4:memory:/docker/abc\n3:cpuset:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
        put("sys/fs/cgroup/cpuset/cpuset.effective_cpus", allowed + "\n")
        put("sys/fs/cgroup/cpuset/cpuset.effective_mems", mems + "\n")
        put("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", f"{m.quota[0] if m.quota else -1}\n")
        put("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", f"{m.quota[1] if m.quota else 100000}\n")
        put("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    return root


def _caches(m: Machine, lay, siblings: dict[int, list[int]], put) -> None:
    cpu = "sys/devices/system/cpu"
    per_socket = -(-m.cores_per_socket // m.l3_cores)
    groups: dict[int, list[int]] = {}
    for c, socket, core, _n in lay:
        local = core // m.sockets if m.numbering == "roundrobin" else core % m.cores_per_socket
        groups.setdefault(socket * per_socket + local // m.l3_cores, []).append(c)
    l3_of = {c: g for g, cs in groups.items() for c in cs}
    for c, _s, core, _n in lay:
        if c in m.offline:
            continue
        own = cpulist.format(s for s in siblings[core] if s not in m.offline)
        l3 = cpulist.format(x for x in groups[l3_of[c]] if x not in m.offline)
        for index, (level, kind, shared, cid, size) in enumerate((
                (1, "Data", own, core, "48K"), (1, "Instruction", own, core, "32K"), (2, "Unified", own, core, "1024K"),
                (3, "Unified", l3, l3_of[c], f"{m.l3_size // 1024}K"))):
            d = f"{cpu}/cpu{c}/cache/index{index}"
            for name, value in (("level", level), ("type", kind), ("shared_cpu_list", shared), ("id", cid),
                                ("size", size)):
                put(f"{d}/{name}", f"{value}\n")


EPYC_9655_2S = Machine(sockets=2, cores_per_socket=96, node_memory=768 * GiB, flags=FLAGS_AMD_ZEN5,
                       model_name="AMD EPYC 9655 96-Core Processor", l3_cores=8)
MACHINES: dict[str, Machine] = {
    # 2x EPYC 9655, 384 CPUs, sibling of CPU i is i+192; NPS1 = one node per socket, NPS4 = four.
    "epyc-2s-nps1": EPYC_9655_2S,
    "epyc-2s-nps4": Machine(sockets=2, cores_per_socket=96, nodes_per_socket=4, node_memory=192 * GiB,
                            model_name="AMD EPYC 9655 96-Core Processor", l3_cores=8),
    # 2x Xeon 8480+ (56 cores) with sub-NUMA clustering (SNC2): 4 nodes, AMX; one 105 MB L3 per socket (SNC splits
    # the nodes, not the L3).
    "xeon-2s-snc2": Machine(sockets=2, cores_per_socket=56, nodes_per_socket=2, node_memory=256 * GiB,
                            flags=FLAGS_SPR, model_name="Intel(R) Xeon(R) Platinum 8480+", l3_cores=56,
                            l3_size=105 * 1024**2),
    # The same Xeons with SNC off: one node and one L3 per socket, so per-l3 places exactly as per-socket.
    "xeon-2s": Machine(sockets=2, cores_per_socket=56, node_memory=512 * GiB, flags=FLAGS_SPR,
                       model_name="Intel(R) Xeon(R) Platinum 8480+", l3_cores=56, l3_size=105 * 1024**2),
    # BIOS numbering CPUs round-robin across sockets: even CPUs socket 0, odd socket 1.
    "roundrobin-2s": Machine(sockets=2, cores_per_socket=8, numbering="roundrobin", node_memory=64 * GiB,
                             flags=FLAGS_SPR),
    # Container on the EPYC: cpuset = both siblings of cores 8-15, plus an 8-CPU CFS quota (cgroup v1).
    "epyc-container-8c": Machine(sockets=2, cores_per_socket=96, node_memory=768 * GiB, cpuset="8-15,200-207",
                                 mems="0", quota=(800000, 100000), cgroup="v1", l3_cores=8),
    # A cpuset that cuts an L3 group in half: cores 0-11 with their siblings (CCD 0 whole, CCD 1's first 4 cores).
    "epyc-cpuset-cuts-l3": replace(EPYC_9655_2S, cpuset="0-11,192-203", mems="0"),
    # A 4-CPU quota inside a 16-core cpuset (one CPU per core, no SMT on this box).
    "quota4-in-16": Machine(sockets=1, cores_per_socket=32, threads_per_core=1, node_memory=128 * GiB,
                            cpuset="0-15", quota=(400000, 100000)),
    # One socket, 16 cores x 2, a 256 GiB CXL memory-only node 1, CPUs 15 and 31 (one core) offline.
    "cxl-offline": Machine(sockets=1, cores_per_socket=16, node_memory=128 * GiB, memory_only_nodes=(256 * GiB,),
                           offline=(15, 31), flags=FLAGS_SPR, l3_cores=16),
    # Desktop: 8 cores, siblings adjacent (0,1) (2,3)..., kernel without NUMA (no node directory).
    "desktop-adjacent": Machine(sockets=1, cores_per_socket=8, numbering="adjacent", node_dir=False,
                                node_memory=32 * GiB, flags=FLAGS_DESKTOP, model_name="Desktop CPU"),
    # Asymmetric nodes on one socket (a VM or a partly populated part): node 0 has 8 cores and 48 GiB, node 1
    # 4 cores and 16 GiB; siblings at +12.
    "asymmetric-2n": Machine(sockets=1, cores_per_socket=12, nodes_per_socket=2, node_cores=(8, 4),
                             node_memories=(48 * GiB, 16 * GiB)),
    # A small 2-CPU host like the CI machine.
    "two-cpu": Machine(sockets=1, cores_per_socket=2, threads_per_core=1, node_memory=24 * GiB, flags=FLAGS_SPR,
                       l3_cores=2),
}


# Doctor fixtures: one healthy machine, then one problem each (deploykit doctor --sysroot must flag it with its fix).
ALL_OK = {"numa_calls": {n: "ok" for n in ("get_mempolicy", "set_mempolicy", "mbind", "migrate_pages", "move_pages")},
          "amx_granted": None}
TCMALLOC = (("LD_PRELOAD", "libtcmalloc_minimal.so.4"),)
CAP_SYS_NICE = 1 << 23
HEALTHY = replace(EPYC_9655_2S, numa_balancing=0, thp="always", seccomp=2, cap_eff=0, environ=TCMALLOC, probe=ALL_OK)
DOCKER_DEFAULT_NO_CAPS = {"numa_calls": {n: "EPERM" for n in ALL_OK["numa_calls"]}, "amx_granted": None}
DOCKER_DEFAULT_SYS_NICE = {"numa_calls": {**ALL_OK["numa_calls"], "migrate_pages": "EPERM", "move_pages": "EPERM"},
                           "amx_granted": None}
DOCTOR: dict[str, Machine] = {
    "healthy": HEALTHY,
    "numa-balancing-on": replace(HEALTHY, numa_balancing=1),
    "thp-never": replace(HEALTHY, thp="never"),
    # Docker's default seccomp profile, capabilities dropped: all five NUMA calls refused.
    "seccomp-docker-default": replace(HEALTHY, probe=DOCKER_DEFAULT_NO_CAPS),
    # Docker's default profile with --cap-add SYS_NICE: binding works, page migration does not.
    "seccomp-default-sys-nice": replace(HEALTHY, cap_eff=CAP_SYS_NICE, probe=DOCKER_DEFAULT_SYS_NICE),
    # A snapshot without a probe record, from a filtered process without CAP_SYS_NICE.
    "seccomp-unprobed": replace(HEALTHY, probe=None),
    "quota-below-cpuset": replace(HEALTHY, cpuset="8-23", mems="0", quota=(400000, 100000),
                                  environ=TCMALLOC + (("OMP_NUM_THREADS", "3"),)),
    "omp-threads-over-cpuset": replace(HEALTHY, cpuset="8-15", mems="0", environ=TCMALLOC + (("OMP_NUM_THREADS", "192"),)),
    "omp-threads-over-quota": replace(HEALTHY, cpuset="8-23", mems="0", quota=(400000, 100000),
                                      environ=TCMALLOC + (("OMP_NUM_THREADS", "16"),)),
    "omp-threads-unset-in-cpuset": replace(HEALTHY, cpuset="8-15", mems="0"),
    "omp-threads-on-smt": replace(HEALTHY, environ=TCMALLOC + (("OMP_NUM_THREADS", "380"),)),
    "gomp-affinity-container": replace(HEALTHY, environ=TCMALLOC + (("GOMP_CPU_AFFINITY", "192-286"),)),
    "omp-places-container": replace(HEALTHY, environ=TCMALLOC + (("OMP_PLACES", "cores"), ("OMP_PROC_BIND", "close"))),
    "kmp-with-gomp": replace(HEALTHY, environ=TCMALLOC + (("KMP_AFFINITY", "granularity=fine,compact,1,0"),)),
    "iomp-preloaded": replace(HEALTHY, environ=(("LD_PRELOAD", "libtcmalloc_minimal.so.4:/opt/intel/lib/libiomp5.so"),)),
    "two-runtimes-preloaded": replace(HEALTHY, environ=(("LD_PRELOAD", "libiomp5.so libgomp.so.1 libtcmalloc_minimal.so.4"),)),
    "no-tcmalloc": replace(HEALTHY, environ=()),
    "cpus-offline": replace(HEALTHY, offline=(95, 287)),
    "avx2-only": replace(HEALTHY, flags=FLAGS_DESKTOP, model_name="Desktop CPU"),
    "amx-not-granted": replace(HEALTHY, flags=FLAGS_SPR, model_name="Intel(R) Xeon(R) Platinum 8480+",
                               probe={**ALL_OK, "amx_granted": False}),
    "vllm-bind-across-nodes": replace(HEALTHY, environ=TCMALLOC + (("VLLM_CPU_OMP_THREADS_BIND", "0-383"),)),
}


def write_process(proc: str | Path, pid: int, *, comm: str, ppid: int = 1, pgrp: int = 0, state: str = "S",
                  cpus: str = "0", utime: int = 0, stime: int = 0, start_time: int = 0, processor: int = 0,
                  maps: tuple[str, ...] = (), threads: tuple[tuple[int, str, str], ...] = ()) -> Path:
    """A process as /proc shows it, under `proc` (a directory laid out like /proc): stat, status, maps and one
    task/TID per thread (`threads`: (tid, comm, allowed CPUs); the main thread is always there)."""
    base = Path(proc) / str(pid)

    def stat(tid: int, name: str, cpu: int) -> str:
        f = [state, str(ppid)] + ["0"] * 48  # fields 3-52 of proc(5); field n at f[n - 3]
        f[2], f[11], f[12], f[19], f[36] = str(pgrp), str(utime), str(stime), str(start_time), str(cpu)
        return f"{tid} ({name}) {' '.join(f)}\n"

    def status(name: str, allowed: str) -> str:
        return f"Name:\t{name}\nState:\t{state}\nPid:\t{pid}\nPPid:\t{ppid}\nUid:\t1000\t1000\t1000\t1000\n" \
               f"Cpus_allowed_list:\t{allowed}\nMems_allowed_list:\t0\nSeccomp:\t0\nCapEff:\t0000000000000000\n"

    for tid, name, allowed in ((pid, comm, cpus), *threads):
        t = base / "task" / str(tid)
        t.mkdir(parents=True, exist_ok=True)
        (t / "stat").write_text(stat(tid, name, processor))
        (t / "status").write_text(status(name, allowed))
    (base / "stat").write_text(stat(pid, comm, processor))
    (base / "status").write_text(status(comm, cpus))
    (base / "maps").write_text("".join(f"7f00{i:08x}-7f01{i:08x} r-xp 00000000 08:01 {i} {path}\n"
                                       for i, path in enumerate(maps)))
    return base
