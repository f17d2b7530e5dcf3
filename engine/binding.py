"""Pin the engine process: one OpenMP thread per chosen CPU, memory bound to the plan's NUMA nodes, and a report
that shows every thread of the process (the proof that placement is what the plan says).

Two phases, because OpenMP reads its environment when the runtime loads:
  prepare(binding)  before `import torch`: thread count + GOMP/KMP affinity env, set_mempolicy, migrate_pages;
  finish(binding)   after: lock torch's thread count, start the pool, verify every worker is on its own CPU
                    (pin by tid if the runtime ignored the env), check that only one OpenMP runtime is mapped.
GOMP_CPU_AFFINITY also narrows the calling thread to the first CPU, and threads created later inherit that:
helper threads must call `pin_helper_thread()` (or live in another process) so they never sit on a worker's CPU.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from dataclasses import dataclass, field

from deploykit import cpulist, numa, placement, process, procfs, topology
from deploykit.binding_report import EngineReport, MemoryPolicy, ThreadReport

log = logging.getLogger("engine.binding")
_FIX = ("run the container with deploykit's seccomp profile (what `deploykit render` writes: seccomp.json for Docker, "
        "a Localhost profile in Kubernetes), which allows these calls with no capability; Docker's and containerd's "
        "default profiles refuse them unless the container has CAP_SYS_NICE")


@dataclass(slots=True)
class Binding:
    """What this process was asked to do (first five fields) and what applying it found (warnings, tids)."""

    cpus: tuple[int, ...]  # OpenMP thread i runs on cpus[i]; () = not pinned
    frontend_cpus: tuple[int, ...]  # where the HTTP/tokenizer side and helper threads go; () = share cpus
    mems: tuple[int, ...]  # NUMA nodes for memory; () = leave the policy alone
    threads: int
    source: str  # plan | auto | explicit | none
    notes: tuple[str, ...] = ()
    cpuset: tuple[int, ...] = ()  # what the process was given (cgroup cpuset ∩ affinity) before any pinning
    warnings: list[str] = field(default_factory=list, compare=False)  # filled by prepare()/finish()
    omp_tids: list[int] = field(default_factory=list, compare=False)


def resolve(mode: placement.BindingMode = "auto", *, frontend_cpus: tuple[int, ...] | None = None,
            mems: tuple[int, ...] | None = None, reserved: int | None = None, use_smt: bool = False,
            threads: int | None = None, sysroot: str = "/") -> Binding:
    """`mode`: "none", "auto" (this process's cpuset, one thread per physical core minus the front end's), or the
    CPUs themselves (OpenMP thread i on mode[i]). Explicit `frontend_cpus`/`mems` override the choice (() = share
    the inference CPUs / leave the memory policy alone; None = decide).

    "auto" applies deploykit.placement's policy to whatever cpuset and CFS quota this process got (a Kubernetes
    pod's CPUs are chosen by the kubelet, never by us): `reserved` physical cores for the front end (None: the
    default rule), `use_smt` threads on every sibling, at most `threads` OpenMP threads."""
    if isinstance(mode, str) and mode not in ("auto", "none"):
        raise ValueError(f"binding must be auto, none or a tuple of CPU ids, not {mode!r} (parse CPU-list text with "
                         "deploykit.placement.parse_binding)")
    topo = topology.read(sysroot)
    if mode == "none":
        n = len(topo.allowed_cpus)
        if topo.quota_cpus is not None:
            n = max(1, min(n, int(topo.quota_cpus)))
        return Binding((), (), (), n, "none", cpuset=topo.allowed_cpus)
    if mode == "auto":
        front = frontend_cpus or None
        cands = [c for c in topo.allowed_cpus if front is None or c not in front]
        ch = placement.choose(topo, cands, reserved=0 if front is not None else reserved, use_smt=use_smt,
                              threads=threads, quota=topo.quota_cpus, label="engine")
        cpus, front_cpus, notes, source = ch.cpus, front if front is not None else ch.frontend_cpus, ch.notes, "auto"
    else:
        cpus = tuple(mode)
        outside = sorted(set(cpus) - set(topo.allowed_cpus))
        if outside:
            raise ValueError(f"binding CPUs {cpulist.format(outside)} are outside this process's cpuset "
                             f"{cpulist.format(topo.allowed_cpus)}")
        front_cpus = frontend_cpus or ()
        notes, source = (), "explicit"
    if mems is not None:
        mem_nodes = tuple(mems)
    else:
        mem_nodes = tuple(sorted({topo.cpu(c).node for c in cpus} & set(topo.allowed_mems)))
    return Binding(tuple(cpus), tuple(front_cpus), mem_nodes, len(cpus), source, tuple(notes),
                   cpuset=topo.allowed_cpus)


def prepare(b: Binding) -> Binding:
    """Environment and memory policy; call before torch (or any OpenMP library) is imported."""
    if b.source != "none" and _omp_loaded():
        b.warnings.append("an OpenMP runtime was loaded before binding; workers are pinned by thread id instead of "
                          "by GOMP_CPU_AFFINITY (start the engine in a fresh process to avoid this)")
    os.environ["OMP_NUM_THREADS"] = str(b.threads)
    if b.cpus:
        for var in ("OMP_PROC_BIND", "OMP_PLACES"):  # these override GOMP_CPU_AFFINITY in libgomp
            if os.environ.pop(var, None) is not None:
                b.warnings.append(f"ignored {var} from the environment: the plan's CPU list decides placement")
        os.environ["GOMP_CPU_AFFINITY"] = " ".join(map(str, b.cpus))
        os.environ["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{','.join(map(str, b.cpus))}]"
    if b.mems:
        _bind_memory(b)
    return b


def _bind_memory(b: Binding) -> None:
    mode = numa.MPOL_BIND if len(b.mems) == 1 else numa.MPOL_INTERLEAVE  # spread bandwidth over several nodes
    try:
        numa.set_mempolicy(mode, b.mems)
    except OSError as e:
        why = ("refused (EPERM): the seccomp profile blocks it" if e.errno == errno.EPERM
               else f"failed: {e.strerror}")
        b.warnings.append(f"NUMA memory binding to node(s) {cpulist.format(b.mems)} {why}; memory may land on a "
                          f"remote node and decode slows down. Fix: {_FIX}")
        return
    try:
        allowed = _mems_allowed()
        others = [n for n in allowed if n not in b.mems]
        if others:  # pages touched before binding (interpreter, imports) move to the plan's nodes
            left = numa.migrate_pages(b.mems, others)
            if left:
                b.warnings.append(f"migrate_pages left {left} page(s) on other nodes")
    except OSError as e:
        b.warnings.append(f"migrate_pages {'refused (EPERM)' if e.errno == errno.EPERM else 'failed'}: pages touched "
                          f"before binding stay where they are. Fix: {_FIX}")


def finish(b: Binding) -> Binding:
    """After torch is imported: lock the thread count, start the pool, make sure each worker has its own CPU."""
    import torch

    torch.set_num_threads(b.threads)
    before = set(_tids())
    x = torch.ones(256, 256)
    for _ in range(3):  # a parallel region starts the OpenMP pool
        x = x @ x * 0.0
    b.omp_tids[:] = [os.getpid()] + sorted(set(_tids()) - before)
    if b.cpus:
        for i, tid in enumerate(b.omp_tids[: len(b.cpus)]):
            want = {b.cpus[i]}
            try:
                if os.sched_getaffinity(tid) != want:
                    os.sched_setaffinity(tid, want)
            except OSError as e:
                b.warnings.append(f"could not pin thread {tid} to CPU {b.cpus[i]}: {e.strerror}")
        helpers = set(b.frontend_cpus or b.cpus)
        for tid in set(_tids()) - set(b.omp_tids):  # threads born during import inherited the first CPU
            try:
                os.sched_setaffinity(tid, helpers)
            except OSError:
                pass
    runtimes = omp_runtimes()
    if len(runtimes) > 1:
        b.warnings.append(f"{len(runtimes)} OpenMP runtimes are loaded ({', '.join(runtimes)}): their thread pools "
                          "fight over the same cores (the classic 'one core busy'). Remove the extra one from "
                          "LD_PRELOAD or the environment")
    for w in b.warnings:
        log.warning("binding: %s", w)
    log.info("binding (%s): %d OpenMP threads on CPUs %s, front end %s, memory %s", b.source, b.threads,
             cpulist.format(b.cpus) or "unpinned", cpulist.format(b.frontend_cpus) or "shared",
             cpulist.format(b.mems) or "unbound")
    return b


def pin_helper_thread(b: Binding) -> None:
    """Call first thing in any non-OpenMP thread of the engine process (IPC, timers)."""
    target = b.frontend_cpus or b.cpus
    if target:
        try:
            os.sched_setaffinity(0, set(target))
        except OSError:
            pass


def omp_runtimes() -> list[str]:
    try:
        return list(procfs.omp_runtimes(procfs.read_mapped_files()))
    except OSError:
        return []


def _omp_loaded() -> bool:
    return "torch" in sys.modules or bool(omp_runtimes())


def _mems_allowed() -> tuple[int, ...]:
    return procfs.status_list(procfs.read_status(), "Mems_allowed_list") or ()


def _tids() -> list[int]:
    return procfs.tids()


def report(b: Binding | None = None) -> EngineReport:
    """Every thread of this process with its allowed CPUs, last CPU and CPU time; memory policy; quota; and what
    `deploykit doctor --url` judges (environment, libraries, pages per node, this process's view of the topology),
    read with the same /proc reader doctor uses on any process."""
    omp = {tid: i for i, tid in enumerate(b.omp_tids)} if b else {}
    me = process.read(os.getpid())
    topo = topology.read("/")
    l3 = {c.id: c.l3 for c in topo.cpus}
    threads = tuple(ThreadReport(t.tid, t.name, omp.get(t.tid), t.allowed, t.last_cpu,
                                 l3.get(t.allowed[0] if len(t.allowed) == 1 else t.last_cpu),
                                 round(t.cpu_ns / 1e9, 6), round(t.wait_ns / 1e9, 6)) for t in me.threads)
    try:
        mode, nodes = numa.get_mempolicy()
        policy = MemoryPolicy(numa.MODE_NAMES.get(mode, str(mode)), tuple(nodes))
    except OSError as e:
        policy = MemoryPolicy(error=e.strerror)
    given = (b.cpuset if b and b.cpuset else None) or topo.allowed_cpus  # after pinning, affinity is narrower
    libs = me.libraries or ()
    return EngineReport(
        pid=os.getpid(), source=b.source if b else "unknown", cpuset=tuple(given),
        physical_cores=tuple(placement.physical_cores(topo, given)), omp_threads=b.threads if b else None,
        planned_cpus=b.cpus if b else None, frontend_cpus=b.frontend_cpus if b else None,
        planned_mems=b.mems if b else None, memory_policy=policy, mems_allowed=me.mems_allowed,
        quota_cpus=topo.quota_cpus,
        # from the one /proc read above (maps, status), not read again
        openmp_runtimes=procfs.omp_runtimes(libs), threads=threads,
        warnings=tuple(b.warnings) if b else (), notes=tuple(b.notes) if b else (),
        libraries=tuple(lib for lib in libs if procfs.OMP_RUNTIME.search(lib) or procfs.FAST_MALLOC.search(lib)),
        environment=me.env, seccomp=me.seccomp, numa_pages=me.numa_pages, topology=topo)
