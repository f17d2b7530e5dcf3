"""`deploykit bench SPEC --sweep`: placement by measurement. Each candidate placement (candidates.py) is brought up
with `deploykit up` under a name of its own on free loopback ports, warmed and loaded with the same prompts, then
torn down; the table marks the best for the objective and `--write-spec` writes the spec with that placement.

Bounded by --budget (no candidate starts that the time left cannot cover, judged by the slowest so far); Ctrl-C
tears down the candidate running and keeps everything measured until then.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import DeploykitError, PlanError
from . import candidates as cands
from . import client, report, run, target

KIND = "deploykit-bench-sweep"
SUFFIX = "-sweep"


@dataclass(slots=True)
class Tried:
    candidate: cands.Candidate
    status: str = "pending"  # measured | failed | skipped | interrupted
    error: str = ""
    doc: dict | None = None
    seconds: float = 0.0
    score: float | None = None

    def to_json(self) -> dict:
        c = self.candidate
        return {"label": c.label, "shape": c.shape(), "cpus": c.cpus(), "placement": c.placement, "status": self.status,
                "error": self.error, "seconds": self.seconds, "score": self.score, "result": self.doc}


@dataclass(frozen=True, slots=True)
class Objective:
    goal: str = "throughput"  # throughput | latency
    slo_ttft_ms: float | None = None

    def score(self, doc: dict | None) -> float | None:
        """Higher is better; None: no valid measurement, or the SLO is missed.
        throughput: the best output tokens/s of a level with no errors (and p99 TTFT within the SLO);
        latency: minus the p99 TTFT at the highest concurrency (within the SLO, no errors)."""
        if doc is None:
            return None
        levels = [lv for lv in doc["levels"] if lv["requests"] and not lv["errors"] and not lv.get("interrupted")
                  and lv["ttft_s"]["p99"] is not None]
        if self.slo_ttft_ms is not None:
            levels = [lv for lv in levels if lv["ttft_s"]["p99"] * 1000 <= self.slo_ttft_ms]
        if not levels:
            return None
        if self.goal == "throughput":
            return max(lv["output_tokens_per_s"] or 0.0 for lv in levels)
        top = max(c for c in doc["settings"]["concurrency"])
        at_top = [lv for lv in levels if lv["concurrency"] == top]
        return -at_top[0]["ttft_s"]["p99"] if at_top else None

    def describe(self) -> str:
        what = "highest output tokens/s" if self.goal == "throughput" else "lowest p99 TTFT at the highest concurrency"
        return what + (f", p99 TTFT <= {self.slo_ttft_ms:g} ms" if self.slo_ttft_ms is not None else "")


def sweep_name(name: str) -> str:
    return name[:40 - len(SUFFIX)].rstrip("-") + SUFFIX


def free_ports(span: int) -> int:
    """A port p with p .. p+span-1 free on loopback (the load balancer and each replica)."""
    import socket

    from ..runtime.preflight import can_bind
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span < 65536 and all(can_bind("127.0.0.1", port + i) for i in range(span)):
            return port
    raise PlanError("no free range of loopback ports for the sweep's deployments")


def sweep(spec_path: str, settings: run.Settings, *, runtime: str, state_dir: str | None, objective: Objective,
          budget: float | None, up_timeout: float, progress: report.Progress) -> tuple[list[Tried], list[str], bool]:
    """Bring up, measure and tear down each candidate. Returns (every candidate, notes, interrupted)."""
    from .. import hardware, specfile
    from ..cli import load_plan
    from ..runtime import lifecycle
    spec = specfile.load(spec_path)
    if spec.hardware != "auto":
        raise PlanError("a sweep measures placements on this host, but the spec describes other hardware",
                        path="hardware", value="sysroot" if hasattr(spec.hardware, "sysroot") else "inline",
                        allowed="auto", hint="use hardware: auto")
    found, notes = cands.candidates(spec_path, hardware.resolve(spec, None))
    tried = [Tried(c) for c in found]
    name = sweep_name(spec.name)
    data = cands.spec_data(spec_path)

    def say(line: str) -> None:
        progress.bar.console.print(line, markup=False, highlight=False)
    say(f"sweep of {len(tried)} placement(s) for {spec.name} as deployment {name} ({runtime} runtime):")
    for t in tried:
        say(f"  {t.candidate.label}: {t.candidate.shape()}, CPUs {t.candidate.cpus()}")
    start, slowest = time.monotonic(), 0.0
    shared = None
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="deploykit-sweep-") as tmp:
        for i, t in enumerate(tried):
            if budget is not None and time.monotonic() - start + slowest > budget:
                t.status, t.error = "skipped", f"--budget {budget:g} s would be exceeded"
                continue
            began = time.monotonic()
            partial = run.Partial(settings)
            up = False
            try:
                say(f"[{i + 1}/{len(tried)}] {t.candidate.label}: deploykit up --runtime {runtime}")
                path = Path(tmp) / f"candidate-{i}.yaml"  # the user's spec, this placement, free loopback ports
                serving = {**data.get("serving", {}), "port": free_ports(len(t.candidate.plan.replicas) + 1),
                           "publish_address": "127.0.0.1"}
                path.write_text(yaml.safe_dump({**data, "name": name, "placement": t.candidate.placement,
                                                "serving": serving}, sort_keys=False))
                _, _, plan = load_plan(str(path), None)
                up = True
                with contextlib.redirect_stdout(io.StringIO()):  # its progress goes to stderr; not its endpoint text
                    lifecycle.up(plan, str(path), runtime=runtime, state_dir=state_dir, timeout=up_timeout,
                                 keep_on_failure=False)
                tgt = target.from_deployment(str(path), state_dir, None)
                t.doc = client.run(run.measure(tgt, settings, partial, progress=progress, shared_prompts=shared))
                shared = shared or partial.made
                t.status = "measured"
            except KeyboardInterrupt:
                t.status, interrupted = "interrupted", True
                t.doc = partial.document(interrupted=True) if partial.levels or partial.current else None
            except DeploykitError as e:
                t.status, t.error = "failed", str(e).splitlines()[0]
            finally:
                if up:  # a failed up has undone itself; down then finds nothing, and removes the state directory
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(DeploykitError):
                        lifecycle.down(name, runtime=runtime, state_dir=state_dir, volumes=True)
                t.seconds = time.monotonic() - began
                slowest = max(slowest, t.seconds)
            t.score = objective.score(t.doc)
            if interrupted:
                for rest in tried[i + 1:]:
                    rest.status = "skipped"
                    rest.error = "interrupted"
                break
    return tried, notes, interrupted


def best(tried: list[Tried]) -> Tried | None:
    scored = [t for t in tried if t.score is not None]
    return max(scored, key=lambda t: t.score) if scored else None


def table(tried: list[Tried], objective: Objective, concurrency: tuple[int, ...]):
    from rich.table import Table
    winner = best(tried)
    t = Table(title=f"placements measured · best: {objective.describe()}", title_justify="left")
    t.add_column("")
    t.add_column("candidate")
    t.add_column("replicas x threads")
    t.add_column("CPUs")
    for c in concurrency:
        t.add_column(f"c={c}: tok/s | TTFT p99 ms | ITL p99 ms", justify="right")
    t.add_column("errors", justify="right")
    t.add_column("status")
    for x in tried:
        by_c = {lv["concurrency"]: lv for lv in (x.doc or {}).get("levels", [])}
        cells = []
        for c in concurrency:
            lv = by_c.get(c)
            cells.append("-" if lv is None else f"{report._num(lv['output_tokens_per_s'])} | "
                                                f"{report._ms(lv['ttft_s'], 'p99')} | {report._ms(lv['itl_s'], 'p99')}")
        errors = sum(lv["errors"] for lv in by_c.values())
        status = x.status + (f": {x.error}" if x.error else "")
        if x.status == "measured" and x.score is None:
            status += " (misses the objective: errors or SLO)"
        t.add_row("★ best" if x is winner else "", x.candidate.label, x.candidate.shape(), x.candidate.cpus(), *cells,
                  str(errors), status)
    return t


def document(tried: list[Tried], notes: list[str], objective: Objective, spec_path: str, interrupted: bool) -> dict:
    winner = best(tried)
    return {"kind": KIND, "format": report.FORMAT, "spec": str(Path(spec_path).resolve()), "objective": objective.goal,
            "slo_ttft_ms": objective.slo_ttft_ms, "interrupted": interrupted, "notes": notes,
            "client": report.client_host(), "best": winner.candidate.label if winner else None,
            "candidates": [t.to_json() for t in tried]}


def write_spec(spec_path: str, winner: Tried, objective: Objective, out: str) -> str:
    """The user's spec with the winning placement (paths made absolute), validated and planned again."""
    from ..cli import load_plan
    data = {**cands.spec_data(spec_path), "placement": winner.candidate.placement}
    head = (f"# {Path(spec_path).name} with the placement deploykit bench --sweep measured best here\n"
            f"# ({objective.describe()}: {winner.candidate.label}, {winner.candidate.shape()})\n")
    try:
        Path(out).write_text(head + yaml.safe_dump(data, sort_keys=False))
    except OSError as e:
        from ..errors import OutputError
        raise OutputError(f"cannot write the spec: {e.strerror or e}", path=out) from None
    _, _, plan = load_plan(out, None)
    return f"wrote {out}: valid, plans {len(plan.replicas)} replica(s) ({winner.candidate.shape()})"

