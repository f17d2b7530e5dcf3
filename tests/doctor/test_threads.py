"""The judgement of a sampled process tree, on the machine of the user report (2x EPYC 9655, 384 CPUs): a
vLLM-shaped tree (API server, engine core, worker with 95 OpenMP threads) whose pool collapsed onto CPU 192 must be
described the way the user asked the question, with the cause and the fix. Synthetic samples: this host has
neither 384 CPUs nor two NUMA nodes."""

from __future__ import annotations

import pytest

from deploykit import topology
from deploykit.doctor import report
from deploykit.doctor.findings import Report
from deploykit.doctor.threads import Context, analyse
from deploykit.process import Proc, Sample, Thread
from tests.sysroots import MACHINES, write

GIB = 1024**3
TORCH_GOMP = "/venv/lib/python3.12/site-packages/torch/lib/libgomp.so.1"
IOMP = "/opt/intel/oneapi/lib/libiomp5.so"


@pytest.fixture(scope="module")
def epyc(tmp_path_factory) -> topology.Topology:
    return topology.read(write(MACHINES["epyc-2s-nps1"], tmp_path_factory.mktemp("epyc")))


def proc(pid, ppid, name, threads, *, libs=(TORCH_GOMP,), env=None, pages=None) -> Proc:
    return Proc(pid=pid, ppid=ppid, name=name, cmdline=name, uid=1000, threads=tuple(threads), libraries=tuple(libs),
                env=env or {}, numa_pages=pages, seccomp=0, cap_eff=0, mems_allowed=(0, 1), unreadable=())


def sample(before: list[Proc], busy: dict[int, float], seconds: float = 2.0,
           waits: dict[int, float] | None = None) -> Sample:
    """`after` = `before` with each thread's CPU time advanced by busy[tid] CPUs over the window (and its run-queue
    time by waits[tid])."""
    after, waits = [], waits or {}
    for p in before:
        ts = tuple(Thread(t.tid, t.name, t.allowed, t.last_cpu, t.cpu_ns + int(busy.get(t.tid, 0.0) * seconds * 1e9),
                          t.wait_ns + int(waits.get(t.tid, 0.0) * seconds * 1e9)) for t in p.threads)
        after.append(Proc(**{**{f: getattr(p, f) for f in p.__dataclass_fields__}, "threads": ts}))
    return Sample({p.pid: p for p in before}, {p.pid: p for p in after}, seconds)


def vllm_like(pages) -> list[Proc]:
    api = proc(100, 1, "vllm", [Thread(100, "vllm", tuple(range(384)), 5, 0)], libs=(), env={})
    core = proc(200, 100, "VLLM::EngineCore", [Thread(200, "VLLM::EngineCor", tuple(range(384)), 7, 0)], libs=())
    workers = [Thread(300, "VLLM::Worker", (192,), 192, 0)]
    workers += [Thread(301 + i, "VLLM::Worker", (192,), 192, 0) for i in range(93)]
    workers += [Thread(400, "VLLM::Worker", tuple(range(384)), 288, 0)]  # a helper that escaped the narrowing
    worker = proc(300, 200, "VLLM::Worker", workers, libs=(TORCH_GOMP, IOMP),
                  env={"LD_PRELOAD": IOMP, "OMP_NUM_THREADS": "95"}, pages=pages)
    return [api, core, worker]


@pytest.mark.slow
def test_the_user_report_described_as_asked(epyc):
    pages = {"interleave:0-1": {0: 9 * GIB, 1: 9 * GIB}, "default": {0: 1 * GIB}}
    s = sample(vllm_like(pages), {300: 1.0, 301: 0.02, 400: 1.0})
    rep = Report("vllm", tuple(analyse(s, Context(epyc))))
    busy = rep.find("threads.busy")
    assert busy.level == "fail"
    assert busy.title.startswith("2 of 97 threads busy over 2.0 s, on 2 CPU(s) 192,288")
    stacked = rep.find("threads.stacked")
    assert stacked.level == "fail" and stacked.title.startswith("94 threads allowed only CPU 192")
    assert "pid 300 (VLLM::Worker): 94 threads allowed only CPU 192" in stacked.evidence
    runtimes = rep.find("openmp.runtimes")
    assert runtimes.level == "fail" and runtimes.title == "libgomp and libiomp5 both mapped in pid 300 (VLLM::Worker)"
    assert runtimes.fix == (f"remove {IOMP} from LD_PRELOAD",)
    mem = rep.find("memory.numa")  # the busy pair is 192 (node 0) and 288 (node 1), as in the report
    assert mem.level == "warn" and mem.title.endswith("span NUMA nodes 0-1: half of them read remote memory")
    assert "policies: interleave:0-1 18.0 GiB, default 1.0 GiB" in mem.evidence
    text = report.text(rep)
    for phrase in ("✖ 2 of 97 threads busy", "✖ 94 threads allowed only CPU 192", "✖ libgomp and libiomp5 both mapped",
                   "⚠ the busy threads of pid 300 (VLLM::Worker) span NUMA nodes 0-1"):
        assert phrase in text, text


def test_memory_interleaved_away_from_the_threads(epyc):
    node1 = tuple(c.id for c in epyc.cpus if c.node == 1)[:4]
    threads = [Thread(800 + i, "w", (c,), c, 0) for i, c in enumerate(node1)]
    p = proc(800, 1, "w", threads, pages={"interleave:0-1": {0: 8 * GIB, 1: 8 * GIB}})
    rep = Report("x", tuple(analyse(sample([p], {t.tid: 0.9 for t in threads}), Context(epyc))))
    mem = rep.find("memory.numa")
    assert (mem.level, mem.title) == ("warn", "memory interleaved over nodes 0-1 although the threads sit on node 1")


def test_threads_with_their_memory_on_the_other_node(epyc):
    node1 = tuple(c.id for c in epyc.cpus if c.node == 1)[:4]
    threads = [Thread(500 + i, "llama-server", (c,), c, 0) for i, c in enumerate(node1)]
    p = proc(500, 1, "llama-server", threads, pages={"default": {0: 30 * GIB, 1: 2 * GIB}})
    rep = Report("x", tuple(analyse(sample([p], {t.tid: 0.95 for t in threads}), Context(epyc))))
    mem = rep.find("memory.numa")
    assert mem.level == "warn" and mem.title.startswith("only 6% of the memory of pid 500")
    assert "numactl --cpunodebind=N --membind=N" in mem.fix[0]
    assert rep.find("threads.busy").level == "ok"
    assert rep.find("threads.stacked") is None


def test_pinned_threads_on_both_siblings_of_a_core(epyc):
    pairs = [0, 192, 1, 193]  # offset numbering: CPU i and i+192 share a core
    threads = [Thread(600 + i, "w", (c,), c, 0) for i, c in enumerate(pairs)]
    p = proc(600, 1, "w", threads, pages={"bind:0": {0: GIB}})
    rep = Report("x", tuple(analyse(sample([p], {t.tid: 0.9 for t in threads}), Context(epyc))))
    assert rep.find("threads.smt").level == "warn" and "2 physical core(s)" in rep.find("threads.smt").title
    assert rep.find("memory.numa").level == "ok"


@pytest.mark.parametrize("allowed, busy, level", [
    ((0, 1), (0.83, 0.73), "ok"),  # unpinned, both last seen on CPU 1, 1.56 CPUs used: they did not share it
    ((0, 1), (0.5, 0.5), "fail"),  # one CPU's worth between them: they took turns on CPU 1
    ((1,), (0.5, 0.5), "fail"),  # pinned to one CPU
])
def test_an_engines_openmp_team_on_one_cpu_is_judged_by_the_cpu_time_it_used(epyc, allowed, busy, level):
    """Where a thread was last seen is a snapshot: an unpinned pair of engine threads last seen on one CPU that used
    1.56 CPUs between them ran in parallel (CI, session 24: `--binding none` judged critical one run in four)."""
    ts = [Thread(950 + i, "python", allowed, 1, 0) for i in range(2)]
    p = proc(950, 1, "deploykit engine", ts, pages={"default": {0: GIB}})
    ctx = Context(epyc, omp_tids=frozenset(t.tid for t in ts))
    f = Report("x", tuple(analyse(sample([p], dict(zip((950, 951), busy))), ctx))).find("threads.busy")
    assert f.level == level
    assert f.title.startswith("2 of 2 OpenMP threads busy over 2.0 s, " + (
        "on 1 CPU(s) 1;" if len(allowed) == 1 else "unpinned, last seen on CPU(s) 1;")), f.title


def test_idle_process_is_not_judged(epyc):
    p = proc(700, 1, "idle", [Thread(700, "idle", tuple(range(384)), 3, 0)], pages={"default": {0: GIB}})
    f = Report("x", tuple(analyse(sample([p], {}), Context(epyc)))).find("threads.busy")
    assert f.level == "info" and "idle, nothing to judge" in f.title and "--seconds" in f.fix[0]


@pytest.mark.parametrize("threads, level", [(4, "fail"), (2, "warn")])
def test_waiting_for_a_cpu_is_blamed_on_whoever_asked_for_too_much(epyc, threads, level):
    """Threads that ran half the time and waited the other half on CPUs 0-1: four of them are the process's own
    oversubscription (fail, cut OMP_NUM_THREADS); two of them fit, so neighbours took the CPUs (warn, isolate)."""
    ts = [Thread(900 + i, "w", (0, 1), i % 2, 0) for i in range(threads)]
    p = proc(900, 1, "w", ts)
    half = {t.tid: 0.5 for t in ts}
    rep = Report("x", tuple(analyse(sample([p], half, waits=half), Context(epyc))))
    over = rep.find("threads.oversubscribed")
    assert over.level == level
    assert over.title.startswith(f"{threads} threads on CPU(s) 0-1 spent 50% of the time waiting for a CPU")
    assert f"this process tree wanted {threads:.2f} CPUs (ran + waited) of the 2 its waiting threads may use" \
        in over.evidence
    if level == "fail":
        assert over.fix[0].startswith("OMP_NUM_THREADS = the physical cores")
    else:
        assert over.title.endswith(": other processes ran on them") and "reserved_cpus" in over.fix[0]
        assert rep.find("threads.busy").level == "warn"  # busy threads, but slowed by the neighbours


def test_a_team_spread_over_more_l3_groups_than_it_needs(epyc):
    """8 busy threads, one per CCD of socket 0: one L3 group of 8 cores would hold them all."""
    ccds = [g * 8 for g in range(8)]
    threads = [Thread(1000 + i, "w", (c,), c, 0) for i, c in enumerate(ccds)]
    p = proc(1000, 1, "w", threads, pages={"bind:0": {0: GIB}})
    rep = Report("x", tuple(analyse(sample([p], {t.tid: 0.9 for t in threads}), Context(epyc))))
    l3 = rep.find("threads.l3")
    assert l3.level == "warn" and l3.title.endswith("(8 threads) spans 8 L3 groups where 1 would hold it")
    assert "L3 group 3: 1 thread(s) on CPUs 24" in l3.evidence and "8 physical cores and 32.0 MiB per L3 group" \
        in l3.evidence[-1]
    assert "placement.strategy: per-l3" in l3.fix[0] and "replicas_per_node: 2 | 3 | 4 | 6 | 12" in l3.fix[1]
    assert l3.fix[2] == "or pin the team to 1 whole L3 group(s): one thread per core of CPUs 0-7"
    assert rep.find("threads.busy").level == "warn"


def test_a_node_wide_team_straddles_l3_groups_and_one_inside_a_ccd_does_not(epyc):
    wide = [Thread(1100 + i, "w", (c,), c, 0) for i, c in enumerate(range(95))]
    rep = Report("x", tuple(analyse(sample([proc(1100, 1, "w", wide)], {t.tid: 0.9 for t in wide}), Context(epyc))))
    l3 = rep.find("threads.l3")
    assert l3.level == "warn" and "(95 threads) spans 12 L3 groups: every parallel region's barrier" in l3.title
    ccd = [Thread(1200 + i, "w", (c,), c, 0) for i, c in enumerate(range(8, 15))]
    rep = Report("x", tuple(analyse(sample([proc(1200, 1, "w", ccd)], {t.tid: 0.9 for t in ccd}), Context(epyc))))
    assert rep.find("threads.l3").level == "ok" and rep.find("threads.l3").title.endswith("stays in L3 group 1")


def test_a_small_team_is_a_warning_or_critical_with_the_engines_own_knobs(epyc):
    """vLLM (by its process title) with 8 OpenMP threads on a 96-core cpuset: critical (under half), and the fix is
    vLLM's variables for this cpuset; llama.cpp gets -t, --cpu-range and --numa."""
    from dataclasses import replace
    node0 = replace(epyc, allowed_cpus=tuple(c.id for c in epyc.cpus if c.node == 0),
                    cpuset=tuple(c.id for c in epyc.cpus if c.node == 0))
    api = proc(1299, 1, "vllm", [Thread(1299, "vllm", node0.cpuset, 90, 0)], libs=())  # front end: the whole cpuset
    team = [Thread(1300 + i, "VLLM::Worker", (i,), i, 0) for i in range(8)]
    worker = proc(1300, 1299, "VLLM::Worker", team, env={"OMP_NUM_THREADS": "8", "GOMP_CPU_AFFINITY": "0-7"})
    rep = Report("x", tuple(analyse(sample([api, worker], {t.tid: 0.9 for t in team}), Context(node0))))
    f = rep.find("openmp.threads")
    assert f.level == "fail" and f.title.startswith("an OpenMP team of 8 (OMP_NUM_THREADS=8) for the 95 physical")
    assert any("VLLM_CPU_OMP_THREADS_BIND=0-94 VLLM_CPU_NUM_OF_RESERVED_CPU=1" in x and "CPUs 95,287" in x
               for x in f.fix), f.fix
    warm = proc(1300, 1299, "VLLM::Worker", team, env={"OMP_NUM_THREADS": "60"})
    assert Report("x", tuple(analyse(sample([api, warm], {}), Context(node0)))).find("openmp.threads").level == "warn"
    llama = proc(1400, 1, "llama-server", [Thread(1400 + i, "llama-server", node0.cpuset, i, 0) for i in range(8)],
                 env={"OMP_NUM_THREADS": "8"})
    f = Report("x", tuple(analyse(sample([llama], {}), Context(node0)))).find("openmp.threads")
    # a replica pinned by affinity (deploykit's local runtime): its team is judged against the CPUs it was given
    pinned = proc(1500, 1, "engine", [Thread(1500, "engine", (5,), 5, 0)], env={"OMP_NUM_THREADS": "1"})
    assert Report("x", tuple(analyse(sample([pinned], {}), Context(node0)))).find("openmp.threads").level == "ok"
    assert any("-t 95 --cpu-range 0-94 --cpu-strict 1 --numa isolate" in x for x in f.fix), f.fix


@pytest.mark.parametrize("allowed, busy, waits, level", [
    ((0,), (0.5, 0.5), (0.41, 0.2), "fail"),  # taking turns on one CPU; one sleeps at the barrier, not queued
    ((0, 1), (0.95, 0.95, 0.15), (0.05, 0.05, 0.1), "ok"),  # a full team and a helper thread: nothing went unserved
    ((0, 1), (0.5, 0.5), (0.41, 0.2), "ok"),  # two threads on two CPUs fit (a slow neighbourless host)
])
def test_more_working_threads_than_cpus_is_the_process_s_oversubscription(epyc, allowed, busy, waits, level):
    """torch's pool of two under a one-CPU cpuset: the threads take turns, and the one waiting at the barrier
    sleeps instead of queueing (measured here: 41 % and 20 % queued). More working threads than their CPUs, with
    those CPUs full, is the process's own oversubscription, whatever the run queue showed (CI, session 25)."""
    ts = [Thread(970 + i, "w", allowed, allowed[0], 0) for i in range(len(busy))]
    p = proc(970, 1, "w", ts)
    rep = Report("x", tuple(analyse(sample([p], dict(zip(range(970, 980), busy)),
                                           waits=dict(zip(range(970, 980), waits))), Context(epyc))))
    over = rep.find("threads.oversubscribed")
    assert over.level == level, over
    if level == "fail":
        assert over.title.startswith("2 threads on CPU(s) 0 spent 30% of the time waiting for a CPU: 2 working"), over
        assert over.fix[0].startswith("OMP_NUM_THREADS = the physical cores")
