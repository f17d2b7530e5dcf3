"""Judge a sampled process tree the way a person asks: how many threads were busy, where were they allowed to
run, did they pile onto one CPU or one core, did the quota throttle them, which OpenMP runtimes are mapped, and
is the memory on the threads' node. Each answer names the likely cause and the fix.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from .. import cgroups, cpulist, procfs
from ..process import Proc, Sample
from ..topology import Topology
from ..units import human
from . import engines, fixes, l3, openmp
from .findings import FAIL, INFO, OK, WARN, Finding, Section

BUSY = 0.3  # a thread using this much of a CPU over the window is "busy" (two sharing one CPU get 0.5 each at best)
SLACK = 0.1  # sampling error of a CPU-time sum: threads that shared one CPU used at most 1 + SLACK of it
ACTIVE = 0.1  # working at all: threads taking turns on one CPU each get a share of it
LOCAL = 0.8  # below this share of memory on the busy threads' nodes, memory placement is a problem


@dataclass(frozen=True, slots=True)
class Context:
    topo: Topology  # the host, with the target's cpuset and quota (topology.read(pid=...))
    throttling: cgroups.Throttling | None = None  # cpu.stat's counters over the sample (after - before)
    omp_tids: frozenset[int] | None = None  # known OpenMP workers (our engine reports them); None = unknown
    driven: str = ""  # what load ran during the window ("a 64-token generation"), "" = whatever it was doing


def analyse(s: Sample, ctx: Context) -> list[Section]:
    procs = [s.after[p] for p in s.after]
    use = {p.pid: s.use(p.pid) for p in procs}
    wait = {p.pid: s.wait(p.pid) for p in procs}
    infer = _inference_process(procs, use)
    knobs = engines.knobs(engines.recognise(procs), ctx.topo)
    threads = [
        _stacked(procs, use, ctx, infer, knobs),
        _smt(procs, use, ctx.topo),
        _oversubscribed(procs, use, wait),
        _throttled(ctx, sum(sum(u.values()) for u in use.values()), s.seconds),
        l3.team_spread(infer, _team(infer, use.get(infer.pid, {}), ctx), ctx.topo),
    ]
    threads = [f for f in threads if f is not None]
    threads.insert(0, _busy(procs, use, ctx, s.seconds, worst=max(_rank(f.level) for f in threads)))
    runtime = [_runtimes([infer] + [p for p in procs if p is not infer])]
    if infer.env is not None:
        scope = openmp.Scope(f"the environment of {infer.label}",
                             everything=_inherited_from_root(procs, infer))
        mapped = tuple(lib for lib in infer.libraries or () if openmp.runtime_family(lib))
        # A process that reports its OpenMP threads (our engine) sets their count itself, after exec: its exec-time
        # OMP_NUM_THREADS says nothing then.
        runtime += openmp.env_findings(infer.env, ctx.topo, scope, runtimes=mapped or None,
                                       judge_thread_count=bool(mapped) and ctx.omp_tids is None, engine_fix=knobs,
                                       tree_cpus=tuple(sorted({c for p in procs for t in p.threads for c in t.allowed}
                                                              & set(ctx.topo.allowed_cpus))) or None)
        # What the process really maps is judged by _runtimes/_malloc; the environment's guesses about it are not.
        dropped = {"malloc.tcmalloc"} | ({"openmp.preload"} if infer.libraries is not None else set())
        runtime = [f for f in runtime if f.id not in dropped]
    runtime.append(_malloc(infer))
    return [Section("Threads", tuple(threads)),
            Section("OpenMP and allocator", tuple(runtime)),
            Section("Memory", (_memory(infer, use.get(infer.pid, {}), ctx.topo),))]


def _rank(level: str) -> int:
    return {OK: 0, INFO: 1, WARN: 2, FAIL: 3}[level]


def _inference_process(procs: list[Proc], use) -> Proc:
    """The process doing the work: the busiest one that maps an OpenMP runtime (else the busiest one)."""
    def key(p: Proc):
        omp = any(openmp.runtime_family(lib) for lib in p.libraries or ())
        return (omp, sum(use[p.pid].values()), len(p.threads))
    return max(procs, key=key)


def _team(p: Proc, use: dict[int, float], ctx: Context) -> list:
    """The OpenMP team of the inference process: the threads it reports (our engine), else its busy threads."""
    if ctx.omp_tids is not None:
        return [t for t in p.threads if t.tid in ctx.omp_tids]
    return [t for t in p.threads if use.get(t.tid, 0.0) >= BUSY]


def _inherited_from_root(procs: list[Proc], infer: Proc) -> bool:
    """The affinity variables of the inference process were set above it (container- or shell-wide)."""
    root = procs[0]
    if root.pid == infer.pid or root.env is None or infer.env is None:
        return False
    return any(root.env.get(k) == v for k, v in openmp.pinning_vars(infer.env))


def _busy_threads(procs, use, threshold: float = BUSY):
    return [(p, t, use[p.pid].get(t.tid, 0.0)) for p in procs for t in p.threads
            if use[p.pid].get(t.tid, 0.0) >= threshold]


def _busy(procs, use, ctx: Context, seconds: float, worst: int) -> Finding:
    total = sum(len(p.threads) for p in procs)
    busy = _busy_threads(procs, use)
    used = sum(sum(u.values()) for u in use.values())
    may = ctx.topo.cpuset or ctx.topo.allowed_cpus
    limit = f"{len(may)} CPUs" + (f" (quota {ctx.topo.quota_cpus:g})" if ctx.topo.quota_cpus is not None else "")
    evidence = [f"{p.label}: {len(p.threads)} threads, {sum(u >= BUSY for u in use[p.pid].values())} busy, "
                f"{sum(use[p.pid].values()):.2f} CPUs used" for p in procs]
    evidence += [f"busy: tid {t.tid} ({t.name}) {u:.0%} on CPU {t.last_cpu}, allowed {cpulist.format(t.allowed)}"
                 for _, t, u in sorted(busy, key=lambda x: -x[2])[:8]]
    window = f"over {seconds:.1f} s" + (f" of {ctx.driven}" if ctx.driven else "")
    if ctx.omp_tids is not None:
        omp = [(p, t) for p in procs for t in p.threads if t.tid in ctx.omp_tids]
        omp_busy = [(t, use[p.pid].get(t.tid, 0.0)) for p, t in omp if use[p.pid].get(t.tid, 0.0) >= BUSY]
        cpus = sorted({t.last_cpu for t, _ in omp_busy})
        # last_cpu is where a thread ran last. Pinned threads run nowhere else; unpinned ones move, and busy threads
        # last seen on one CPU that used more than one CPU between them took turns on no CPU.
        seen: dict[int, list[float]] = defaultdict(list)
        for t, u in omp_busy:
            seen[t.last_cpu].append(u)
        shared = [c for c, us in seen.items() if len(us) >= 2 and sum(us) <= 1.0 + SLACK]
        pinned = all(len(t.allowed) == 1 for t, _ in omp_busy)
        where = (f"on {len(cpus)} CPU(s) {cpulist.format(cpus)}" if pinned else
                 f"unpinned, last seen on CPU(s) {cpulist.format(cpus)}")
        title = f"{len(omp_busy)} of {len(omp)} OpenMP threads busy {window}, {where}; {used:.2f} CPUs used of {limit}"
        level = OK if len(omp_busy) == len(omp) and not shared else FAIL
        return Finding("threads.busy", max(level, [OK, INFO, WARN, FAIL][worst], key=_rank), title,
                       evidence=tuple(evidence))
    cpus = sorted({t.last_cpu for _, t, _ in busy})
    title = (f"{len(busy)} of {total} threads busy {window}, on {len(cpus)} CPU(s)"
             + (f" {cpulist.format(cpus)}" if cpus else "") + f"; {used:.2f} CPUs used of the {limit} allowed")
    if not busy:
        return Finding("threads.busy", INFO if worst < 3 else FAIL, title + ": idle, nothing to judge",
                       evidence=tuple(evidence),
                       fix=("sample while it generates: send requests and run doctor with --seconds 10 "
                            "(or --url for a deploykit server, which drives a generation itself)",))
    return Finding("threads.busy", [OK, INFO, WARN, FAIL][worst], title, evidence=tuple(evidence))


def _stacked(procs, use, ctx: Context, infer: Proc, knobs: tuple[str, ...] = ()) -> Finding | None:
    """Threads whose affinity is one and the same CPU: a pool that cannot spread."""
    groups: dict[int, list[tuple[Proc, object, float]]] = defaultdict(list)
    for p in procs:
        for t in p.threads:
            if len(t.allowed) == 1 and (ctx.omp_tids is None or t.tid in ctx.omp_tids):
                groups[t.allowed[0]].append((p, t, use[p.pid].get(t.tid, 0.0)))
    crowded = {cpu: g for cpu, g in groups.items() if len(g) >= 2}
    if not crowded:
        return None
    cpu, group = max(crowded.items(), key=lambda kv: (sum(u >= ACTIVE for *_, u in kv[1]), len(kv[1])))
    busy_here = [x for x in group if x[2] >= ACTIVE]
    omp_proc = any(openmp.runtime_family(lib) for p, *_ in group for lib in p.libraries or ())
    title = f"{len(group)} threads allowed only CPU {cpu}" + (
        f", {len(busy_here)} of them working: they take turns on one CPU "
        f"({sum(u for *_, u in busy_here):.2f} CPUs together)" if len(busy_here) >= 2 else "")
    evidence = [f"{p.label}: {sum(1 for q, *_ in group if q is p)} threads allowed only CPU {cpu}"
                for p in procs if any(q is p for q, *_ in group)]
    evidence += ["other CPUs with several threads pinned: "
                 + ", ".join(f"CPU {c} ({len(g)})" for c, g in sorted(crowded.items()) if c != cpu)] \
        if len(crowded) > 1 else []
    if len(busy_here) >= 2:
        level = FAIL
    elif omp_proc and len(group) >= 4 and len(group) * 2 >= sum(len(p.threads) for p in procs if
                                                                 any(q is p for q, *_ in group)):
        level = FAIL  # most of an OpenMP process confined to one CPU: its pool can never spread
    else:
        return Finding("threads.stacked", INFO, title, evidence=tuple(evidence))
    cause, fix = _stack_cause(procs, cpu, infer, knobs)
    return Finding("threads.stacked", level, title, evidence=tuple(evidence), cause=cause, fix=fix)


def _stack_cause(procs, cpu: int, infer: Proc, knobs: tuple[str, ...] = ()) -> tuple[str, tuple[str, ...]]:
    """`knobs`: the recognised engine's own settings for this host (engines.knobs), the fix its user applies."""
    for p in procs:
        for name, value in openmp.pinning_vars(p.env or {}):
            listed = openmp.listed_cpus(name, value)
            if not listed or listed[0] == cpu or len(set(listed)) == 1:
                inherited = p is procs[0] and len(procs) > 1
                where = "the whole process tree (set above the inference process: container- or shell-wide)" \
                    if inherited else p.label
                cause = (f"{name}={value} in the environment of {where}: libgomp narrows the main thread of every "
                         f"process that loads it to CPU {listed[0] if listed else cpu}, and every thread or process "
                         "started afterwards inherits that one CPU")
                remove = (f"remove {name} from the container's environment (docker run -e, compose environment:, the "
                          "pod's env:)",)
                if knobs:  # a server that pins its workers itself: its own settings decide the list
                    return cause, (remove if inherited else ()) + knobs
                return cause, (remove[0] + " and let the inference process pin its own threads: deploykit's engine "
                               "from DEPLOYKIT_CPUS; vLLM with VLLM_CPU_OMP_THREADS_BIND; llama.cpp with --cpu-range",)
    main = procs[0].threads[0] if procs[0].threads else None
    if main is not None and main.allowed == (cpu,):
        return (f"the main thread of {procs[0].label} is pinned to CPU {cpu} (taskset/numactl -C, or a library's "
                "sched_setaffinity), and threads and processes it starts inherit that",
                knobs or ("start the server without a one-CPU affinity (taskset -c/numactl -C with the whole list), "
                          "and pin each OpenMP thread to its own CPU in the inference process",))
    return (f"the threads were created while their parent was confined to CPU {cpu}",
            knobs or ("pin each OpenMP thread to its own CPU in the inference process (GOMP_CPU_AFFINITY set there "
                      "only)",))


def _smt(procs, use, topo: Topology) -> Finding:
    core_of = {c.id: c.core for c in topo.cpus}
    busy = _busy_threads(procs, use)
    by_core = Counter(core_of.get(t.last_cpu, (t.last_cpu,)) for _, t, _ in busy)
    shared = {core: n for core, n in by_core.items() if n > 1 and len(core) > 1}
    pinned_pairs = {core: n for core, n in shared.items()
                    if sum(1 for _, t, _ in busy if len(t.allowed) == 1 and t.allowed[0] in core) > 1}
    if pinned_pairs:
        return Finding("threads.smt", WARN, f"busy threads pinned to both SMT siblings of {len(pinned_pairs)} "
                       "physical core(s): they share one core's FMA units and caches",
                       evidence=tuple(f"core {cpulist.format(core)}: {n} busy threads" for core, n in
                                      sorted(pinned_pairs.items())[:6]),
                       fix=("one OpenMP thread per physical core: pin to the first sibling of each core (`deploykit "
                            "plan` lists them; vLLM's auto binding does the same)",))
    return Finding("threads.smt", OK, "no physical core runs two pinned busy threads")


WAITING = 0.25  # runnable but not running for this share of the window: the thread waits for a CPU
OWN_SLACK = 0.5  # CPUs of demand above the allowed ones before the process itself is the one oversubscribing
OWN_CAUSE = "more compute threads than CPUs: every OpenMP barrier waits for a descheduled thread"
OWN_FIX = ("OMP_NUM_THREADS = the physical cores the process may use, one thread pinned to each",)


def _oversubscribed(procs, use, wait) -> Finding:
    """Threads that wanted a CPU and waited for one (schedstat's run-queue time). Whose fault it is decides the
    verdict: when the process's own demand (each thread's ran + waited share) exceeds the CPUs those threads may use,
    it has more compute threads than CPUs; when it does not, other processes took the CPUs (a shared host or a
    neighbour on the same cpuset). A background thread at a few percent never counts. More working threads in one
    process than its CPUs is its own oversubscription even when the run queue hid it (_crowded_team)."""
    queued = _queued(procs, use, wait)
    return queued if queued.level == FAIL else _crowded_team(procs, use, wait) or queued


def _queued(procs, use, wait) -> Finding:
    waiting = [(p, t, use[p.pid].get(t.tid, 0.0), wait[p.pid].get(t.tid, 0.0)) for p in procs for t in p.threads
               if wait[p.pid].get(t.tid, 0.0) >= WAITING]
    if len(waiting) < 2:
        return Finding("threads.oversubscribed", OK, "no thread kept waiting for a CPU")
    union = sorted({c for _, t, _, _ in waiting for c in t.allowed})
    share = sum(w for *_, w in waiting) / len(waiting)
    demand = sum(min(1.0, use[p.pid].get(t.tid, 0.0) + wait[p.pid].get(t.tid, 0.0))
                 for p in procs for t in p.threads if set(t.allowed) & set(union))
    title = f"{len(waiting)} threads on CPU(s) {cpulist.format(union)} spent {share:.0%} of the time waiting for a CPU"
    evidence = _waited(((t, u, w) for _, t, u, w in waiting[:8]))
    evidence += (f"this process tree wanted {demand:.2f} CPUs (ran + waited) of the {len(union)} its waiting threads "
                 f"may use",)
    if demand > len(union) + OWN_SLACK:
        return Finding("threads.oversubscribed", FAIL, title, evidence=evidence,
                       cause=OWN_CAUSE, fix=OWN_FIX)
    return Finding("threads.oversubscribed", WARN, title + ": other processes ran on them", evidence=evidence,
                   cause=f"the process asked for no more than its {len(union)} CPU(s); the waiting is other work "
                         "sharing them, so speed depends on the neighbours",
                   fix=("give the deployment CPUs of its own: a cpuset nothing else uses (deploykit's placement "
                        "with placement.reserved_cpus for the rest of the host; on Kubernetes, Guaranteed pods "
                        "with integer CPUs under the static CPU manager policy)",))


def _waited(threads) -> tuple[str, ...]:
    """Evidence lines for (thread, share of the window it ran, share it queued) triples."""
    return tuple(f"tid {t.tid} ({t.name}): ran {u:.0%}, waited {w:.0%}, allowed {cpulist.format(t.allowed)}"
                 for t, u, w in threads)


def _crowded_team(procs, use, wait) -> Finding | None:
    """More working threads in one process than the CPUs they may use, and those CPUs full: the process itself
    oversubscribes, whatever the run queue showed. An OpenMP thread that waits at a barrier for a descheduled
    teammate sleeps there instead of queueing, so two threads taking turns on one CPU may each queue well under
    WAITING (measured: 41 % and 20 %, torch's pool under a one-CPU cpuset)."""
    for p in procs:
        team = [(t, use[p.pid].get(t.tid, 0.0), wait[p.pid].get(t.tid, 0.0)) for t in p.threads
                if use[p.pid].get(t.tid, 0.0) >= ACTIVE]
        cpus = sorted({c for t, _, _ in team for c in t.allowed})
        ran, waited = sum(u for _, u, _ in team), sum(w for *_, w in team)
        # A helper thread beside a full OpenMP team also makes more threads than CPUs; only a team that went
        # unserved for a quarter of a CPU or more is judged.
        if len(team) <= len(cpus) or ran < len(cpus) - SLACK or waited < WAITING:
            continue
        title = (f"{len(team)} threads on CPU(s) {cpulist.format(cpus)} spent {waited / len(team):.0%} of the time "
                 f"waiting for a CPU: {len(team)} working threads of {p.label} share {len(cpus)} CPU(s)")
        evidence = _waited(team[:8])
        evidence += (f"they used {ran:.2f} CPUs of the {len(cpus)} they may use",)
        return Finding("threads.oversubscribed", FAIL, title, evidence=evidence,
                       cause=OWN_CAUSE, fix=OWN_FIX)
    return None


def _throttled(ctx: Context, used: float, seconds: float) -> Finding | None:
    q = ctx.topo.quota_cpus
    if q is None:
        return Finding("cpu.throttled", OK, "no CFS quota on the process's cgroup")
    if ctx.throttling is None:
        return Finding("cpu.throttled", INFO, f"CFS quota {q:g} CPUs; throttling not measured")
    periods, throttled, lost = ctx.throttling.periods, ctx.throttling.throttled, ctx.throttling.seconds
    cpus = len(ctx.topo.cpuset or ctx.topo.allowed_cpus)
    evidence = (f"cpu.stat over the sample: {throttled} of {periods} periods throttled, {lost:.2f} s of thread "
                f"time held back", f"quota {q:g} CPUs, cpuset {cpus} CPUs, {used:.2f} CPUs used")
    if throttled and periods and throttled / periods >= 0.2:
        choice = fixes.thread_choice(ctx.topo)
        n = len(choice.cpus) if choice else max(1, int(q))
        return Finding("cpu.throttled", FAIL, f"the CFS quota of {q:g} CPUs throttled the process in {throttled} of "
                       f"{periods} periods" + (f" while the cpuset has {cpus} CPUs" if cpus > q else ""),
                       evidence=evidence,
                       cause="the threads use up each period's CPU time early, then all of them wait for the next "
                             "period (a quota, not a CPU count, limits this container)",
                       fix=("give exclusive CPUs instead of a quota: docker run --cpuset-cpus=<CPUs> without --cpus; "
                            "Kubernetes: Guaranteed QoS with the static CPU manager",
                            f"or size the thread pool to the quota: OMP_NUM_THREADS={n}"))
    return Finding("cpu.throttled", OK, f"CFS quota {q:g} CPUs, not throttled during the sample", evidence=evidence)


def _runtimes(procs: list[Proc]) -> Finding:
    """`procs` starts with the inference process, which the title names when it is one of the culprits."""
    both = [(p, [lib for lib in p.libraries or () if openmp.runtime_family(lib)]) for p in procs]
    both = [(p, libs) for p, libs in both if len(libs) > 1]
    if both:
        p, libs = both[0]
        fams = sorted({openmp.runtime_family(lib) for lib in libs})
        pre = [lib for lib in openmp.preloads(p.env or {}) if openmp.runtime_family(lib)]
        what = " and ".join(fams) if len(fams) > 1 else f"{len(libs)} copies of {fams[0]}"
        others = [f"also in {q.label}" for q, _ in both[1:]]
        return Finding("openmp.runtimes", FAIL, f"{what} both mapped in {p.label}",
                       evidence=tuple(libs) + ((f"LD_PRELOAD={p.env.get('LD_PRELOAD')}",) if pre else ())
                       + tuple(others),
                       cause="each runtime keeps its own thread pool and both spin on the same cores; only one "
                             "of them is used by the model's kernels",
                       fix=(f"remove {', '.join(pre)} from LD_PRELOAD" if pre else
                            "load one OpenMP runtime: the one PyTorch ships (check `ldd` of the extensions)",))
    unreadable = [p for p in procs if p.libraries is None]
    if unreadable:
        return Finding("openmp.runtimes", INFO, f"mapped libraries of {unreadable[0].label} unreadable (not the owner)",
                       fix=("run doctor as the process's owner or as root",))
    mapped = sorted({lib for p in procs for lib in p.libraries or () if openmp.runtime_family(lib)})
    return Finding("openmp.runtimes", OK, f"one OpenMP runtime per process ({', '.join(mapped) or 'none mapped'})")


def _malloc(p: Proc) -> Finding:
    if p.libraries is None:
        return Finding("malloc.tcmalloc", INFO, f"cannot tell whether {p.label} uses tcmalloc (maps unreadable)")
    fast = [lib for lib in p.libraries if procfs.FAST_MALLOC.search(lib)]
    if fast:
        return Finding("malloc.tcmalloc", OK, f"{p.label} uses {', '.join(sorted(set(fast)))}")
    return Finding("malloc.tcmalloc", WARN, f"{p.label} uses glibc malloc (no tcmalloc mapped)",
                   fix=("LD_PRELOAD=libtcmalloc_minimal.so.4 in its environment (Debian/Ubuntu: apt-get install "
                        "libtcmalloc-minimal4)",))


def _memory(p: Proc, use: dict[int, float], topo: Topology) -> Finding:
    mem_nodes = [n for n in topo.nodes if n.memory_bytes]
    if len(mem_nodes) <= 1:
        return Finding("memory.numa", OK, "one memory node: all memory is local")
    if p.numa_pages is None:
        return Finding("memory.numa", INFO, f"pages per node of {p.label} unreadable (numa_maps needs the owner or "
                       "root)")
    node_of = {c.id: c.node for c in topo.cpus}
    busy = [t for t in p.threads if use.get(t.tid, 0.0) >= BUSY] or list(p.threads)
    where = sorted({node_of.get(t.last_cpu, 0) for t in busy})
    per_node: dict[int, int] = defaultdict(int)
    policies: dict[str, int] = {}
    for policy, nodes in p.numa_pages.items():
        policies[policy] = sum(nodes.values())
        for n, b in nodes.items():
            per_node[n] += b
    total = sum(per_node.values()) or 1
    local = sum(b for n, b in per_node.items() if n in where) / total
    evidence = ("pages: " + ", ".join(f"node {n} {human(b)}" for n, b in sorted(per_node.items())),
                "policies: " + ", ".join(f"{k} {human(v)}" for k, v in sorted(policies.items(), key=lambda kv: -kv[1])),
                f"busy threads on node(s) {cpulist.format(where)}")
    interleaved = [k for k in policies if k.startswith("interleave") and policies[k] > total * 0.2]
    fix = ("bind the inference process's memory to its threads' node: deploykit's engine does it from the plan; "
           "numactl --cpunodebind=N --membind=N for others; vLLM binds per rank with its auto binding",
           "inside a container that needs the NUMA calls allowed: --security-opt seccomp=seccomp.json (deploykit "
           "doctor --write-seccomp DIR)")
    if len(where) > 1:
        return Finding("memory.numa", WARN, f"the busy threads of {p.label} span NUMA nodes "
                       f"{cpulist.format(where)}: half of them read remote memory", evidence=evidence,
                       fix=("one process per NUMA node (deploykit's per-numa-node replicas; vLLM: tensor parallel "
                            "= nodes with VLLM_CPU_OMP_THREADS_BIND lists per node)",))
    if interleaved:
        spread = interleaved[0].split(":", 1)[-1]
        return Finding("memory.numa", WARN, f"memory interleaved over nodes {spread} although the threads sit on "
                       f"node {cpulist.format(where)}", evidence=evidence, fix=fix)
    if local < LOCAL:
        return Finding("memory.numa", WARN, f"only {local:.0%} of the memory of {p.label} is on node(s) "
                       f"{cpulist.format(where)}, where its busy threads run", evidence=evidence, fix=fix)
    return Finding("memory.numa", OK, f"{local:.0%} of the memory is on node(s) {cpulist.format(where)}, with the "
                   "busy threads", evidence=evidence)
