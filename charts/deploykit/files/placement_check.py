"""`helm test`: every engine pod serves the model and is pinned as deploykit promises, on the CPUs the kubelet
actually gave it: one OpenMP thread per physical core of the pod's cpuset (every sibling with useSmt), each alone
on its core, the front end on cores of its own, memory bound, no binding warning.

It runs in the engine image, so it reads the report with deploykit's own types (deploykit.binding_report) and
expects what deploykit.placement would choose for the pod's cpuset: the rule the engine applied, not a copy of it.
Environment: SERVICE (host:port of the Service), PODS (the headless Service's DNS name), PORT, MODEL (served name),
USE_SMT, RESERVED_CPUS, THREADS (empty = default), DEPLOYKIT_API_KEY (optional). Exit 0 when every pod passes, 1
otherwise, with every problem.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request

from deploykit import cpulist, placement
from deploykit.binding_report import BindingReport, EngineReport
from deploykit.errors import DeploykitError


def check(engine: EngineReport, *, use_smt: bool, reserved: int | None, threads: int | None) -> list[str]:
    """Problems with one engine's /debug/binding report ([] = pinned as promised)."""
    problems = []
    topo, cpuset = engine.topology, set(engine.cpuset)
    cores = placement.physical_cores(topo, engine.cpuset)
    core_of = {cpu: i for i, core in enumerate(cores) for cpu in core}
    omp = engine.omp
    loose = [t.tid for t in omp if len(t.allowed_cpus) != 1]
    if loose:
        problems.append(f"OpenMP threads {loose} are not pinned to a single CPU")
    cpus = [t.allowed_cpus[0] for t in omp if len(t.allowed_cpus) == 1]
    if set(cpus) - cpuset:
        problems.append(f"OpenMP threads on CPUs {sorted(set(cpus) - cpuset)} outside the pod's cpuset")
    used = [core_of[c] for c in cpus if c in core_of]
    if len(set(cpus)) != len(cpus):
        problems.append("two OpenMP threads share a CPU")
    if not use_smt and len(set(used)) != len(used):
        problems.append("two OpenMP threads share a physical core (SMT siblings) without useSmt")
    front = {core_of[c] for c in engine.frontend_cpus or () if c in core_of}
    if front & set(used):
        problems.append("the front end's cores also run OpenMP threads")
    # What the engine's own rule picks for this cpuset (no quota: a quota below the cpuset is what this test is
    # there to catch).
    try:
        want = placement.choose(topo, engine.cpuset, reserved=reserved, use_smt=use_smt, threads=threads,
                                label="pod")
    except DeploykitError as e:
        return problems + [f"the values cannot be met on cpuset {cpulist.format(engine.cpuset)}: {e}"]
    keep = len(placement.physical_cores(topo, want.frontend_cpus))
    if len(omp) != len(want.cpus):
        problems.append(f"{len(omp)} OpenMP threads for {len(cores)} physical cores in cpuset "
                        f"{cpulist.format(engine.cpuset)} ({keep} kept for the front end): expected {len(want.cpus)}. "
                        "A CPU quota below the cpuset (no static CPU manager, or a Burstable pod) does this; see "
                        "node/README.md from `deploykit render`")
    if engine.omp_threads != len(omp):
        problems.append(f"the engine reports {engine.omp_threads} OpenMP threads but {len(omp)} are running")
    if len(front) != keep:
        problems.append(f"the front end holds {len(front)} core(s), expected {keep}")
    if not engine.memory_policy.bound:
        problems.append(f"memory is not bound to a NUMA node (policy {engine.memory_policy.to_dict()}); is the "
                        "Localhost seccomp profile in place?")
    problems += [f"binding warning: {w}" for w in engine.warnings]
    return problems


def _get(url: str, key: str | None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def main() -> int:
    env = os.environ
    key = env.get("DEPLOYKIT_API_KEY") or None
    opts = {"use_smt": env.get("USE_SMT") == "1",
            "reserved": int(env["RESERVED_CPUS"]) if env.get("RESERVED_CPUS") else None,
            "threads": int(env["THREADS"]) if env.get("THREADS") else None}
    failed = False
    models = [m["id"] for m in _get(f"http://{env['SERVICE']}/v1/models", key)["data"]]
    if env["MODEL"] not in models:
        print(f"FAIL /v1/models lists {models}, not {env['MODEL']}")
        failed = True
    pods = sorted({a[4][0] for a in socket.getaddrinfo(env["PODS"], int(env["PORT"]), proto=socket.IPPROTO_TCP)})
    if not pods:
        print(f"FAIL no ready engine pod behind {env['PODS']}")
        return 1
    for ip in pods:
        host = f"[{ip}]" if ":" in ip else ip
        try:
            engine = BindingReport.from_dict(_get(f"http://{host}:{env['PORT']}/debug/binding", key)).engine
        except DeploykitError as e:
            print(f"FAIL pod {ip}: {e}")
            failed = True
            continue
        problems = check(engine, **opts)
        head = (f"pod {ip}: cpuset {cpulist.format(engine.cpuset)}, {engine.omp_threads} OpenMP threads on "
                f"{cpulist.format(engine.planned_cpus or ())}")
        print(("FAIL " if problems else "ok   ") + head)
        for p in problems:
            print(f"     - {p}")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
