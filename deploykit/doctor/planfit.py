"""`deploykit doctor SPEC`: does the spec's plan fit the host being examined? Memory per node, replicas against
cores, CPUs and nodes that exist and are allowed here, SMT siblings, dtype against the ISA.

When the spec describes other hardware (a snapshot, an inline description), the plan is made for that hardware,
as `deploykit render` made it, and then laid over this host: the usual mistake is rendering for one machine and
running on another.
"""

from __future__ import annotations

from .. import cpulist
from ..errors import ModelError, PlanError, TopologyError
from ..topology import Topology
from ..units import human
from .findings import FAIL, OK, WARN, Finding, Section


def check(spec_path: str, topo: Topology) -> Section:
    from .. import hardware, memory, planner, specfile
    spec = specfile.load(spec_path)  # an invalid spec is the user's error: exit 2, as for `deploykit plan`
    same = spec.hardware == "auto"
    try:
        plan_topo = topo if same else hardware.resolve(spec, None)
        plan = planner.make_plan(spec, plan_topo, memory.shape(spec.model))
    except (PlanError, ModelError, TopologyError) as e:
        p = e.problems[0]
        return Section(f"Spec {spec_path}", (Finding(
            "plan.place", FAIL, f"the plan cannot be made: {p.message}",
            evidence=tuple(line.strip() for x in e.problems for line in x.render().splitlines()[1:]
                           if not line.strip().startswith("fix:")),
            fix=tuple(x.hint for x in e.problems if x.hint)),))
    out = [Finding("plan.place", OK, f"plan {plan.name}: {len(plan.replicas)} replica(s), "
                   + "; ".join(f"{r.name} {r.omp_threads} threads on CPUs {cpulist.format(r.cpus)}, memory on node(s) "
                               f"{cpulist.format(r.mems)}" for r in plan.replicas),
                   evidence=(f"planned for {'this host' if same else plan_topo.source + ' (the spec’s hardware)'}",))]
    if not same:
        out += _overlay(plan, topo)
    out.append(_cores(plan, topo))
    out.append(_memory(plan, topo))
    out += [Finding("plan.warning", WARN, w) for w in plan.warnings]
    return Section(f"Spec {spec_path}", tuple(out))


def _overlay(plan, topo: Topology) -> list[Finding]:
    """The plan's CPUs and nodes laid over this host."""
    out = []
    allowed, mems = set(topo.allowed_cpus), set(topo.allowed_mems)
    core_of = {c.id: c.core for c in topo.cpus}
    for r in plan.replicas:
        missing = sorted(set(r.cpuset) - allowed)
        if missing:
            out.append(Finding("plan.cpus", FAIL, f"{r.name} wants CPUs {cpulist.format(missing)} that this host does "
                               f"not allow (allowed: {cpulist.format(topo.allowed_cpus)})",
                               cause="the plan was made for other hardware",
                               fix=("plan for this host: hardware: auto, or `deploykit render SPEC --sysroot` with a "
                                    "snapshot of this host",)))
            continue
        cores = [core_of[c] for c in r.cpus]
        shared = len(cores) - len(set(cores))
        if shared:
            out.append(Finding("plan.smt", FAIL, f"{r.name}: {shared} of its {len(r.cpus)} OpenMP threads share a "
                               "physical core with another here", evidence=(
                                   f"plan hardware: {plan.hardware.threads_per_core} threads per core; this host: "
                                   f"{topo.threads_per_core}",),
                               cause="this host numbers SMT siblings differently from the hardware the plan was "
                                     "made for", fix=("plan again with a snapshot of this host (--sysroot)",)))
        bad = sorted(set(r.mems) - mems)
        if bad:
            out.append(Finding("plan.mems", FAIL, f"{r.name} binds memory to node(s) {cpulist.format(bad)}, which this "
                               f"host does not allow (allowed: {cpulist.format(topo.allowed_mems) or 'none'})",
                               fix=("plan for this host's nodes",)))
    if plan.model.dtype == "bfloat16" and not topo.has_bf16:
        out.append(Finding("plan.isa", WARN, f"the plan runs bfloat16 but this CPU (ISA tier {topo.isa_tier}) has no "
                           "bf16 units: widened or emulated, slower", fix=("model.dtype: auto",)))
    if plan.hardware.numa_nodes != len([n for n in topo.nodes if n.cpus]):
        out.append(Finding("plan.nodes", WARN, f"the plan was made for {plan.hardware.numa_nodes} NUMA node(s); this "
                           f"host has {len([n for n in topo.nodes if n.cpus])} with CPUs"))
    if not out:
        out.append(Finding("plan.cpus", OK, "every replica's CPUs and memory nodes exist and are allowed here, one "
                           "OpenMP thread per physical core"))
    return out


def _cores(plan, topo: Topology) -> Finding:
    """Replicas against cores: physical cores the replicas' threads and front ends take, against those allowed."""
    core_of = {c.id: c.core for c in topo.cpus}
    allowed = {core_of[c] for c in topo.allowed_cpus if c in core_of}
    wanted = {c for r in plan.replicas for c in r.cpuset}
    taken = {core_of[c] for c in wanted if c in core_of}
    threads = sum(r.omp_threads for r in plan.replicas)
    title = (f"{len(plan.replicas)} replica(s), {threads} OpenMP threads: {len(taken)} of the {len(allowed)} physical "
             "cores allowed here")
    absent = sorted(c for c in wanted if c not in core_of or core_of[c] not in allowed)
    if absent:
        return Finding("plan.cores", FAIL, title + f"; CPUs {cpulist.format(absent)} do not exist or are not allowed "
                       "here",
                       fix=("plan for this host (hardware: auto or --sysroot with its snapshot)",))
    quota = topo.quota_cpus
    if quota is not None and threads > int(quota + 1e-9):
        return Finding("plan.cores", FAIL, title + f", above this cgroup's CFS quota of {quota:g} CPUs",
                       fix=("plan for this host, where the quota caps the threads", "or give exclusive CPUs instead "
                            "of a quota"))
    return Finding("plan.cores", OK, title)


def _memory(plan, topo: Topology) -> Finding:
    """Each replica's memory limit spread over its mems, summed per node, against the node's memory."""
    need: dict[int, float] = {}
    for r in plan.replicas:
        for m in r.mems:
            need[m] = need.get(m, 0) + r.memory_limit_bytes / len(r.mems)
    over = []
    lines = []
    for nid, want in sorted(need.items()):
        have = next((n.memory_bytes for n in topo.nodes if n.id == nid), 0)
        lines.append(f"node {nid}: replicas need {human(int(want))} of {human(have)}")
        if want > have:
            over.append(nid)
    total = sum(r.memory_limit_bytes for r in plan.replicas)
    if topo.memory_limit_bytes is not None and total > topo.memory_limit_bytes:
        return Finding("plan.memory", FAIL, f"the replicas' memory limits ({human(total)}) exceed this cgroup's limit "
                       f"({human(topo.memory_limit_bytes)})", evidence=tuple(lines),
                       fix=("a smaller serving.kv_cache or model.max_model_len, or a larger memory limit",))
    if over:
        return Finding("plan.memory", FAIL, f"the plan needs more memory than node(s) {cpulist.format(over)} have",
                       evidence=tuple(lines), fix=("a smaller serving.kv_cache or model.max_model_len; plan for this "
                                                   "host (hardware: auto)",))
    return Finding("plan.memory", OK, "every replica's memory fits its NUMA node(s)", evidence=tuple(lines))
