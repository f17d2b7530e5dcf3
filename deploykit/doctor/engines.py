"""Inference servers doctor recognises in a process tree (vLLM's CPU backend, llama.cpp), and their own knobs with
the values for this host: a fix for such a process names what its user sets, not deploykit's or OpenMP's variables
(vLLM sets GOMP_CPU_AFFINITY / OMP_NUM_THREADS for its workers itself, from VLLM_CPU_OMP_THREADS_BIND)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import cpulist, placement
from ..errors import PlanError
from ..process import Proc
from ..topology import Topology

VLLM, LLAMA_CPP = "vLLM", "llama.cpp"
_LLAMA = re.compile(r"(?:^|/)llama-(?:server|cli|bench|run)\b|(?:^|/)(?:server|main)\s.*\.gguf\b")
_VLLM_CMD = re.compile(r"(?:^|[\s/])vllm(?:\s|$)|\bvllm\.entrypoints\b")


@dataclass(frozen=True, slots=True)
class Engine:
    name: str  # VLLM | LLAMA_CPP
    evidence: str  # what gave it away, for the report


def recognise(procs: list[Proc]) -> Engine | None:
    """vLLM by its process titles (VLLM::EngineCore, VLLM::Worker: setproctitle), its command line or its
    VLLM_CPU_* environment; llama.cpp by its binaries' names."""
    for p in procs:
        if p.name.startswith("VLLM::") or p.cmdline.startswith("VLLM::"):
            return Engine(VLLM, f"process title {p.cmdline.split()[0] if p.cmdline else p.name}, pid {p.pid}")
    for p in procs:
        if _VLLM_CMD.search(p.cmdline):
            return Engine(VLLM, f"command line of pid {p.pid}: {p.cmdline[:80]}")
        if any(k.startswith("VLLM_CPU_") for k in p.env or {}):
            return Engine(VLLM, f"VLLM_CPU_* in the environment of pid {p.pid}")
    for p in procs:
        if p.name.startswith("llama-") or _LLAMA.search(p.cmdline):
            return Engine(LLAMA_CPP, f"pid {p.pid}: {p.cmdline[:80] or p.name}")
    return None


def _choices(topo: Topology) -> list[placement.CpuChoice]:
    """deploykit's policy on each NUMA node of the CPUs the process may use (one rank / one server per node)."""
    allowed = set(topo.allowed_cpus)
    out = []
    nodes = [n for n in topo.nodes if set(n.cpus) & allowed]
    quota = topo.quota_cpus / len(nodes) if topo.quota_cpus is not None and nodes else None
    for n in nodes:
        try:
            out.append(placement.choose(topo, [c for c in n.cpus if c in allowed], quota=quota,
                                        label=f"node {n.id}"))
        except PlanError:
            continue
    return out


def knobs(engine: Engine | None, topo: Topology) -> tuple[str, ...]:
    """The engine's own settings that give one pinned OpenMP thread per physical core of the CPUs this process may
    use (one rank or one server per NUMA node), the front end on a core of its own where there are 4 or more."""
    if engine is None:
        return ()
    ranks = _choices(topo)
    if not ranks:
        return ()
    threads = sum(len(r.cpus) for r in ranks)
    front = sum(len(placement.physical_cores(topo, r.frontend_cpus)) for r in ranks)
    if engine.name == VLLM:
        bind = "|".join(cpulist.format(r.cpus) for r in ranks)
        tp = (f" with --tensor-parallel-size {len(ranks)} (one rank per NUMA node)" if len(ranks) > 1 else "")
        kept = (f"; the front end and scheduler keep CPUs {cpulist.format(c for r in ranks for c in r.frontend_cpus)}"
                if front else "; with fewer than 4 cores no core is kept from inference")
        return (f"vLLM ({engine.evidence}): start it with VLLM_CPU_OMP_THREADS_BIND={bind} VLLM_CPU_NUM_OF_RESERVED_CPU={front}{tp}: "
                f"{threads} OpenMP thread(s), one per physical core{kept}. vLLM sets OMP_NUM_THREADS and "
                "GOMP_CPU_AFFINITY for its workers from these; set neither container-wide",)
    lines = []
    multi = len(topo.nodes) > 1
    for r in ranks:
        node = topo.cpu(r.cpus[0]).node
        lines.append(f"llama.cpp ({engine.evidence}{f'; one server per NUMA node, node {node}' if len(ranks) > 1 else ''}): "
                     f"-t {len(r.cpus)} {_llama_cpus(r.cpus)} --cpu-strict 1"
                     + (" --numa isolate (start it with numactl --cpunodebind=" f"{node} --membind={node})"
                        if multi else "") + f": one thread per physical core of CPUs {cpulist.format(r.cpus)}")
    return tuple(lines)


def _llama_cpus(cpus: tuple[int, ...]) -> str:
    """--cpu-range lo-hi when the CPUs are consecutive, else --cpu-mask in hex."""
    if cpus and cpus[-1] - cpus[0] + 1 == len(cpus):
        return f"--cpu-range {cpus[0]}-{cpus[-1]}"
    return f"--cpu-mask {sum(1 << c for c in cpus):x}"
