"""The placements a sweep tries: data produced from the planner's own choices on this host, never a hand list.

Each candidate is a `placement:` section for the user's spec: every strategy the spec schema offers (except
explicit), SMT on and off where cores have siblings, and every split of each NUMA node's physical cores into 2, 4,
8 ... equal replicas (as explicit CPU lists). Each is planned with the real planner; placements that cannot be
planned here are dropped with the planner's reason, and placements that plan to the same replicas, CPUs and front
ends are one candidate, labelled with all their names.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

from .. import cpulist, memory, placement, planner, specfile
from ..errors import DeploykitError
from ..plan import Plan
from ..spec import PlacementSpec, Spec
from ..topology import Topology

# Kept from the user's placement in every candidate; the others (strategy, cpus, numa_nodes, threads) are what the
# sweep varies, or would contradict a candidate (threads: 8 on a 4-core split).
KEPT = ("reserved_cpus", "memory_nodes", "use_smt")


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


def strategies() -> tuple[str, ...]:
    """Every strategy the spec schema knows, except explicit (the splits below are the explicit ones)."""
    return tuple(s for s in typing.get_args(PlacementSpec.model_fields["strategy"].annotation) if s != "explicit")


def _splits(topo: Topology, use_smt: bool) -> list[tuple[str, list[str]]]:
    """Each CPU-bearing NUMA node's allowed physical cores cut into k equal consecutive groups, k = 2, 4, 8...:
    (label, one CPU list per replica). A core's SMT siblings stay together (use_smt decides whether they compute)."""
    allowed = set(topo.allowed_cpus)
    per_node = [placement.physical_cores(topo, [c for c in n.cpus if c in allowed]) for n in topo.nodes if n.cpus]
    per_node = [cores for cores in per_node if cores]
    out = []
    k = 2
    while per_node and k <= min(len(cores) for cores in per_node):
        lists = []
        for cores in per_node:
            if len(cores) % k:
                break
            size = len(cores) // k
            lists += [cpulist.format(c for core in cores[i * size:(i + 1) * size] for c in core) for i in range(k)]
        else:
            out.append((f"{k} per NUMA node{' (SMT)' if use_smt else ''}", lists))
        k *= 2
    return out


def placements(spec: Spec, topo: Topology) -> list[tuple[str, dict]]:
    pl = spec.placement
    base = {k: getattr(pl, k) for k in KEPT if k in pl.model_fields_set}
    base = {k: list(v) if isinstance(v, tuple) else v for k, v in base.items()}
    smt_options = (False, True) if topo.threads_per_core > 1 else (pl.use_smt,)
    out = []
    for use_smt in smt_options:
        smt = {"use_smt": use_smt} if topo.threads_per_core > 1 else {}
        suffix = " (SMT)" if use_smt and topo.threads_per_core > 1 else ""
        for s in strategies():
            nodes = {"numa_nodes": list(pl.numa_nodes)} if pl.numa_nodes is not None else {}
            out.append((s + suffix, {**base, **smt, "strategy": s, **nodes}))
        for label, lists in _splits(topo, use_smt):
            out.append((label, {**base, **smt, "strategy": "explicit", "cpus": lists}))
    return out


def candidates(spec_path: str, topo: Topology) -> tuple[list[Candidate], list[str]]:
    """(distinct candidates in the order tried, notes on placements dropped or merged)."""
    spec = specfile.load(spec_path)
    shape = memory.shape(spec.model)
    data = spec_data(spec_path)
    found: dict[tuple, Candidate] = {}
    notes = []
    for label, section in placements(spec, topo):
        try:
            variant = specfile.from_data({**data, "placement": section})
            plan = planner.make_plan(variant, topo, shape)
        except DeploykitError as e:
            notes.append(f"{label}: not tried, the planner refuses it here: {str(e).splitlines()[0]}")
            continue
        c = Candidate(label, section, plan)
        if c.layout in found:
            same = found[c.layout]
            found[c.layout] = Candidate(f"{same.label} = {label}", same.placement, same.plan)
            continue
        found[c.layout] = c
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
