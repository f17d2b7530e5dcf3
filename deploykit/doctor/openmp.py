"""OpenMP and allocator environment rules, shared by the host check (doctor's own environment, i.e. the shell's or
the container's) and the process check (/proc/PID/environ and the libraries it really mapped).

The rules, each from an observed failure: OMP_NUM_THREADS above the CPUs (or the quota) the process may use;
GOMP_CPU_AFFINITY / OMP_PLACES / OMP_PROC_BIND / KMP_AFFINITY set for everything (libgomp narrows the main thread
of every process that loads it to the first listed CPU, and everything started later inherits that CPU);
KMP_* next to libgomp (ignored); a second OpenMP runtime preloaded; no tcmalloc.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .. import cpulist, placement
from ..procfs import FAST_MALLOC, OMP_RUNTIME
from ..topology import Topology
from . import fixes
from .findings import FAIL, INFO, OK, WARN, Finding

AFFINITY_VARS = ("GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY")
LIB_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib", "/lib/x86_64-linux-gnu",
            "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu")


def runtime_family(path: str) -> str | None:
    """'libgomp' | 'libiomp5' | 'libomp' for an OpenMP runtime's path, else None."""
    m = OMP_RUNTIME.search(path)
    if not m:
        return None
    name = m.group(1)
    return "libgomp" if name.startswith("libgomp") else "libiomp5" if name.startswith("libiomp5") else "libomp"


def preloads(env: dict[str, str], ld_so_preload: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Libraries preloaded into every process: LD_PRELOAD (space or colon separated) and /etc/ld.so.preload."""
    return tuple(p for p in re.split(r"[\s:]+", env.get("LD_PRELOAD", "")) if p) + tuple(ld_so_preload)


def installed(lib: str) -> bool:
    """Whether the dynamic loader can find a preloaded library (a missing one is skipped with a warning)."""
    if "/" in lib:
        return Path(lib).is_file()
    return any((Path(d) / lib).exists() for d in LIB_DIRS)


def threads_requested(env: dict[str, str]) -> int | None:
    """OMP_NUM_THREADS's outer level ("8,4" means 8), None when unset or not a number."""
    m = re.match(r"\s*(\d+)", env.get("OMP_NUM_THREADS", ""))
    return int(m.group(1)) if m else None


def pinning_vars(env: dict[str, str]) -> list[tuple[str, str]]:
    """The affinity variables that pin threads (OMP_PROC_BIND=false and KMP_AFFINITY=disabled/none do not)."""
    out = []
    for name in AFFINITY_VARS:
        value = env.get(name)
        if value is None or not value.strip():
            continue
        low = value.strip().lower()
        if (name == "OMP_PROC_BIND" and low == "false") or (name == "KMP_AFFINITY" and low in ("disabled", "none")):
            continue
        out.append((name, value))
    return out


def listed_cpus(name: str, value: str) -> tuple[int, ...]:
    """CPUs named by GOMP_CPU_AFFINITY ("0 2 4-7", "0-15:2"), OMP_PLACES ("{0},{2:4}") or KMP_AFFINITY's
    proclist; () when the value names no CPU (e.g. OMP_PLACES=cores)."""
    if name == "KMP_AFFINITY":
        m = re.search(r"proclist=\[([^\]]*)\]", value)
        value = m.group(1) if m else ""
    out: list[int] = []
    for m in re.finditer(r"(\d+)(?:-(\d+))?(?::(\d+))?", value):
        a, b, step = int(m.group(1)), m.group(2), m.group(3)
        if name == "OMP_PLACES" and b is None and step is not None:  # {start:len} in OMP_PLACES
            out.extend(range(a, a + int(step)))
        else:
            out.extend(range(a, int(b) + 1 if b else a + 1, int(step or 1)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose environment the rules look at, for the wording: 'this container's environment' or 'pid 42'."""

    where: str
    everything: bool  # True: every process started here inherits it (a shell's, a container's environment)


def env_findings(env: dict[str, str], topo: Topology, scope: Scope, *, runtimes: tuple[str, ...] | None,
                 ld_so_preload: tuple[str, ...] = (), check_installed: bool = False,
                 judge_thread_count: bool = True, engine_fix: tuple[str, ...] = (),
                 tree_cpus: tuple[int, ...] | None = None) -> list[Finding]:
    """`runtimes`: OpenMP runtimes the process maps (or, for the host, the one PyTorch bundles); None = unknown.
    `engine_fix`: a recognised server's own settings (engines.knobs), given as the fix instead of OpenMP's.
    `tree_cpus`: the CPUs any thread of the process tree may run on, when narrower than the cpuset (a replica pinned
    by affinity): the yardstick for a team that is too small."""
    out = []
    allowed = topo.allowed_cpus
    cores = _physical(topo, allowed)
    choice = fixes.thread_choice(topo)
    right = fixes.thread_env(choice) if choice else "OMP_NUM_THREADS=<physical cores in the cpuset>"
    n = threads_requested(env)
    if judge_thread_count:
        team_choice = fixes.thread_choice(topo, tree_cpus) if tree_cpus else choice
        out.append(_thread_count(n, env, topo, allowed, cores, scope, right, team_choice, engine_fix))
    families = {runtime_family(r) for r in (runtimes or ())} - {None}
    pins = pinning_vars(env)
    if not families & {"libiomp5", "libomp"}:  # KMP_AFFINITY pins only under Intel/LLVM OpenMP (rule below)
        pins = [(k, v) for k, v in pins if k != "KMP_AFFINITY"]
    if pins:
        out.append(_affinity(pins, allowed, scope, n, engine_fix))
    else:
        out.append(Finding("openmp.affinity_env", OK, f"no OpenMP affinity variable in {scope.where}"))
    kmp = sorted(k for k in env if k.startswith("KMP_"))
    if kmp and families == {"libgomp"}:
        out.append(Finding("openmp.kmp", WARN, f"{', '.join(kmp)} set but the OpenMP runtime is libgomp, which "
                           "ignores KMP_* variables", evidence=tuple(f"{k}={env[k]}" for k in kmp) +
                           (f"OpenMP runtime: {', '.join(runtimes or ())}",),
                           cause="KMP_AFFINITY/KMP_BLOCKTIME are Intel (libiomp5) and LLVM (libomp) settings; the "
                                 "pinning they describe is not applied",
                           fix=("remove the KMP_* variables; pin in the inference process with GOMP_CPU_AFFINITY or "
                                "OMP_PLACES + OMP_PROC_BIND (deploykit's engine does it from DEPLOYKIT_CPUS)",)))
    elif kmp and not families:
        out.append(Finding("openmp.kmp", WARN, f"{', '.join(kmp)} set: only Intel or LLVM OpenMP reads them; PyTorch "
                           "wheels from PyPI use libgomp, which ignores them",
                           evidence=tuple(f"{k}={env[k]}" for k in kmp),
                           fix=("check which runtime the inference process maps: deploykit doctor --pid PID",)))
    out.append(_preloaded_runtime(env, ld_so_preload, runtimes, scope, check_installed))
    out.append(_malloc(env, ld_so_preload, scope, check_installed))
    vllm = env.get("VLLM_CPU_OMP_THREADS_BIND")
    if vllm:
        out.append(_vllm_bind(vllm, topo))
    return out


def _physical(topo: Topology, cpus) -> int:
    cand = set(cpus)
    return len({c.core for c in topo.cpus if c.id in cand})


def _thread_count(n, env, topo, allowed, cores, scope, right, choice, engine_fix=()) -> Finding:
    quota = topo.quota_cpus
    fix = engine_fix or (f"set {right} in the inference process's environment",)
    if n is None:
        narrower = len(allowed) < len(topo.cpus) or quota is not None
        if narrower:
            host_cores = _physical(topo, [c.id for c in topo.cpus])
            limit = f"a {quota:g}-CPU quota" if quota is not None and quota < len(allowed) else \
                f"a {len(allowed)}-CPU cpuset"
            return Finding("openmp.threads", WARN, f"OMP_NUM_THREADS is unset in {scope.where}: PyTorch would start "
                           f"{host_cores} threads (the host's physical cores) inside {limit}",
                           evidence=(f"allowed CPUs {cpulist.format(allowed)} ({cores} physical cores)",),
                           cause="PyTorch sizes its pool from the host's cores; neither the cpuset nor the quota "
                                 "is read", fix=fix)
        return Finding("openmp.threads", OK, f"OMP_NUM_THREADS unset; this process may use every CPU "
                       f"({len(allowed)} CPUs, {cores} physical cores)")
    evidence = (f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}", f"allowed CPUs {cpulist.format(allowed)} "
                f"({len(allowed)} CPUs, {cores} physical cores)") + \
        ((f"CFS quota {quota:g} CPUs",) if quota is not None else ())
    if n > len(allowed):
        return Finding("openmp.threads", FAIL, f"OMP_NUM_THREADS={n} but only {len(allowed)} CPUs are allowed: "
                       f"{n} threads time-slice on {len(allowed)} CPUs", evidence=evidence,
                       cause="every parallel region waits for its slowest thread, and a thread waiting for a CPU "
                             "stalls the whole team", fix=fix)
    if quota is not None and n > int(quota + 1e-9):
        return Finding("openmp.threads", FAIL, f"OMP_NUM_THREADS={n} is above the CFS quota of {quota:g} CPUs: the "
                       "threads use up each period's CPU time early, then all of them wait", evidence=evidence,
                       fix=fix + ("or give exclusive CPUs instead of a quota: docker run --cpuset-cpus without "
                                  "--cpus; Kubernetes Guaranteed QoS with the static CPU manager",))
    if n > cores:
        return Finding("openmp.threads", WARN, f"OMP_NUM_THREADS={n} is above the {cores} physical cores allowed: "
                       "SMT siblings share a core's FMA units and caches", evidence=evidence,
                       cause="decode is bound by memory bandwidth; a second thread per core adds contention, not "
                             "bandwidth", fix=fix)
    want = len(choice.cpus) if choice else cores
    if n < want:
        kept = len(placement.physical_cores(topo, choice.frontend_cpus)) if choice else 0
        return Finding("openmp.threads", FAIL if 2 * n < want else WARN,
                       f"an OpenMP team of {n} (OMP_NUM_THREADS={n}) for the {want} physical core(s) this process "
                       f"may use for inference: {want - n} of them stay idle while it generates",
                       evidence=evidence + ((f"{kept} core(s) kept for the front end (CPUs "
                                             f"{cpulist.format(choice.frontend_cpus)})",) if kept else ()),
                       cause="decode and prefill scale with the cores that read weights; a team smaller than the "
                             "cores leaves memory bandwidth and compute unused", fix=fix)
    return Finding("openmp.threads", OK, f"OMP_NUM_THREADS={n} fits the {cores} physical cores allowed",
                   evidence=evidence)


def _affinity(pins, allowed, scope, threads: int | None = None, engine_fix: tuple[str, ...] = ()) -> Finding:
    name, value = pins[0]
    listed = listed_cpus(name, value)
    first = listed[0] if listed else None
    evidence = [f"{k}={v}" for k, v in pins]
    outside = sorted(set(listed) - set(allowed))
    if outside:
        evidence.append(f"CPUs {cpulist.format(outside)} listed but outside the allowed CPUs "
                        f"{cpulist.format(allowed)}")
    fix = ("remove " + ", ".join(k for k, _ in pins) + " from the container's (or shell's) environment: `docker run "
           "-e`, compose `environment:`, the pod's `env:`",
           "let the inference process pin its own OpenMP threads: deploykit's engine derives them from DEPLOYKIT_CPUS; "
           "vLLM from VLLM_CPU_OMP_THREADS_BIND; llama.cpp from --cpu-range")
    if engine_fix:
        fix = fix[:1] + engine_fix
    what = (f"every process that loads libgomp has its main thread narrowed to CPU {first}, and every thread or "
            f"process it starts later inherits CPU {first}") if first is not None else \
        "every process that loads OpenMP binds its threads by it, the front end and helper threads included"
    if scope.everything:
        return Finding("openmp.affinity_env", FAIL, f"{name} is set for everything in {scope.where}: {what}",
                       evidence=tuple(evidence),
                       cause="container-wide OpenMP affinity: the 'two threads busy' pattern", fix=fix)
    few = listed and threads is not None and threads > len(set(listed))
    if few:
        return Finding("openmp.affinity_env", FAIL, f"{name} lists {len(set(listed))} CPU(s) for "
                       f"OMP_NUM_THREADS={threads} threads in {scope.where}: threads share CPUs",
                       evidence=tuple(evidence), fix=engine_fix or (f"list one CPU per thread in {name}, one per "
                                                                    "physical core",))
    level = FAIL if outside else INFO
    return Finding("openmp.affinity_env", level, f"{name} set in {scope.where}", evidence=tuple(evidence),
                   fix=fix if outside else ())


def _preloaded_runtime(env, ld_so_preload, runtimes, scope, check_installed) -> Finding:
    pre = preloads(env, ld_so_preload)
    omp_pre = [p for p in pre if runtime_family(p)]
    if not omp_pre:
        return Finding("openmp.preload", OK, "no OpenMP runtime preloaded")
    fams = {runtime_family(p) for p in omp_pre}
    bundled = {runtime_family(r) for r in (runtimes or ())} - {None}
    evidence = (f"LD_PRELOAD={env.get('LD_PRELOAD', '')}",) + \
        ((f"/etc/ld.so.preload: {' '.join(ld_so_preload)}",) if ld_so_preload else ()) + \
        ((f"the process's OpenMP runtime: {', '.join(runtimes or ())}",) if runtimes else ())
    fix = (f"remove {', '.join(omp_pre)} from LD_PRELOAD: PyTorch brings its own OpenMP runtime",)
    if len(fams) > 1 or len(bundled) > 1 or (bundled and fams - bundled):
        return Finding("openmp.preload", FAIL, f"a second OpenMP runtime is preloaded in {scope.where}: "
                       f"{', '.join(sorted(fams | bundled))} in one process", evidence=evidence,
                       cause="two OpenMP runtimes each start a thread pool and fight over the same cores (the "
                             "classic 'one core busy')", fix=fix)
    if not bundled:
        return Finding("openmp.preload", WARN, f"an OpenMP runtime is preloaded in {scope.where} "
                       f"({', '.join(omp_pre)}); if the inference library brings another, both load",
                       evidence=evidence, fix=fix)
    return Finding("openmp.preload", OK, f"preloaded OpenMP runtime {', '.join(omp_pre)} is the one in use",
                   evidence=evidence)


def _malloc(env, ld_so_preload, scope, check_installed) -> Finding:
    pre = [p for p in preloads(env, ld_so_preload) if FAST_MALLOC.search(p)]
    fix = ("LD_PRELOAD=libtcmalloc_minimal.so.4 for the inference process (Debian/Ubuntu: apt-get install "
           "libtcmalloc-minimal4; deploykit's image preloads it)",)
    if not pre:
        return Finding("malloc.tcmalloc", WARN, f"tcmalloc is not preloaded in {scope.where}: glibc malloc serves "
                       "the engine's many short-lived tensors", fix=fix,
                       cause="glibc's per-thread arenas fragment and return memory slowly under many threads")
    missing = [p for p in pre if check_installed and not installed(p)]
    if missing:
        return Finding("malloc.tcmalloc", WARN, f"LD_PRELOAD names {', '.join(missing)} but it is not installed: "
                       "the loader skips it", evidence=(f"LD_PRELOAD={env.get('LD_PRELOAD', '')}",), fix=fix)
    return Finding("malloc.tcmalloc", OK, f"{', '.join(Path(p).name for p in pre)} preloaded")


def _vllm_bind(value: str, topo: Topology) -> Finding:
    """vLLM's own binding list: `auto`, `nobind`, or CPU lists per rank separated by `|`."""
    low = value.strip().lower()
    if low == "auto":
        return Finding("vllm.bind", OK, "VLLM_CPU_OMP_THREADS_BIND=auto: vLLM picks one CPU per physical core per "
                       "NUMA node")
    if low == "nobind":
        return Finding("vllm.bind", WARN, "VLLM_CPU_OMP_THREADS_BIND=nobind: OpenMP threads are not pinned; the "
                       "scheduler moves them across cores and NUMA nodes",
                       fix=("VLLM_CPU_OMP_THREADS_BIND=auto, or explicit lists with one CPU per physical core of one "
                            "node per rank",))
    problems: list[str] = []
    node_of = {c.id: c.node for c in topo.cpus}
    core_of = {c.id: c.core for c in topo.cpus}
    for i, rank in enumerate(value.split("|")):
        try:
            cpus = cpulist.parse(rank)
        except ValueError:
            problems.append(f"rank {i}: {rank!r} is not a CPU list")
            continue
        outside = sorted(set(cpus) - set(topo.allowed_cpus))
        if outside:
            problems.append(f"rank {i}: CPUs {cpulist.format(outside)} are outside the allowed CPUs")
        nodes = sorted({node_of[c] for c in cpus if c in node_of})
        if len(nodes) > 1:
            problems.append(f"rank {i} spans NUMA nodes {cpulist.format(nodes)}: its memory is bound to one, the "
                            "other node's threads read remotely")
        shared = len(cpus) - len({core_of[c] for c in cpus if c in core_of})
        if shared > 0:
            problems.append(f"rank {i}: {shared} CPUs are SMT siblings of others in the list (two threads per core)")
    if problems:
        return Finding("vllm.bind", WARN, f"VLLM_CPU_OMP_THREADS_BIND={value} does not map one thread per "
                       "physical core of one node per rank", evidence=tuple(problems),
                       fix=("one list per rank, one CPU per physical core of one NUMA node, e.g. what "
                            "`deploykit plan` prints as inference CPUs per replica",))
    return Finding("vllm.bind", OK, f"VLLM_CPU_OMP_THREADS_BIND={value}: one CPU per physical core, one node per rank")
