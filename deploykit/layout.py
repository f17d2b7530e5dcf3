"""How a machine is cut into replicas: which candidate CPUs each replica gets, per NUMA node, socket, L3 group or N
per node, whether the cut follows L3 (last-level cache) boundaries, and the placements a spec could use on a machine.

Pure functions over the spec's placement section and a Topology; the planner then applies the CPU policy
(deploykit.placement: threads per core, front-end cores, quota) inside each group.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import cpulist
from .errors import PlanError
from .placement import physical_cores
from .spec import PlacementSpec
from .topology import L3_MISSING, Node, Topology

Core = tuple[int, ...]  # one physical core: its allowed SMT siblings


@dataclass(frozen=True, slots=True)
class Group:
    """The CPUs one replica may be placed on."""

    nodes: tuple[int, ...]  # NUMA nodes the CPUs belong to
    cpus: tuple[int, ...]  # allowed CPUs, all SMT siblings included (the CPU policy picks threads among them)


@dataclass(frozen=True, slots=True)
class Cut:
    groups: tuple[Group, ...]
    notes: tuple[str, ...]  # what was adjusted and why, for the plan's warnings
    l3_aligned: bool  # replicas smaller than their node, each inside one L3 group or made of whole ones


def cut(pl: PlacementSpec, topo: Topology) -> Cut:
    notes: list[str] = []
    if pl.strategy == "explicit":
        groups = _explicit(pl, topo)
    else:
        nodes = _cpu_nodes(pl, topo, notes)
        allowed = set(topo.allowed_cpus)

        def cands(ns) -> tuple[int, ...]:
            return tuple(sorted(c for n in ns for c in n.cpus if c in allowed))

        if pl.strategy == "single":
            groups = [Group(tuple(n.id for n in nodes), cands(nodes))]
        elif pl.strategy == "per-socket":
            by_socket: dict[int, list[Node]] = {}
            for n in nodes:
                by_socket.setdefault(topo.cpu(n.cpus[0]).socket, []).append(n)
            groups = [Group(tuple(n.id for n in ns), cands(ns)) for _, ns in sorted(by_socket.items())]
        elif pl.strategy == "per-l3":
            groups = _per_l3(pl, topo, nodes, notes)
        elif pl.replicas_per_node > 1:
            groups = [g for n in nodes for g in _split_node(pl.replicas_per_node, topo, n, notes)]
        else:
            groups = [Group((n.id,), cands([n])) for n in nodes]
    return Cut(tuple(groups), tuple(dict.fromkeys(notes)), l3_aligned(topo, groups))


def l3_runs(topo: Topology, cores: list[Core]) -> list[tuple[int, list[Core]]]:
    """Cores grouped by L3 group, in core order: [(group id, cores)]; [] when the L3 groups are unknown."""
    if not topo.l3_groups:
        return []
    runs: dict[int, list[Core]] = {}
    for core in cores:
        runs.setdefault(topo.cpu(core[0]).l3, []).append(core)  # type: ignore[arg-type]
    return list(runs.items())


def l3_aligned(topo: Topology, groups: list[Group] | tuple[Group, ...]) -> bool:
    """The replicas are cut along L3 boundaries: each is smaller than its NUMA node's allowed CPUs, and lies inside
    one L3 group or takes every allowed CPU of the groups it touches (what the kubelet's
    prefer-align-cpus-by-uncorecache also aims for)."""
    if not topo.l3_groups or not groups:
        return False
    allowed = set(topo.allowed_cpus)
    in_group = {g.id: set(g.cpus) & allowed for g in topo.l3_groups}
    smaller = False
    for g in groups:
        mine = set(g.cpus)
        node_cpus = {c for n in g.nodes for c in topo.node(n).cpus} & allowed
        smaller |= len(mine) < len(node_cpus)
        touched = {topo.cpu(c).l3 for c in mine}
        if len(touched) > 1 and any(not in_group[t] <= mine for t in touched):  # type: ignore[index]
            return False
    return smaller


def _explicit(pl: PlacementSpec, topo: Topology) -> list[Group]:
    online = {c.id for c in topo.cpus}
    allowed = set(topo.allowed_cpus)
    groups = []
    for i, cpus in enumerate(pl.cpus or ()):
        bad_online = sorted(set(cpus) - online)
        if bad_online:
            raise PlanError(f"CPUs {cpulist.format(bad_online)} do not exist or are offline",
                            path=f"placement.cpus[{i}]", value=cpulist.format(cpus),
                            allowed=f"online CPUs {cpulist.format(online)}")
        bad = sorted(set(cpus) - allowed)
        if bad:
            raise PlanError(f"CPUs {cpulist.format(bad)} are outside this process's cpuset",
                            path=f"placement.cpus[{i}]", value=cpulist.format(cpus),
                            allowed=cpulist.format(allowed), hint="pick CPUs from the allowed list")
        groups.append(Group(tuple(sorted({topo.cpu(c).node for c in cpus})), tuple(cpus)))
    return groups


def _cpu_nodes(pl: PlacementSpec, topo: Topology, notes: list[str]) -> list[Node]:
    """The NUMA nodes replicas may use: placement.numa_nodes, else every node with allowed CPUs."""
    allowed = set(topo.allowed_cpus)
    cpu_nodes = [n for n in topo.nodes if n.cpus]
    if pl.numa_nodes is not None:
        known = {n.id: n for n in topo.nodes}
        chosen = []
        for nid in pl.numa_nodes:
            n = known.get(nid)
            if n is None:
                raise PlanError(f"NUMA node {nid} does not exist", path="placement.numa_nodes",
                                value=list(pl.numa_nodes),
                                allowed=f"nodes with CPUs: {cpulist.format(x.id for x in cpu_nodes)}")
            if not n.cpus:
                raise PlanError(f"NUMA node {nid} has no CPUs (memory-only)", path="placement.numa_nodes",
                                value=list(pl.numa_nodes), hint="list it in placement.memory_nodes to use its memory")
            if not set(n.cpus) & allowed:
                raise PlanError(f"none of NUMA node {nid}'s CPUs ({cpulist.format(n.cpus)}) are in this process's "
                                f"cpuset ({cpulist.format(allowed)})", path="placement.numa_nodes", value=nid)
            chosen.append(n)
        cpu_nodes = sorted(set(chosen), key=lambda n: n.id)
    else:
        for n in cpu_nodes:
            if not set(n.cpus) & allowed:
                notes.append(f"NUMA node {n.id} skipped: none of its CPUs are in this process's cpuset "
                             f"({cpulist.format(allowed)})")
        cpu_nodes = [n for n in cpu_nodes if set(n.cpus) & allowed]
    if not cpu_nodes:
        raise PlanError("no NUMA node with usable CPUs", hint="check the cpuset and placement.numa_nodes")
    return cpu_nodes


def _node_cores(topo: Topology, n: Node) -> list[Core]:
    allowed = set(topo.allowed_cpus)
    return physical_cores(topo, [c for c in n.cpus if c in allowed])


def _group(n: Node, cores: list[Core]) -> Group:
    return Group((n.id,), tuple(sorted(c for core in cores for c in core)))


def _cut_notes(topo: Topology, n: Node, runs: list[tuple[int, list[Core]]], notes: list[str]) -> None:
    """Say where the cpuset leaves only part of an L3 group, and where an L3 group reaches past this node."""
    for gid, cores in runs:
        group = topo.l3_group(gid)
        whole = physical_cores(topo, [c for c in group.cpus if topo.cpu(c).node == n.id])
        if len(cores) < len(whole):
            notes.append(f"L3 group {gid} is cut by the cpuset: {len(cores)} of its {len(whole)} cores on NUMA node "
                         f"{n.id} are allowed (CPUs {cpulist.format(c for k in cores for c in k)})")
        spans = sorted({topo.cpu(c).node for c in group.cpus})
        if len(spans) > 1:
            notes.append(f"L3 group {gid} spans NUMA nodes {cpulist.format(spans)}: its part on each node is placed "
                         "on its own, so memory stays local")


def _per_l3(pl: PlacementSpec, topo: Topology, nodes: list[Node], notes: list[str]) -> list[Group]:
    if not topo.l3_groups:
        hint = ("inline hardware cannot describe L3 groups: plan against a snapshot of the machine "
                "(`deploykit topology snapshot DIR` copies cpuN/cache/index*)" if topo.source == "inline" else
                "take the snapshot again with this deploykit (`deploykit topology snapshot` copies cpuN/cache/index*), "
                "or use strategy: per-numa-node with replicas_per_node")
        raise PlanError(f"strategy per-l3 needs the L3 groups, but the topology has {L3_MISSING[3:]}",
                        path="placement.strategy", value="per-l3", hint=hint)
    k = pl.l3_groups_per_replica
    groups: list[Group] = []
    for n in nodes:
        runs = l3_runs(topo, _node_cores(topo, n))
        _cut_notes(topo, n, runs, notes)
        if k > len(runs):
            notes.append(f"NUMA node {n.id} has {len(runs)} L3 group(s), fewer than l3_groups_per_replica {k}: one "
                         f"replica of {len(runs)}")
        elif len(runs) % k:
            notes.append(f"NUMA node {n.id}: {len(runs)} L3 groups do not divide by l3_groups_per_replica {k}; its "
                         f"last replica has {len(runs) % k}")
        for i in range(0, len(runs), k):
            groups.append(_group(n, [core for _, cores in runs[i:i + k] for core in cores]))
    sockets = {s: tuple(sorted(c for c in topo.allowed_cpus if topo.cpu(c).socket == s)) for s in topo.sockets}
    if all(g.cpus == sockets[topo.cpu(g.cpus[0]).socket] for g in groups):
        notes.append("each L3 group spans a whole socket on this machine (one L3 per socket, as on Intel Xeon), so "
                     "per-l3 places exactly as per-socket")
    elif all(len(g.cpus) == len([c for c in topo.node(g.nodes[0]).cpus if c in set(topo.allowed_cpus)])
             for g in groups):
        notes.append("no NUMA node holds more than one L3 group here, so per-l3 places exactly as per-numa-node")
    return groups


def _split_node(count: int, topo: Topology, n: Node, notes: list[str]) -> list[Group]:
    """`count` replicas on node `n`: whole L3 groups each when `count` divides the group count (or each group split
    in equal parts when the group count divides `count`), else equal runs of cores, saying why it cannot align."""
    cores = _node_cores(topo, n)
    if count > len(cores):
        raise PlanError(f"NUMA node {n.id} has {len(cores)} physical core(s) this process may use, fewer than "
                        f"{count} replicas", path="placement.replicas_per_node", value=count,
                        allowed=f"1-{len(cores)}", hint="lower replicas_per_node (each replica needs a core)")
    runs = l3_runs(topo, cores)
    _cut_notes(topo, n, runs, notes)
    sizes = {len(c) for _, c in runs}
    if runs and len(sizes) == 1:
        g, per = len(runs), sizes.pop()
        if g % count == 0:
            k = g // count
            return [_group(n, [core for _, cs in runs[i:i + k] for core in cs]) for i in range(0, g, k)]
        if count % g == 0 and per % (count // g) == 0:
            part = per // (count // g)
            return [_group(n, cs[i:i + part]) for _, cs in runs for i in range(0, per, part)]
    q, extra = divmod(len(cores), count)
    bounds = [i * q + min(i, extra) for i in range(count + 1)]
    parts = [cores[bounds[i]:bounds[i + 1]] for i in range(count)]
    if extra:
        notes.append(f"NUMA node {n.id}: {len(cores)} cores do not split into {count} equal replicas; "
                     f"{extra} of them get {q + 1} cores, the others {q}")
    if not runs:
        notes.append(f"NUMA node {n.id}: {L3_MISSING}, so its {count} replicas are not aligned to L3 groups")
    elif any(len({topo.cpu(core[0]).l3 for core in p}) > 1 for p in parts):
        if len({len(c) for _, c in runs}) > 1:
            why, fix = "the cpuset leaves them unequal", "strategy per-l3 keeps each replica in whole L3 groups"
        else:
            good = aligned_counts(len(runs), len(runs[0][1]))
            why = f"{count} neither divides {len(runs)} nor is a multiple of it that splits each group evenly"
            fix = f"values that align here: {', '.join(str(x) for x in good if x <= len(cores))}"
        notes.append(f"replicas_per_node {count} cannot align to the {len(runs)} L3 groups of NUMA node {n.id} "
                     f"({why}): its replicas straddle L3 groups; {fix}")
    return [_group(n, p) for p in parts]


def aligned_counts(groups: int, cores_per_group: int) -> list[int]:
    """replicas_per_node values that follow L3 boundaries on a node of `groups` equal groups: divisors of the group
    count, and multiples of it that split each group into equal parts."""
    return sorted({d for d in range(1, groups + 1) if groups % d == 0}
                  | {groups * m for m in range(2, cores_per_group + 1) if cores_per_group % m == 0})


def choices(pl: PlacementSpec, topo: Topology) -> tuple[PlacementSpec, ...]:
    """The placements worth trying for this spec on this machine (for `deploykit bench --sweep`): one replica per
    NUMA node, per socket, the whole machine, and, where L3 groups are known, per L3 group (1, 2, ... adjacent groups
    per replica) and N per node for every N that keeps L3 alignment. The spec's other placement knobs (numa_nodes,
    reserved_cpus, use_smt, threads, memory_nodes) are kept; layouts giving the same replicas appear once, first
    kept. Memory is not checked here: planner.feasible() plans each and keeps those that fit."""
    if pl.strategy == "explicit":
        return (pl,)
    keep = pl.model_dump(exclude={"strategy", "replicas_per_node", "l3_groups_per_replica"}, exclude_unset=True)
    options: list[dict] = [{"strategy": "per-numa-node"}, {"strategy": "per-socket"}, {"strategy": "single"}]
    nodes = [n for n in topo.nodes if n.cpus and set(n.cpus) & set(topo.allowed_cpus)]
    if pl.numa_nodes is not None:
        nodes = [n for n in nodes if n.id in pl.numa_nodes]
    fewest = min((len(_node_cores(topo, n)) for n in nodes), default=1)
    if topo.l3_groups and nodes:
        runs = min((l3_runs(topo, _node_cores(topo, n)) for n in nodes), key=len)
        g = len(runs)
        options += [{"strategy": "per-l3", "l3_groups_per_replica": k} for k in range(1, g + 1) if g % k == 0]
        counts = aligned_counts(g, min(len(c) for _, c in runs))
    else:
        counts = [n for n in (2, 4, 8) if n <= fewest]
    options += [{"strategy": "per-numa-node", "replicas_per_node": n} for n in counts if 1 < n <= fewest]
    out: list[PlacementSpec] = []
    seen: set[tuple] = set()
    for opt in options:
        candidate = PlacementSpec(**{**keep, **opt})
        try:
            layout = tuple((g.nodes, g.cpus) for g in cut(candidate, topo).groups)
        except PlanError:
            continue
        if layout not in seen:
            seen.add(layout)
            out.append(candidate)
    return tuple(out)


def describe(pl: PlacementSpec) -> str:
    """A short name for a placement: per-numa-node, per-numa-node x4, per-l3, per-l3 x2 (groups per replica)."""
    if pl.strategy == "per-numa-node" and pl.replicas_per_node > 1:
        return f"per-numa-node x{pl.replicas_per_node}"
    if pl.strategy == "per-l3" and pl.l3_groups_per_replica > 1:
        return f"per-l3 x{pl.l3_groups_per_replica}"
    return pl.strategy
