"""`helm test`: every engine pod serves the model and is pinned as deploykit promises, on the CPUs the kubelet
actually gave it: one OpenMP thread per physical core of the pod's cpuset (every sibling with useSmt), each alone
on its core, the front end on cores of its own, memory bound, no binding warning.

Standard library only (it runs in the engine image with no extra packages). Environment: SERVICE (host:port of
the Service), PODS (the headless Service's DNS name), PORT, MODEL (served name), USE_SMT, RESERVED_CPUS, THREADS
(empty = default), DEPLOYKIT_API_KEY (optional). Exit 0 when every pod passes, 1 otherwise, with every problem.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request


def parse(text: str) -> list[int]:
    """Linux CPU list syntax ("0-3,8") -> sorted ids."""
    out: set[int] = set()
    for part in (text or "").split(","):
        if part.strip():
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def check(engine: dict, *, use_smt: bool, reserved: int | None, threads: int | None) -> list[str]:
    """Problems with one engine's /debug/binding report ([] = pinned as promised)."""
    problems = []
    cpuset = set(parse(engine["cpuset"]))
    cores = [parse(c) for c in engine["physical_cores"]]
    core_of = {cpu: i for i, core in enumerate(cores) for cpu in core}
    omp = sorted((t for t in engine["threads"] if t["omp_thread"] is not None), key=lambda t: t["omp_thread"])
    pinned = [parse(t["allowed_cpus"]) for t in omp]
    loose = [t["tid"] for t, p in zip(omp, pinned) if len(p) != 1]
    if loose:
        problems.append(f"OpenMP threads {loose} are not pinned to a single CPU")
    cpus = [p[0] for p in pinned if len(p) == 1]
    if set(cpus) - cpuset:
        problems.append(f"OpenMP threads on CPUs {sorted(set(cpus) - cpuset)} outside the pod's cpuset")
    used = [core_of[c] for c in cpus if c in core_of]
    if len(set(cpus)) != len(cpus):
        problems.append("two OpenMP threads share a CPU")
    if not use_smt and len(set(used)) != len(used):
        problems.append("two OpenMP threads share a physical core (SMT siblings) without useSmt")
    front = {core_of[c] for c in parse(engine.get("frontend_cpus") or "") if c in core_of}
    if front & set(used):
        problems.append("the front end's cores also run OpenMP threads")
    # The cores the front end keeps: as asked, or deploykit's default (1 from 4 cores up, else 0).
    keep = reserved if reserved is not None else (1 if len(cores) >= 4 else 0)
    compute = [core for i, core in enumerate(cores) if i not in front][: max(0, len(cores) - keep)]
    want = sum(len(core) for core in compute) if use_smt else len(compute)
    if threads is not None:
        want = min(want, threads)
    if len(omp) != want:
        problems.append(f"{len(omp)} OpenMP threads for {len(cores)} physical cores in cpuset {engine['cpuset']} "
                        f"({keep} kept for the front end): expected {want}. A CPU quota below the cpuset (no static "
                        "CPU manager, or a Burstable pod) does this; see node/README.md from `deploykit render`")
    if engine.get("omp_threads") != len(omp):
        problems.append(f"the engine reports {engine.get('omp_threads')} OpenMP threads but {len(omp)} are running")
    if len(front) != keep and keep < len(cores):
        problems.append(f"the front end holds {len(front)} core(s), expected {keep}")
    policy = engine.get("memory_policy") or {}
    if policy.get("mode") not in ("bind", "interleave"):
        problems.append(f"memory is not bound to a NUMA node (policy {policy}); is the Localhost seccomp profile "
                        "in place?")
    problems += [f"binding warning: {w}" for w in engine.get("warnings") or ()]
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
        engine = _get(f"http://{host}:{env['PORT']}/debug/binding", key)["engine"]
        problems = check(engine, **opts)
        head = f"pod {ip}: cpuset {engine['cpuset']}, {engine['omp_threads']} OpenMP threads on {engine['planned_cpus']}"
        print(("FAIL " if problems else "ok   ") + head)
        for p in problems:
            print(f"     - {p}")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
