"""The engine's binding report (GET /debug/binding) as frozen dataclasses, and its JSON form.

The engine builds it (engine/binding.py), `deploykit doctor --url`, `deploykit status` and the chart's `helm test`
(charts/deploykit/files/placement_check.py) read it back with `from_dict`. The JSON keys are stable: CPU and node
sets are written in the Linux list syntax ("0-3,8"), as the kernel and every other deploykit output write them.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import cpulist
from .errors import TargetError
from .topology import Topology


def _fmt(cpus: tuple[int, ...] | None) -> str | None:
    return None if cpus is None else cpulist.format(cpus)


def _parse(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else cpulist.parse(text)


@dataclass(frozen=True, slots=True)
class ThreadReport:
    """One thread of the engine process."""

    tid: int
    name: str
    omp_thread: int | None  # its index in the OpenMP team; None: not an OpenMP worker
    allowed_cpus: tuple[int, ...]
    last_cpu: int
    # the L3 (last-level cache) group of the CPU it is pinned to (else the one it last ran on); None when the host
    # does not say
    l3: int | None
    cpu_seconds: float
    wait_seconds: float = 0.0  # runnable but waiting for a CPU

    def to_dict(self) -> dict:
        return {"tid": self.tid, "name": self.name, "omp_thread": self.omp_thread,
                "allowed_cpus": cpulist.format(self.allowed_cpus), "last_cpu": self.last_cpu, "l3": self.l3,
                "cpu_seconds": self.cpu_seconds, "wait_seconds": self.wait_seconds}

    @classmethod
    def from_dict(cls, d: dict) -> ThreadReport:
        return cls(d["tid"], d["name"], d["omp_thread"], cpulist.parse(d["allowed_cpus"]), d["last_cpu"], d["l3"],
                   d["cpu_seconds"], d["wait_seconds"])


@dataclass(frozen=True, slots=True)
class MemoryPolicy:
    """get_mempolicy's answer in the engine process, or why it failed."""

    mode: str | None = None  # default | bind | interleave | preferred | ...
    nodes: tuple[int, ...] = ()
    error: str | None = None

    @property
    def bound(self) -> bool:
        return self.mode in ("bind", "interleave")

    def to_dict(self) -> dict:
        return {"error": self.error} if self.error is not None else {"mode": self.mode,
                                                                     "nodes": cpulist.format(self.nodes)}

    @classmethod
    def from_dict(cls, d: dict) -> MemoryPolicy:
        if "error" in d:
            return cls(error=d["error"])
        return cls(d["mode"], cpulist.parse(d["nodes"]))


@dataclass(frozen=True, slots=True)
class EngineReport:
    """The engine process as it sees itself: what it was asked to do (plan or policy), what the kernel says every
    thread may use, its memory policy, and what `deploykit doctor --url` judges (environment, libraries, pages per
    node, its view of the topology)."""

    pid: int
    source: str  # plan | auto | explicit | env | none | unknown
    cpuset: tuple[int, ...]  # what the container or pod was given (cgroup cpuset ∩ affinity at start)
    physical_cores: tuple[tuple[int, ...], ...]  # the cpuset grouped by physical core
    omp_threads: int | None
    planned_cpus: tuple[int, ...] | None  # OpenMP thread i on planned_cpus[i]; None: no binding was applied
    frontend_cpus: tuple[int, ...] | None
    planned_mems: tuple[int, ...] | None
    memory_policy: MemoryPolicy
    mems_allowed: tuple[int, ...]
    quota_cpus: float | None
    openmp_runtimes: tuple[str, ...]
    threads: tuple[ThreadReport, ...]
    warnings: tuple[str, ...]
    notes: tuple[str, ...]
    libraries: tuple[str, ...]  # mapped OpenMP runtimes and fast allocators
    environment: dict[str, str] | None  # the OpenMP/allocator variables; None when unreadable
    seccomp: int | None
    numa_pages: dict[str, dict[int, int]] | None  # memory policy -> {node: bytes}; None when unreadable
    topology: Topology
    weights: dict | None = None  # how the model's weights are held (the server adds it once the model is loaded)

    @property
    def omp(self) -> tuple[ThreadReport, ...]:
        """The OpenMP workers, in team order."""
        return tuple(sorted((t for t in self.threads if t.omp_thread is not None), key=lambda t: t.omp_thread))

    @property
    def threads_allowed_union(self) -> tuple[int, ...]:
        """What the process spans (the main thread's own affinity is narrowed to one CPU)."""
        return tuple(sorted({c for t in self.threads for c in t.allowed_cpus}))

    def to_dict(self) -> dict:
        out = {"pid": self.pid, "source": self.source, "cpuset": cpulist.format(self.cpuset),
               "physical_cores": [cpulist.format(core) for core in self.physical_cores],
               "omp_threads": self.omp_threads, "planned_cpus": _fmt(self.planned_cpus),
               "frontend_cpus": _fmt(self.frontend_cpus), "planned_mems": _fmt(self.planned_mems),
               "memory_policy": self.memory_policy.to_dict(), "mems_allowed": cpulist.format(self.mems_allowed),
               "threads_allowed_union": cpulist.format(self.threads_allowed_union), "quota_cpus": self.quota_cpus,
               "openmp_runtimes": list(self.openmp_runtimes), "threads": [t.to_dict() for t in self.threads],
               "warnings": list(self.warnings), "notes": list(self.notes), "libraries": list(self.libraries),
               "environment": self.environment, "seccomp": self.seccomp,
               "numa_pages": None if self.numa_pages is None else
               {policy: {str(n): v for n, v in nodes.items()} for policy, nodes in self.numa_pages.items()},
               "topology": self.topology.to_dict()}
        return out if self.weights is None else {**out, "weights": self.weights}

    @classmethod
    def from_dict(cls, d: dict) -> EngineReport:
        pages = d["numa_pages"]
        return cls(
            pid=d["pid"], source=d["source"], cpuset=cpulist.parse(d["cpuset"]),
            physical_cores=tuple(cpulist.parse(c) for c in d["physical_cores"]), omp_threads=d["omp_threads"],
            planned_cpus=_parse(d["planned_cpus"]), frontend_cpus=_parse(d["frontend_cpus"]),
            planned_mems=_parse(d["planned_mems"]), memory_policy=MemoryPolicy.from_dict(d["memory_policy"]),
            mems_allowed=cpulist.parse(d["mems_allowed"]), quota_cpus=d["quota_cpus"],
            openmp_runtimes=tuple(d["openmp_runtimes"]), threads=tuple(ThreadReport.from_dict(t) for t in d["threads"]),
            warnings=tuple(d["warnings"]), notes=tuple(d["notes"]), libraries=tuple(d["libraries"]),
            environment=d["environment"], seccomp=d["seccomp"],
            numa_pages=None if pages is None else
            {policy: {int(n): v for n, v in nodes.items()} for policy, nodes in pages.items()},
            topology=Topology.from_dict(d["topology"]), weights=d.get("weights"))


@dataclass(frozen=True, slots=True)
class FrontendReport:
    """The HTTP/tokenizer process: where it may run."""

    pid: int
    allowed_cpus: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"pid": self.pid, "allowed_cpus": cpulist.format(self.allowed_cpus)}

    @classmethod
    def from_dict(cls, d: dict) -> FrontendReport:
        return cls(d["pid"], cpulist.parse(d["allowed_cpus"]))


@dataclass(frozen=True, slots=True)
class BindingReport:
    """GET /debug/binding: the engine-core process and the front end."""

    engine: EngineReport
    frontend: FrontendReport

    def to_dict(self) -> dict:
        return {"engine": self.engine.to_dict(), "frontend": self.frontend.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> BindingReport:
        """The inverse of to_dict; TargetError names the first key that does not fit (an older or foreign
        server)."""
        try:
            return cls(EngineReport.from_dict(d["engine"]), FrontendReport.from_dict(d["frontend"]))
        except KeyError as e:
            raise TargetError("not a deploykit binding report", path=f"/debug/binding: {e.args[0]}",
                              hint="doctor, status and the engine come from one deploykit version: upgrade the "
                                   "older one") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise TargetError(f"not a deploykit binding report: {e}", path="/debug/binding") from None
