"""What `deploykit bench` shows and writes: the live progress, the final table, the JSON document (every raw number,
the settings, the server's identity and the client host), and `--compare` of several such documents.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from ..errors import OutputError, TargetError

KIND = "deploykit-bench"
FORMAT = 1


def client_host() -> dict:
    from ..isa import OF_INTEREST, cpu_flags, cpu_model, tier
    model, flags = cpu_model(), cpu_flags()
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus_allowed": len(os.sched_getaffinity(0)), "cpu_model": model, "isa_tier": tier(flags),
            "isa": sorted(flags & set(OF_INTEREST)),
            "deploykit": __version__}


def document(settings: dict, server: dict, prompts: dict, levels: list[dict], *, interrupted: bool) -> dict:
    return {"kind": KIND, "format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": settings,
            "server": server, "client": client_host(), "prompts": prompts, "interrupted": interrupted,
            "levels": levels}


CLIENT_SHARE_NOTED = 0.10  # a level's client CPU share (of one CPU) worth a note under the table


def level(summary: dict, results: list, metrics: dict | None) -> dict:
    return {**summary, "replica_metrics": metrics, "raw": [asdict(r) for r in results]}


def write(doc: dict, path: str) -> None:
    try:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as e:
        raise OutputError(f"cannot write the results: {e.strerror or e}", path=path) from None


def load(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot read a bench result: {e}", path=path,
                          hint="give files written by deploykit bench --out") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND or not isinstance(doc.get("levels"), list):
        raise TargetError("not a deploykit bench result", path=path, hint="give files written by deploykit bench --out")
    return doc


def _ms(d: dict, q: str) -> str:
    v = d.get(q) if d else None
    return "-" if v is None else f"{v * 1000:.0f}" if v >= 0.1 else f"{v * 1000:.1f}"


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def console(stream=None):
    """Tables as wide as they need (up to 200 columns) when written to a file or pipe, the terminal's otherwise."""
    from rich.console import Console
    stream = stream or sys.stdout
    return Console(file=stream, highlight=False, width=None if stream.isatty() else 200)


def table(doc: dict, title: str | None = None):
    from rich.table import Table
    s = doc["settings"]
    t = Table(title=title or f"{doc['server'].get('url', '')} · {s['model']} · {s['prompt_tokens']} prompt → "
                             f"{s['max_tokens']} output tokens{' · chat' if s.get('chat') else ''}",
              title_justify="left")
    for col in ("streams", "ok", "errors", "out tok/s", "req/s", "TTFT p50/p90/p99 ms",
                "ITL p50/p90/p99 ms", "E2E p50/p99 s", "tokens from"):
        t.add_column(col, justify="right" if col not in ("tokens from",) else "left")
    for lv in doc["levels"]:
        ttft, itl, e2e = lv["ttft_s"], lv["itl_s"], lv["e2e_s"]
        t.add_row(str(lv["concurrency"]) + (" (interrupted)" if lv.get("interrupted") else ""), str(lv["requests"]),
                  f"[red]{lv['errors']}[/]" if lv["errors"] else "0", _num(lv["output_tokens_per_s"]),
                  _num(lv["requests_per_s"], ".2f"), "/".join(_ms(ttft, q) for q in ("p50", "p90", "p99")),
                  "/".join(_ms(itl, q) for q in ("p50", "p90", "p99")),
                  f"{_num(e2e.get('p50'), '.2f')}/{_num(e2e.get('p99'), '.2f')}",
                  ", ".join(f"{k} {v}" for k, v in lv["tokens_from"].items()) or "-")
    return t


def notes(doc: dict) -> list[str]:
    """Lines under the table: errors with samples, labelled estimates, short outputs, replica metrics."""
    out = []
    prompts = doc["prompts"]
    if not prompts.get("exact", True):
        out.append(f"prompt lengths are an {prompts['source']}")
    elif prompts.get("off_length"):
        out.append(f"{prompts['off_length']} of {prompts['count']} prompts could not be made exactly "
                   f"{prompts['requested_tokens']} tokens long ({prompts['source']}); they are the closest below")
    if prompts.get("warmup_errors"):
        out.append(f"warm-up: {len(prompts['warmup_errors'])} request(s) failed, e.g. {prompts['warmup_errors'][0]}")
    for lv in doc["levels"]:
        c = lv["concurrency"]
        for e in lv["error_samples"]:
            out.append(f"concurrency {c}: {e['count']} x {e['error']}")
        if lv["tokens_from"].get("length"):
            out.append(f"concurrency {c}: the server sent no usage chunk for {lv['tokens_from']['length']} request(s); "
                       "they ended with finish_reason length, so each made max_tokens tokens")
        if lv["tokens_from"].get("chunks"):
            out.append(f"concurrency {c}: the server sent no usage chunk for {lv['tokens_from']['chunks']} request(s): "
                       "their tokens are counted content chunks (a chunk may hold several)")
        share = lv.get("client_cpu_share")
        if share is not None and share >= CLIENT_SHARE_NOTED:
            per = lv["client_cpu_s"] / lv["output_tokens"] * 1e6 if lv["output_tokens"] else None
            out.append(f"concurrency {c}: this client used {share:.0%} of a CPU"
                       + (f" ({per:.0f} µs a token)" if per is not None else "")
                       + "; on a host it shares with the server, that is CPU the server did not get")
        if lv["short_requests"]:
            out.append(f"concurrency {c}: {lv['short_requests']} request(s) ended before max_tokens (EOS or a stop; "
                       "the server may not honour ignore_eos)")
        for name, m in (lv.get("replica_metrics") or {}).items():
            if "error" in m:
                out.append(f"concurrency {c}: {name}: {m['error']}")
                continue
            shown = {**{k: f"+{v:g}" for k, v in m["deltas"].items()},
                     **{k: f"peak {v:.3g}" for k, v in m["peaks"].items()}}
            out.append(f"concurrency {c}: {name}: " + (", ".join(f"{k} {v}" for k, v in shown.items()) or "no change"))
    if doc.get("interrupted"):
        out.append("interrupted: the numbers above are what was measured before Ctrl-C")
    return out


def show(doc: dict, stream=None, title: str | None = None) -> None:
    con = console(stream)
    con.print(table(doc, title))
    for line in notes(doc):
        con.print("  " + line, markup=False)


def compare(docs: list[tuple[str, dict]]):
    """One row per (concurrency level, file); ratios against the first file's same level."""
    from rich.table import Table
    t = Table(title=f"compared with {docs[0][0]}", title_justify="left")
    for col in ("concurrency", "result", "out tok/s", "× first", "TTFT p50 ms", "TTFT p99 ms", "× first",
                "ITL p99 ms", "× first", "errors"):
        t.add_column(col, justify="left" if col == "result" else "right")
    levels = sorted({lv["concurrency"] for _, d in docs for lv in d["levels"]})
    for c in levels:
        first = next((lv for lv in docs[0][1]["levels"] if lv["concurrency"] == c), None)
        for i, (name, d) in enumerate(docs):
            lv = next((x for x in d["levels"] if x["concurrency"] == c), None)
            if lv is None:
                t.add_row(str(c), name, "-", "", "-", "-", "", "-", "", "-")
                continue
            t.add_row(str(c) if i == 0 else "", name, _num(lv["output_tokens_per_s"]),
                      _ratio(lv, first, "output_tokens_per_s") if i else "",
                      _ms(lv["ttft_s"], "p50"), _ms(lv["ttft_s"], "p99"), _ratio(lv, first, "ttft_s", "p99") if i else "",
                      _ms(lv["itl_s"], "p99"), _ratio(lv, first, "itl_s", "p99") if i else "", str(lv["errors"]))
        t.add_section()
    return t


def differences(docs: list[tuple[str, dict]]) -> list[str]:
    """Settings that differ between compared runs: their ratios then compare different workloads."""
    out = []
    for key in ("model", "prompt_tokens", "max_tokens", "chat", "ignore_eos"):
        values = {name: d["settings"].get(key) for name, d in docs}
        if len(set(map(json.dumps, values.values()))) > 1:
            out.append(f"{key} differs: " + ", ".join(f"{name} {v}" for name, v in values.items()))
    return out


def _ratio(lv: dict, first: dict | None, key: str, q: str | None = None) -> str:
    if first is None:
        return "-"
    a, b = (lv[key], first[key]) if q is None else (lv[key].get(q), first[key].get(q))
    return "-" if a is None or not b else f"{a / b:.2f}"


class Progress:
    """A rich progress bar per level (requests done of those planned, or seconds of the duration), on stderr."""

    def __init__(self, enabled: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
        self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("{task.fields[info]}"), console=Console(stderr=True), refresh_per_second=2,
                       disable=not enabled)
        self.task = None

    def __enter__(self) -> Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def level(self, description: str, total: int | None) -> None:
        self.task = self.bar.add_task(description, total=total, info="")
        self.tokens, self.errors, self.t0 = 0, 0, time.perf_counter()

    def done(self, r) -> None:
        self.tokens += r.output_tokens if r.error is None else 0
        self.errors += r.error is not None
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(self.task, advance=1, info=f"{rate:.1f} tok/s" + (f", {self.errors} errors" if self.errors
                                                                            else ""))
