"""Binding reports (what GET /debug/binding returns) built field by field, for tests of their readers: the chart's
`helm test` check, `deploykit status`."""
from __future__ import annotations

from deploykit import cpulist
from deploykit.binding_report import EngineReport, MemoryPolicy, ThreadReport
from deploykit.topology import Cpu, Node, Topology

# A pod of 4 whole cores (host CPUs 8-11 with siblings 200-203), as the kubelet's static policy gives it.
POD_CORES = ("8,200", "9,201", "10,202", "11,203")


def topology(cores: tuple[str, ...] = POD_CORES) -> Topology:
    """The host as the engine sees it: only the CPUs of `cores` (CPU lists of SMT siblings), one NUMA node."""
    cpus = tuple(sorted((Cpu(c, 0, 0, cpulist.parse(core)) for core in cores for c in cpulist.parse(core)),
                        key=lambda c: c.id))
    ids = tuple(c.id for c in cpus)
    return Topology(cpus=cpus, offline=(), nodes=(Node(0, ids, 64 << 30),), allowed_cpus=ids, allowed_mems=(0,),
                    quota_cpus=None, memory_limit_bytes=None, isa=(), cpu_model="test", source="test", cpuset=ids)


def engine_report(omp: list[str], front: str = "", *, cores: tuple[str, ...] = POD_CORES, cpuset: str | None = None,
                  memory_policy: MemoryPolicy = MemoryPolicy("bind", (0,)), other_cpus: str | None = None,
                  **fields) -> EngineReport:
    """OpenMP thread i pinned to omp[i] (a CPU list), the front end on `front`, one more thread on `other_cpus`
    (default: the front end's CPUs, else the cpuset)."""
    topo = topology(cores)
    given = cpulist.parse(cpuset) if cpuset is not None else topo.allowed_cpus
    threads = [ThreadReport(100 + i, "python", i, cpulist.parse(c), cpulist.parse(c)[0], None, 1.0)
               for i, c in enumerate(omp)]
    other = cpulist.parse(other_cpus if other_cpus is not None else front or cpulist.format(given))
    threads.append(ThreadReport(99, "python", None, other, other[0], None, 0.1))
    planned = tuple(c for core in omp for c in cpulist.parse(core))
    values = dict(pid=99, source="auto", cpuset=given, physical_cores=tuple(cpulist.parse(c) for c in cores),
                  omp_threads=len(omp), planned_cpus=planned, frontend_cpus=cpulist.parse(front),
                  planned_mems=(0,), memory_policy=memory_policy, mems_allowed=(0,), quota_cpus=None,
                  openmp_runtimes=("/usr/lib/libgomp.so.1",), threads=tuple(threads), warnings=(), notes=(),
                  libraries=("/usr/lib/libgomp.so.1",), environment={}, seccomp=2, numa_pages={"bind": {0: 1 << 20}},
                  topology=topo)
    return EngineReport(**(values | fields))
