"""Host and container checks: what this machine (or a `--sysroot` snapshot of one) does to CPU inference.

Pure functions of a Topology (deploykit.topology), HostSettings (deploykit.hostsettings) and the CPU flags; the
live probes have already run when HostSettings was read. Each check returns Findings; `host()` groups them.
"""

from __future__ import annotations

import errno
import importlib.util
from pathlib import Path

from .. import cpulist, isa
from ..hostsettings import SECCOMP_MODES, HostSettings
from ..topology import Topology
from ..units import human
from . import fixes, openmp
from .findings import FAIL, INFO, OK, WARN, Finding, Section


def host(topo: Topology, settings: HostSettings, flags: frozenset[str]) -> list[Section]:
    where = "this container's environment" if _in_container(topo) else "this shell's environment"
    if not settings.live:
        where = "the snapshot's environment"
    torch_rt = torch_runtime() if settings.live else None
    env = openmp.env_findings(settings.environ, topo, openmp.Scope(where, everything=True),
                              runtimes=torch_rt, ld_so_preload=settings.ld_so_preload,
                              check_installed=settings.live)
    if not settings.env_known:
        env = [Finding("openmp.environment", INFO, "the snapshot has no environment record (taken before doctor "
                       "existed): OpenMP variables, preloads and tcmalloc not judged",
                       fix=("take the snapshot again with `deploykit topology snapshot`",))]
    return [
        Section("CPU", (isa_tier(topo, flags), amx(flags, settings), smt(topo), offline(topo), cpuset(topo),
                        quota(topo))),
        Section("NUMA and memory", (*nodes(topo), numa_calls(topo, settings), balancing(topo, settings),
                                    hugepages(settings))),
        Section("OpenMP and allocator", tuple(env)),
    ]


def _in_container(topo: Topology) -> bool:
    return Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()


def torch_runtime() -> tuple[str, ...] | None:
    """The OpenMP runtime the installed PyTorch ships (torch/lib), found without importing torch; None if no torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    found = sorted(str(p) for p in lib.glob("*.so*") if openmp.runtime_family(str(p)))
    return tuple(found) or None


def isa_tier(topo: Topology, flags: frozenset[str]) -> Finding:
    tier = isa.tier(flags or frozenset(topo.isa))
    variant = isa.kernel_variant(flags)
    dtype = "bfloat16" if isa.has_bf16(flags or frozenset(topo.isa)) else "float32"
    kernels = {"avx512bf16": "native kernels: the AVX512-BF16 build (vdpbf16ps)",
               "avx512": "native kernels: the AVX-512F build (bf16 widened to fp32 in registers)",
               "avx2": "native kernels for quantized and bf16 weights under fp32 activations, and fp32 element-wise "
                       "ops and attention (the AVX2 build); fp32 weights on PyTorch",
               None: "no native kernels (they need AVX2): PyTorch's own ops"}[variant]
    title = f"ISA tier {tier}: dtype auto resolves to {dtype}; {kernels}"
    evidence = (f"{topo.cpu_model or 'CPU model unknown'}: {' '.join(topo.isa) or 'no AVX2 or newer'}",)
    if tier in ("avx2", "baseline"):
        return Finding("cpu.isa", WARN, title, evidence=evidence,
                       cause="without AVX-512 there are no bf16 units: models run in fp32; expect a fraction of "
                             "an AVX-512 CPU's decode speed" + ("; quantized weights (a GGUF file, or "
                             "model.quantization q8_0/q4_0) stay quantized on the AVX2 int8 kernels, and a bf16 "
                             "checkpoint's matrices stay bf16, widened to fp32 in registers"
                             if variant == "avx2" else "; every matmul runs on PyTorch's generic path"))
    return Finding("cpu.isa", OK, title, evidence=evidence)


def amx(flags: frozenset[str], settings: HostSettings) -> Finding:
    if not {"amx_tile", "amx_bf16"} <= flags:
        return Finding("cpu.amx", OK, "no AMX on this CPU: batched matmuls use AVX-512" if "avx512f" in flags
                       else "no AMX on this CPU")
    granted = settings.probe.amx_granted if settings.probe else None
    if granted is None:
        return Finding("cpu.amx", INFO, "the CPU reports AMX; whether the kernel grants tile state was not probed "
                       "(snapshot without a probe record)")
    if granted:
        return Finding("cpu.amx", OK, "AMX: the CPU has it and the kernel grants tile state (prefill and batched "
                       "decode use tiles)")
    return Finding("cpu.amx", WARN, "the CPU reports AMX but the kernel refused tile state: the engine stays on "
                   "AVX512-BF16", evidence=("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed",),
                   cause="a kernel older than 5.16, or a hypervisor that does not pass the XTILEDATA state through",
                   fix=("run a 5.16+ kernel; on a VM, enable AMX passthrough in the hypervisor",))


def smt(topo: Topology) -> Finding:
    tpc = topo.threads_per_core
    if tpc == 1:
        return Finding("cpu.smt", OK, f"no SMT: {len(topo.cpus)} CPUs are {len(topo.cpus)} physical cores")
    pairs = [c.core for c in topo.cpus if len(c.core) > 1 and c.id == c.core[0]]
    offsets = {core[1] - core[0] for core in pairs}
    ncores = len({c.core for c in topo.cpus})
    if offsets == {1}:
        how = "adjacent: CPUs 2k and 2k+1 share a core"
    elif len(offsets) == 1:
        off = offsets.pop()
        how = f"offset: CPU i and i+{off} share a core" + (" (the usual Linux numbering)" if off == ncores else "")
    else:
        how = "irregular: read thread_siblings_list, never assume a pattern"
    return Finding("cpu.smt", OK, f"SMT {tpc}: {len(topo.cpus)} CPUs on {ncores} physical cores; siblings {how}",
                   evidence=(f"e.g. core of CPU {pairs[0][0]}: CPUs {cpulist.format(pairs[0])}",) if pairs else ())


def offline(topo: Topology) -> Finding:
    if not topo.offline:
        return Finding("cpu.offline", OK, "every present CPU is online")
    first = topo.offline[0]
    return Finding("cpu.offline", WARN, f"{len(topo.offline)} CPU(s) offline: {cpulist.format(topo.offline)}",
                   evidence=("sys/devices/system/cpu/online lists only the others",),
                   cause="taken offline (by hand, a tuning profile, or the firmware); plans skip them",
                   fix=(f"echo 1 > /sys/devices/system/cpu/cpu{first}/online (for each), if that was not intended",))


def cpuset(topo: Topology) -> Finding:
    allowed = topo.allowed_cpus
    cores = len({topo.cpu(c).core for c in allowed})
    if len(allowed) == len(topo.cpus):
        return Finding("cpu.cpuset", OK, f"this process may use all {len(allowed)} online CPUs ({cores} physical "
                       "cores)")
    return Finding("cpu.cpuset", OK, f"this process may use {len(allowed)} of {len(topo.cpus)} CPUs: "
                   f"{cpulist.format(allowed)} ({cores} physical cores)",
                   evidence=("affinity ∩ cgroup cpuset (Cpus_allowed_list, cpuset.cpus.effective)",))


def quota(topo: Topology) -> Finding:
    q = topo.quota_cpus
    n = len(topo.allowed_cpus)
    if q is None:
        return Finding("cpu.quota", OK, "no CFS quota")
    if q + 1e-9 >= n:
        return Finding("cpu.quota", OK, f"CFS quota {q:g} CPUs covers the {n} CPUs allowed")
    choice = fixes.thread_choice(topo)
    threads = len(choice.cpus) if choice else max(1, int(q))
    return Finding("cpu.quota", WARN, f"CFS quota of {q:g} CPUs below the {n}-CPU cpuset: a runtime that starts {n} "
                   f"threads spends the quota early in each period, then every thread waits",
                   evidence=(f"cpu.max / cpu.cfs_quota_us: {q:g} CPUs", f"allowed CPUs {cpulist.format(topo.allowed_cpus)}"),
                   cause="a CPU limit without exclusive CPUs (docker --cpus, a Kubernetes limit without the static "
                         "CPU manager)",
                   fix=(f"give exclusive CPUs instead: docker run --cpuset-cpus=<{int(q)} CPUs> without --cpus; "
                        "Kubernetes: Guaranteed QoS with an integer CPU count and the static CPU manager policy",
                        f"or size the pool to the quota: OMP_NUM_THREADS={threads} (deploykit plans ⌊quota⌋ minus "
                        "the front end's core)"))


def nodes(topo: Topology) -> list[Finding]:
    cpu_nodes = [n for n in topo.nodes if n.cpus]
    lines = tuple(f"node {n.id}: CPUs {cpulist.format(n.cpus)}, {human(n.memory_bytes)}"
                  + ("" if n.id in topo.allowed_mems or not n.memory_bytes else " (memory not allowed here)")
                  for n in topo.nodes)
    out = [Finding("numa.nodes", OK, f"{len(topo.nodes)} NUMA node(s), {len(cpu_nodes)} with CPUs",
                   evidence=lines)]
    for n in topo.nodes:
        if not n.cpus and n.memory_bytes:
            out.append(Finding("numa.memory_only", INFO, f"node {n.id} is memory-only ({human(n.memory_bytes)}, "
                               "CXL or HBM): never a replica; used only when placement.memory_nodes lists it"))
        elif n.cpus and not n.memory_bytes:
            out.append(Finding("numa.cpu_only", WARN, f"node {n.id} has CPUs but no memory: its threads always read "
                               "remote memory", evidence=(f"node {n.id} MemTotal 0",),
                               cause="unpopulated DIMM slots, or a BIOS NUMA-per-socket setting",
                               fix=("populate memory on every socket, or keep inference off those CPUs "
                                    "(placement.numa_nodes)",)))
    return out


def numa_calls(topo: Topology, settings: HostSettings, probed_on: str = "this process's own memory",
               context: tuple[str, ...] = ()) -> Finding:
    """`probed_on` and `context` say where the probe ran when it is not doctor's own process (a container)."""
    mode = settings.seccomp_mode
    ctx = [*context, f"seccomp mode {mode} ({SECCOMP_MODES.get(mode, '?')})" if mode is not None else "seccomp mode unknown"]
    if settings.has_sys_nice is not None:
        ctx.append("CAP_SYS_NICE " + ("held" if settings.has_sys_nice else "not held"))
    p = settings.probe
    if p is None:
        if mode == 2 and settings.has_sys_nice is False:
            return Finding("numa.syscalls", WARN, "a seccomp filter is active without CAP_SYS_NICE: under Docker's or "
                           "containerd's default profile every NUMA call is refused (not probed: the snapshot has "
                           "no probe record)", evidence=tuple(ctx), fix=fixes.numa_calls(fixes.NUMA_CALLS))
        return Finding("numa.syscalls", INFO, "NUMA calls not probed (the snapshot has no probe record)",
                       evidence=tuple(ctx))
    calls = ", ".join(f"{n} {errno.errorcode.get(e, e) if e else 'ok'}" for n, e in p.numa_calls)
    evidence = tuple(ctx) + (f"probe on {probed_on}: {calls}",)
    if all(e == errno.ENOSYS for _, e in p.numa_calls):
        return Finding("numa.syscalls", INFO, "the kernel has no NUMA support (ENOSYS): nothing to bind",
                       evidence=evidence)
    refused = p.refused
    if refused:
        core = {"set_mempolicy", "mbind", "get_mempolicy"} & set(refused)
        why = ("a seccomp filter refuses them (they need no capability on the caller's own memory)" if mode == 2
               else "refused although no seccomp filter is active: an LSM (AppArmor, SELinux) policy?")
        title = f"NUMA calls refused (EPERM): {', '.join(refused)}"
        if core:
            title += ": memory cannot be bound to the threads' node"
            level = FAIL if len([n for n in topo.nodes if n.memory_bytes]) > 1 else WARN
        else:
            title += ": new memory binds, but pages touched before binding cannot move"
            level = WARN
        return Finding("numa.syscalls", level, title, evidence=evidence, cause=why,
                       fix=fixes.numa_calls(refused) if mode == 2 else ())
    if p.failed:
        return Finding("numa.syscalls", WARN, "NUMA calls failed: " + ", ".join(
            f"{n} {errno.errorcode.get(e, e)}" for n, e in p.failed), evidence=evidence)
    return Finding("numa.syscalls", OK, "NUMA calls allowed: " + ", ".join(n for n, _ in p.numa_calls),
                   evidence=evidence)


def balancing(topo: Topology, settings: HostSettings) -> Finding:
    v = settings.numa_balancing
    multi = len([n for n in topo.nodes if n.cpus]) > 1
    if v is None and not settings.live:
        return Finding("numa.balancing", INFO, "automatic NUMA balancing not recorded in the snapshot")
    if v is None:
        return Finding("numa.balancing", OK, "automatic NUMA balancing not available in this kernel")
    if not v:
        return Finding("numa.balancing", OK, "automatic NUMA balancing off")
    if not multi:
        return Finding("numa.balancing", OK, f"automatic NUMA balancing on (mode {v}), harmless with one node")
    return Finding("numa.balancing", WARN, f"automatic NUMA balancing on (mode {v}): the kernel unmaps pages to "
                   "sample accesses and migrates pages and threads between nodes",
                   evidence=("/proc/sys/kernel/numa_balancing = " + str(v),),
                   cause="with threads pinned and memory bound, balancing only adds hinting page faults and moves "
                         "weights away from the threads that read them",
                   fix=("sysctl -w kernel.numa_balancing=0",
                        "persist it: echo kernel.numa_balancing=0 > /etc/sysctl.d/90-inference.conf"))


def hugepages(settings: HostSettings) -> Finding:
    mode = settings.thp_enabled
    if mode is None:
        return Finding("memory.thp", INFO, "transparent hugepages: unknown (no sys/kernel/mm/transparent_hugepage)")
    defrag = f"defrag {settings.thp_defrag}" if settings.thp_defrag else ""
    if mode == "always":
        return Finding("memory.thp", OK, "transparent hugepages always: weights and KV cache get 2 MiB pages",
                       evidence=(defrag,) if defrag else ())
    if mode == "madvise":  # deploykit's engine asks for its weights and KV cache itself (engine/hugepages.py)
        asks = settings.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
        return Finding("memory.thp", OK,
                       "transparent hugepages madvise: memory that asks gets 2 MiB pages; deploykit's engine asks for "
                       "its weights and KV cache"
                       + ("; PyTorch's allocator asks too (THP_MEM_ALLOC_ENABLE=1)" if asks else
                          "; other PyTorch runtimes (vLLM) ask only with THP_MEM_ALLOC_ENABLE=1"),
                       evidence=(defrag,) if defrag else ())
    return Finding("memory.thp", WARN, "transparent hugepages never: every tensor sits on 4 KiB pages; batch-1 decode "
                   "streams its weights 1.2-1.5x slower (TLB misses, and the prefetcher stops at every page)",
                   fix=("echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (deploykit's engine asks for its "
                        "weights; other PyTorch runtimes also need THP_MEM_ALLOC_ENABLE=1)",))
