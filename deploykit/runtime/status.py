"""`deploykit status`: one row per member, what the runtime says (state, id) next to what the plan wanted and what
the engine reports about itself: CPUs and memory nodes from /debug/binding, requests running and tokens per second
from two /metrics scrapes `interval` seconds apart.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from .. import cpulist
from ..plan import Plan
from . import Observed, Runtime, health
from .deployment import members, url

RUNNING = "deploykit_num_requests_running"
GENERATED = "deploykit_generation_tokens_total"
COLUMNS = (("member", "MEMBER"), ("id", "ID"), ("state", "STATE"), ("health", "HEALTH"),
           ("plan_cpus", "CPUS (PLAN)"), ("engine_cpus", "CPUS (ENGINE)"), ("plan_mems", "NUMA (PLAN)"),
           ("engine_mems", "NUMA (ENGINE)"), ("running", "RUNNING"), ("tokens_per_s", "TOK/S"))


def collect(rt: Runtime, name: str, plan: Plan | None, interval: float) -> list[dict]:
    seen = rt.observe(name)
    expected = {m.name: m for m in members(plan, rt.name)} if plan else {}
    names = list(expected) + sorted(n for n in seen if n not in expected)
    key = (os.environ.get(plan.serving.api_key_env) or None) if plan and plan.serving.api_key_env else None

    def metrics(n: str) -> dict | None:
        return health.metrics(rt.fetch(plan, expected[n], "/metrics", timeout=health.REPORT_TIMEOUT))

    def first(n: str) -> tuple:
        if n not in expected or n not in seen:
            return None, None, None, None
        m, is_replica = expected[n], seen[n].replica is not None
        return (rt.fetch(plan, m, "/health", timeout=health.HEALTH_TIMEOUT),
                health.binding(rt.fetch(plan, m, "/debug/binding", timeout=health.REPORT_TIMEOUT, api_key=key))
                if is_replica else None, metrics(n) if is_replica else None, time.monotonic())

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(names)))) as pool:
        probes = dict(zip(names, pool.map(first, names), strict=True))
        if any(p[2] for p in probes.values()):
            time.sleep(interval)
            again = dict(zip(names, pool.map(lambda n: (metrics(n), time.monotonic())
                                              if probes[n][2] else (None, None), names), strict=True))
        else:
            again = {n: (None, None) for n in names}
    replicas = {r.name: r for r in plan.replicas} if plan else {}
    rows = []
    for n in names:
        o: Observed | None = seen.get(n)
        answer, report, m1, t1 = probes[n]
        m2, t2 = again[n]
        r = replicas.get(n)
        row = {
            "member": n, "replica": o.replica if o else (r.index if r else None), "id": o.id if o else "",
            "state": o.state if o else "missing", "detail": o.detail if o else "not running",
            "health": health.describe(answer) if answer else "-",
            "plan_cpus": cpulist.format(r.cpus) if r else (o.cpus if o else None),
            "engine_cpus": health.engine_cpus(report) if report else None,
            "frontend_cpus": cpulist.format(report.frontend.allowed_cpus) if report else None,
            "plan_mems": cpulist.format(r.mems) if r else None,
            "engine_mems": health.engine_mems(report) if report else None,
            "runtime_cpus": o.cpus if o else None, "runtime_mems": o.mems if o else None,
            "running": int(m2[RUNNING]) if m2 and RUNNING in m2 else None,
            "tokens_per_s": (round((m2[GENERATED] - m1[GENERATED]) / (t2 - t1), 1)
                             if m1 and m2 and GENERATED in m1 and GENERATED in m2 and t2 > t1 else None),
        }
        if r is not None and report is None and answer is not None and answer.status == 200 and key is None \
                and plan and plan.serving.api_key_env:
            row["detail"] = f"export {plan.serving.api_key_env} to see the engine's binding"
        row["matches_plan"] = (row["engine_cpus"] == row["plan_cpus"]) if row["engine_cpus"] else None
        rows.append(row)
    return rows


def table(name: str, runtime: str, plan: Plan | None, rows: list[dict]) -> str:
    head = f"deployment {name} · runtime {runtime}"
    if plan is not None:
        head += f" · endpoint {url(plan.serving.publish_address, plan.serving.port, '/v1')}"
    cells = [[h for _, h in COLUMNS]] + [[_cell(row, k) for k, _ in COLUMNS] for row in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = [head, ""] + ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))).rstrip() for c in cells]
    notes = [f"{row['member']}: {row['detail']}" for row in rows if row["detail"]]
    mismatched = [row["member"] for row in rows if row["matches_plan"] is False]
    if mismatched:
        notes.append(f"{', '.join(mismatched)}: the engine's OpenMP threads are not on the planned CPUs "
                     "(see GET /debug/binding)")
    return "\n".join(lines + ([""] + notes if notes else []))


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if key == "engine_cpus" and row.get("frontend_cpus") and value:
        return f"{value} (front {row['frontend_cpus']})"
    return "-" if value is None or value == "" else str(value)
