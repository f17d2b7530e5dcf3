"""Whether an inference process's OpenMP team stays inside L3 (last-level cache) groups: a team spread over several
groups (AMD CCDs) pays a cross-group barrier at every parallel region and shares no cache, so a replica per L3
group (or several per NUMA node) serves more than one wide team.
"""

from __future__ import annotations

from collections import Counter

from .. import cpulist, layout, placement
from ..process import Proc, Thread
from ..topology import Topology
from ..units import human
from .findings import OK, WARN, Finding


def team_spread(p: Proc, team: list[Thread], topo: Topology) -> Finding | None:
    """`team`: the process's OpenMP threads (known, or its busy threads); None when there is nothing to judge (no
    L3 information, fewer than two threads)."""
    if not topo.l3_groups or len(team) < 2:
        return None
    cpu_of = {t.tid: t.allowed[0] if len(t.allowed) == 1 else t.last_cpu for t in team}
    group_of = {c.id: c.l3 for c in topo.cpus}
    used = Counter(group_of.get(c) for c in cpu_of.values())
    cores = {g.id: len(placement.physical_cores(topo, g.cpus)) for g in topo.l3_groups}
    per_group = max(cores.values())
    needed = -(-len(team) // per_group)
    evidence = tuple(f"L3 group {g}: {n} thread(s) on CPUs "
                     f"{cpulist.format(sorted({c for t, c in cpu_of.items() if group_of.get(c) == g}))}"
                     for g, n in sorted(used.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))[:12]
    size = human(max(g.size_bytes for g in topo.l3_groups))
    evidence += (f"{per_group} physical cores and {size} per L3 group on this machine",)
    if len(used) == 1:
        (g,) = used
        return Finding("threads.l3", OK, f"the OpenMP team of {p.label} ({len(team)} threads) stays in L3 group {g}",
                       evidence=evidence)
    title = (f"the OpenMP team of {p.label} ({len(team)} threads) spans {len(used)} L3 groups"
             + (f" where {needed} would hold it" if len(used) > needed else
                ": every parallel region's barrier crosses L3 groups and no group's cache holds the team's data"))
    node_groups = sorted({g.id for g in topo.l3_groups
                          if topo.cpu(g.cpus[0]).node == topo.cpu(next(iter(cpu_of.values()))).node})
    aligned = [n for n in layout.aligned_counts(len(node_groups), per_group) if 1 < n <= len(node_groups)]
    fix = [f"one replica per L3 group behind a load balancer: deploykit placement.strategy: per-l3 ({per_group} cores "
           f"each), or l3_groups_per_replica: K for larger models"]
    if aligned:
        fix.append(f"or several replicas per NUMA node along L3 groups: placement.replicas_per_node: "
                   f"{' | '.join(map(str, aligned))}")
    if len(used) > needed:
        fullest = [g for g in sorted(used, key=lambda x: (-used[x], x or 0)) if g is not None][:needed]
        firsts = [core[0] for g in fullest for core in placement.physical_cores(topo, topo.l3_group(g).cpus)]
        fix.append(f"or pin the team to {needed} whole L3 group(s): one thread per core of CPUs "
                   f"{cpulist.format(firsts)}")
    return Finding("threads.l3", WARN, title, evidence=evidence,
                   cause="OpenMP threads synchronise at the end of every parallel region (several per layer); "
                         "across L3 groups that costs a trip over the fabric each time, and each group's cache "
                         "holds only its own threads' share", fix=tuple(fix))
