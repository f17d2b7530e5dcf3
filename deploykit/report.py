"""Human-readable text for `deploykit topology show` and `deploykit plan --format table`."""

from __future__ import annotations

from . import cpulist
from .placement import physical_cores
from .plan import Plan
from .topology import L3_MISSING, Topology
from .units import human

ROW = 64  # physical cores per line in core maps


def topology_text(topo: Topology) -> str:
    allowed = set(topo.allowed_cpus)
    online = [c.id for c in topo.cpus]
    out = [f"{topo.cpu_model or 'CPU model unknown'} | ISA tier {topo.isa_tier}"
           f" ({' '.join(topo.isa) or 'no AVX2 or newer flags'})",
           f"{len(topo.sockets)} socket(s), {len(topo.nodes)} NUMA node(s), {len(online)} online CPUs, "
           f"{topo.threads_per_core} thread(s) per core",
           f"this process may use CPUs {cpulist.format(topo.allowed_cpus)} and memory nodes "
           f"{cpulist.format(topo.allowed_mems) or 'none'}; CFS quota "
           + (f"{topo.quota_cpus:g} CPUs" if topo.quota_cpus is not None else "none")
           + "; memory limit " + (human(topo.memory_limit_bytes) if topo.memory_limit_bytes else "none")]
    if topo.offline:
        out.append(f"offline CPUs: {cpulist.format(topo.offline)}")
    if not topo.l3_groups:
        out.append(f"{L3_MISSING}: strategy per-l3 cannot be planned, and replicas_per_node splits without "
                   "L3 alignment")
    for socket in topo.sockets:
        out.append(f"socket {socket}")
        for n in topo.nodes:
            if not n.cpus or topo.cpu(n.cpus[0]).socket != socket:
                continue
            cores = physical_cores(topo, n.cpus)
            out.append(f"  NUMA node {n.id}: {human(n.memory_bytes)}, CPUs {cpulist.format(n.cpus)} "
                       f"({len(cores)} cores" + (f", {_groups(len(_l3_runs(topo, cores)))})" if topo.l3_groups
                                                  else ")")
                       + ("" if n.id in topo.allowed_mems else ", memory not allowed"))
            if not topo.l3_groups:
                out += _wrap("    cores: ", _core_cells(cores, allowed))
                continue
            for gid, group_cores in _l3_runs(topo, cores):
                g = topo.l3_group(gid)
                out += _wrap(f"    L3 {gid} ({human(g.size_bytes)}, {len(group_cores)} cores): ",
                             _core_cells(group_cores, allowed))
    for n in topo.nodes:
        if not n.cpus:
            out.append(f"NUMA node {n.id}: {human(n.memory_bytes)}, memory only (no CPUs)"
                       + ("" if n.id in topo.allowed_mems else ", not allowed"))
    if len(allowed) < len(online):
        out.append("[..] = outside this process's cpuset")
    return "\n".join(out) + "\n"


def _held(m) -> str:
    """The block formats weights stay in, when some do (the rest is in the model's dtype)."""
    if not m.weight_formats:
        return ""
    return f" ({' + '.join(m.weight_formats)} blocks, {m.weight_bytes * 8 / m.num_parameters:.2f} bits/weight)"


def _groups(n: int) -> str:
    return f"{n} L3 group{'' if n == 1 else 's'}"


def _l3_runs(topo: Topology, cores: list[tuple[int, ...]]) -> list[tuple[int, list[tuple[int, ...]]]]:
    """Cores grouped by their L3 group, in core order: [(group id, cores)]."""
    runs: dict[int, list[tuple[int, ...]]] = {}
    for core in cores:
        runs.setdefault(topo.cpu(core[0]).l3 or 0, []).append(core)
    return list(runs.items())


def _core_cells(cores: list[tuple[int, ...]], allowed: set[int]) -> list[str]:
    """One cell per core ("3+195"; [c] = a CPU outside the cpuset); runs of cores wholly outside collapse."""
    cells: list[str] = []
    outside: list[tuple[int, ...]] = []
    for core in cores + [()]:
        if core and not set(core) & allowed:
            outside.append(core)
            continue
        if outside:
            cells.append(f"[{len(outside)} core(s) {cpulist.format(c for k in outside for c in k)}]")
            outside = []
        if core:
            cells.append("+".join(str(c) if c in allowed else f"[{c}]" for c in core))
    return cells


def plan_text(plan: Plan, topo: Topology) -> str:
    m, h = plan.model, plan.hardware
    out = [f"plan {plan.name}: {len(plan.replicas)} replica(s) | {h.sockets} socket(s), {h.numa_nodes} NUMA node(s),"
           f" SMT {h.threads_per_core}, ISA {h.isa_tier}",
           f"model {m.source} ({m.architecture}) {m.dtype}: {_count(m.num_parameters)} params, weights "
           f"{human(m.weight_bytes)}{_held(m)}, KV {human(m.kv_bytes_per_token)}/token, max_model_len "
           f"{m.max_model_len}",
           ""]
    head = ("replica", "nodes", "inference CPUs", "threads", "front end", "mems", "port", "KV cache", "mem limit")
    rows = [head] + [(r.name, cpulist.format(r.numa_nodes), cpulist.format(r.cpus), str(r.omp_threads),
                      cpulist.format(r.frontend_cpus) or "shared", cpulist.format(r.mems), str(r.port),
                      human(r.kv_cache_bytes), human(r.memory_limit_bytes)) for r in plan.replicas]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    out += ["", "core map (one cell per physical core: I inference, S inference on every SMT sibling, F front end,"
                " . not used, x outside the cpuset" + ("; a space between L3 groups" if topo.l3_groups else "") + "):"]
    allowed = set(topo.allowed_cpus)
    for r in plan.replicas:
        cpus, front = set(r.cpus), set(r.frontend_cpus)
        for nid in r.numa_nodes:
            cores = physical_cores(topo, topo.node(nid).cpus)
            cells = []
            for core in cores:
                s = set(core)
                cells.append("x" if not s & allowed else "S" if len(s & cpus) > 1 else "I" if s & cpus
                             else "F" if s & front else ".")
            out.append(f"  {r.name} node {nid}:")
            gaps = [i > 0 and topo.l3_groups and topo.cpu(core[0]).l3 != topo.cpu(cores[i - 1][0]).l3
                    for i, core in enumerate(cores)]
            out += ["    " + "".join((" " if gaps[j] and j > i else "") + cells[j]
                                     for j in range(i, min(i + ROW, len(cells))))
                    for i in range(0, len(cells), ROW)]
        out.append(f"    OpenMP thread i -> CPU i of [{cpulist.format(r.cpus)}]; memory bound to node(s) "
                   f"{cpulist.format(r.mems)}")
    if plan.serving.load_balancer:
        out.append(f"\nclients connect to port {plan.serving.port} (load balancer over the replicas' ports)")
    if plan.warnings:
        out += ["", "warnings:"] + [f"  - {w}" for w in plan.warnings]
    return "\n".join(out) + "\n"


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _wrap(prefix: str, cells: list[str], width: int = 110) -> list[str]:
    lines, cur = [], prefix
    for c in cells:
        if len(cur) + len(c) + 1 > width and cur.strip():
            lines.append(cur.rstrip())
            cur = " " * len(prefix)
        cur += c + " "
    lines.append(cur.rstrip())
    return lines
