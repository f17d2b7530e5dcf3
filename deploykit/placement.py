"""CPU placement policy: which logical CPUs a replica computes on and which serve its front end.

Shared by the planner (render time, whole machine) and the engine's binding (start-up, inside whatever cpuset
the container or pod got). Pure functions over a Topology.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from . import cpulist
from .errors import PlanError
from .topology import Topology

# What an engine is told to bind to: "auto" (deploykit's policy over the cpuset it got), "none" (unpinned), or the
# CPUs themselves, OpenMP thread i on the ith. CPU-list text becomes one only at the edges (flags, environment).
BindingMode = Literal["auto", "none"] | tuple[int, ...]


def parse_binding(text: str) -> BindingMode:
    """'auto' | 'none' | a CPU list ('0-3,8') -> BindingMode; ValueError says what is allowed."""
    if text in ("auto", "none"):
        return text  # type: ignore[return-value]
    try:
        cpus = cpulist.parse(text)
    except ValueError as e:
        raise ValueError(f"must be auto, none or a CPU list like 0-3,8: {e}") from None
    if not cpus:
        raise ValueError("must be auto, none or a CPU list like 0-3,8, not empty")
    return cpus


@dataclass(frozen=True, slots=True)
class CpuChoice:
    cpus: tuple[int, ...]  # one OpenMP thread each
    frontend_cpus: tuple[int, ...]  # HTTP/tokenizer process; () = shares the inference CPUs
    notes: tuple[str, ...]  # what was adjusted and why, for the plan's warnings

def physical_cores(topo: Topology, candidates: Iterable[int]) -> list[tuple[int, ...]]:
    """Candidates grouped by physical core (allowed siblings only), cores ordered by their lowest CPU id."""
    cand = set(candidates)
    cores: dict[tuple[int, ...], tuple[int, ...]] = {}
    for c in topo.cpus:
        if c.id in cand:
            cores.setdefault(c.core, tuple(s for s in c.core if s in cand))
    return sorted(cores.values(), key=min)

SMALL_REPLICA_CORES = 4  # below this, reserving a core for the front end costs more than it saves

def choose(topo: Topology, candidates: Iterable[int], *, reserved: int | None = None, use_smt: bool = False,
           threads: int | None = None, quota: float | None = None, label: str = "replica") -> CpuChoice:
    """One OpenMP thread per physical core (all siblings if use_smt); the last `reserved` cores go to the front
    end, both siblings included (a different physical core, so tokenization never steals an inference core).

    `reserved=None` is the default policy: 1 core, or 0 when the replica has fewer than SMALL_REPLICA_CORES
    cores (on a 2-core host one reserved core would halve inference for a mostly idle HTTP loop).

    `quota` (CPUs of CFS time) caps inference threads at floor(quota) minus the front end's share: more threads
    than the quota only buys throttling. `threads` caps them explicitly.
    """
    cores = physical_cores(topo, candidates)
    if not cores:
        raise PlanError(f"{label}: no usable CPU", hint="check the cpuset / placement.numa_nodes")
    notes: list[str] = []
    if reserved is None:
        reserved = 1 if len(cores) >= SMALL_REPLICA_CORES else 0
        if not reserved:
            notes.append(f"{label}: only {len(cores)} physical core(s), so none is reserved for the front end; it "
                         "shares the inference CPUs (set placement.reserved_cpus: 1 to reserve one anyway)")
    elif reserved and len(cores) <= reserved:
        new = len(cores) - 1
        notes.append(f"{label}: only {len(cores)} physical core(s), so {new} instead of {reserved} reserved for "
                     f"the front end" + ("; it shares the inference CPUs" if new == 0 else ""))
        reserved = new
    front = cores[len(cores) - reserved:] if reserved else []
    compute = cores[:len(cores) - reserved]
    cpus = [c for core in compute for c in (core if use_smt else core[:1])]
    frontend = sorted(c for core in front for c in core)
    if threads is not None:
        if threads > len(cpus):
            unit = "logical CPUs" if use_smt else "physical cores"
            raise PlanError(f"{label}: threads {threads} > {len(cpus)} {unit} available for inference",
                            path="placement.threads", value=threads, allowed=f"1-{len(cpus)} or auto",
                            hint="lower threads, set placement.use_smt: true, or reduce placement.reserved_cpus")
        cpus = cpus[:threads]
    if quota is not None and frontend and math.floor(quota + 1e-9) < 2:
        notes.append(f"{label}: a CFS quota of {quota:g} CPUs has no room for a front-end core beside inference; "
                     "the front end shares the inference CPUs")
        frontend = []
    if quota is not None:
        budget = max(1, math.floor(quota + 1e-9) - (1 if frontend else 0))
        if budget < len(cpus):
            notes.append(f"{label}: CFS quota of {quota:g} CPUs < {len(cpus) + len(frontend)} CPUs in the cpuset; "
                         f"using {budget} inference thread(s) (more would only be throttled). Prefer exclusive "
                         "CPUs (docker --cpuset-cpus; Kubernetes CPU manager static policy with Guaranteed QoS) "
                         "over a quota")
            cpus = cpus[:budget]
    return CpuChoice(tuple(sorted(cpus)), tuple(frontend), tuple(notes))
