"""`deploykit doctor --pid PID`: sample a running process and its children from /proc and judge them."""

from __future__ import annotations

from dataclasses import replace

from .. import cgroups, topology
from ..process import Sample, read, sample
from . import openmp
from .findings import INFO, Finding, Report, Section
from .threads import Context, analyse


def examine_pid(pid: int, seconds: float, *, during=None, driven: str = "",
                omp_tids: frozenset[int] | None = None, extra: tuple[Section, ...] = ()) -> Report:
    root = read(pid)  # a clear TargetError when the process is gone or hidden
    topo = topology.read("/", pid=pid)
    # What the process may use is its cgroup's cpuset: its main thread's affinity may itself be the symptom (narrowed
    # to one CPU by GOMP_CPU_AFFINITY), so it is judged with the threads, not used as the yardstick.
    topo = replace(topo, allowed_cpus=topo.cpuset or tuple(c.id for c in topo.cpus))
    before = cgroups.throttling("/", pid)
    s = sample(pid, seconds, during)
    after = cgroups.throttling("/", pid)
    ctx = Context(topo, after - before if before is not None and after is not None else None, omp_tids, driven)
    sections = list(extra) + analyse(s, ctx)
    hidden = sorted({f for p in s.after.values() for f in p.unreadable})
    if hidden:
        sections.insert(0, Section("Access", (Finding(
            "access.partial", INFO, f"/proc/PID/{{{','.join(hidden)}}} of processes owned by uid {root.uid} are not "
            "readable by this user: their OpenMP runtimes, environment and NUMA pages are not judged",
            fix=(f"run doctor as uid {root.uid} or as root (sudo deploykit doctor --pid {pid})",)),)))
    return Report(f"{root.label}, {len(s.after)} process(es), sampled for {s.seconds:.1f} s", tuple(sections),
                  data=_data(s))


def _data(s: Sample) -> dict:
    out = []
    for pid, p in s.after.items():
        use = s.use(pid)
        out.append({"pid": pid, "ppid": p.ppid, "name": p.name, "cmdline": p.cmdline, "uid": p.uid,
                    "seccomp": p.seccomp, "openmp_runtimes": [lib for lib in p.libraries or ()
                                                              if openmp.runtime_family(lib)],
                    "environment": p.env, "numa_pages": p.numa_pages,
                    "threads": [{"tid": t.tid, "name": t.name, "allowed_cpus": list(t.allowed), "last_cpu": t.last_cpu,
                                 "cpu_use": round(use.get(t.tid, 0.0), 3)} for t in p.threads]})
    return {"seconds": round(s.seconds, 3), "processes": out}
