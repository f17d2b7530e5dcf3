"""The placements a sweep tries: the planner's own choices on this host (planner.feasible: one replica per NUMA node,
per socket, the whole machine, per L3 group and N per node), with SMT off and on where cores have siblings.

Each candidate is a `placement:` section for the user's spec: the user's own placement keys, with the strategy, its
replica counts and use_smt replaced. Placements the planner refuses here are dropped with its reason, and
placements that plan to the same replicas, CPUs and front ends are one candidate, labelled with all their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import cpulist, memory, planner, specfile
from ..plan import Plan
from ..topology import Topology

# What the sweep varies; every other key of the user's placement (numa_nodes, reserved_cpus, threads, memory_nodes,
# an explicit strategy's cpus) is kept as written.
VARIED = ("strategy", "replicas_per_node", "l3_groups_per_replica", "use_smt")


@dataclass(frozen=True, slots=True)
class Candidate:
    label: str
    placement: dict  # the spec's placement section, as YAML data
    plan: Plan

    @property
    def layout(self) -> tuple:
        return tuple((r.cpus, r.frontend_cpus) for r in self.plan.replicas)

    def shape(self) -> str:
        """"2 replicas x 1 thread" (threads per replica, as planned)."""
        n = len(self.plan.replicas)
        threads = sorted({r.omp_threads for r in self.plan.replicas})
        t = "/".join(map(str, threads))
        return f"{n} replica{'s' if n > 1 else ''} x {t} thread{'s' if threads != [1] else ''}"

    def cpus(self) -> str:
        return " | ".join(cpulist.format(r.cpus) + (f" (+front {cpulist.format(r.frontend_cpus)})"
                                                     if r.frontend_cpus else "") for r in self.plan.replicas)


def section(written: dict, plan: Plan, use_smt: bool | None) -> dict:
    """The placement section that plans to `plan`: the user's keys as written, the planned layout's strategy and
    counts (only where they differ from the defaults, so the written spec reads like one a person wrote)."""
    out = {k: v for k, v in written.items() if k not in VARIED or (k == "use_smt" and use_smt is None)}
    lay = plan.layout
    out["strategy"] = lay.strategy
    if lay.replicas_per_node > 1:
        out["replicas_per_node"] = lay.replicas_per_node
    if lay.l3_groups_per_replica > 1:
        out["l3_groups_per_replica"] = lay.l3_groups_per_replica
    if use_smt is not None:  # None: cores have no siblings here, so the user's value stands
        out["use_smt"] = use_smt
    return out


def candidates(spec_path: str, topo: Topology) -> tuple[list[Candidate], list[str]]:
    """(distinct candidates in the order tried, notes on placements the planner refused here)."""
    spec = specfile.load(spec_path)
    shape = memory.shape(spec.model)
    written = spec_data(spec_path).get("placement") or {}
    smt_options = (False, True) if topo.threads_per_core > 1 else (None,)
    found: dict[tuple, Candidate] = {}
    notes = []
    for use_smt in smt_options:
        suffix = " (SMT)" if use_smt else ""
        pl = spec.placement if use_smt is None else spec.placement.model_copy(update={"use_smt": use_smt})
        refused: list[tuple[str, str]] = []
        for name, plan in planner.feasible(spec.model_copy(update={"placement": pl}), topo, shape, refused):
            c = Candidate(name + suffix, section(written, plan, use_smt), plan)
            if c.layout in found:  # SMT that changes nothing here: the same replicas again
                same = found[c.layout]
                found[c.layout] = Candidate(f"{same.label} = {c.label}", same.placement, same.plan)
            else:
                found[c.layout] = c
        notes += [f"{name}{suffix}: not tried, the planner refuses it here: {why}" for name, why in refused]
    return list(found.values()), notes


def spec_data(spec_path: str) -> dict:
    """The spec file as YAML data with its relative paths (model.source, image.wheelhouse, hardware.sysroot) made
    absolute, so a copy of it works from any directory."""
    p = Path(spec_path)
    data = specfile.parse_yaml(p.read_text(encoding="utf-8"), str(p))
    spec = specfile.load(p)
    data = {**data}
    if isinstance(data.get("model"), dict):
        data["model"] = {**data["model"], "source": spec.model.source}
    if isinstance(data.get("image"), dict) and spec.image.wheelhouse:
        data["image"] = {**data["image"], "wheelhouse": spec.image.wheelhouse}
    if isinstance(data.get("hardware"), dict) and hasattr(spec.hardware, "sysroot"):
        data["hardware"] = {**data["hardware"], "sysroot": spec.hardware.sysroot}
    return data
