"""`deploykit bench`: its arguments, and which of the three things it does (a run against a URL or deployment, a
--sweep of a spec's placements, a --compare of result files), with what is shown, written and returned.

Exit codes come from the CLI's one table: 10 (TargetError) when the endpoint cannot be reached or every request
failed, 6 (OutputError) when results or the plot cannot be written; Ctrl-C shows what was measured and returns 130.
"""

from __future__ import annotations

import argparse
import json
import random

from ..commands import arg
from ..errors import TargetError


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, e.g. 1,4,16; got {text!r}")
    return levels


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = 0
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return v
    return parse


def _body(text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"top_k\": 1}'")
    return v


def _count_or_duration(p: argparse.ArgumentParser) -> None:
    one = p.add_mutually_exclusive_group()
    one.add_argument("--requests", type=_positive(int), metavar="N",
                     help="requests per level (default: 4 x concurrency, >= 8)")
    one.add_argument("--duration", type=_positive(float), metavar="S", help="seconds per level instead of a count")


ARGS = (
    arg("target", nargs="?", metavar="URL|SPEC",
        help="an OpenAI-compatible server (http://HOST:PORT), or a spec file / name of a deployment that is up"),
    arg("--model", help="model to request (default: the endpoint's only model)"),
    arg("--api-key", help="default: $DEPLOYKIT_API_KEY, or the deployment's key variable"),
    arg("--concurrency", type=_levels, default=(1, 4, 16), metavar="1,4,16", help="concurrent streams, one level each"),
    _count_or_duration,
    arg("--prompt-tokens", type=_positive(int), default=256, metavar="P", help="prompt length in tokens (default 256)"),
    arg("--max-tokens", type=_positive(int), default=128, metavar="T", help="output tokens per request (default 128)"),
    arg("--chat", action="store_true", help="/v1/chat/completions (the prompt is the user message)"),
    arg("--seed", type=int, help="prompt seed (default: random, recorded in the JSON; the same seed reproduces them)"),
    arg("--warmup", type=int, default=2, metavar="N", help="requests sent before measuring (default 2)"),
    arg("--tokenizer", metavar="PATH", help="a local tokenizer.json (or its directory) when the server has no /tokenize"),
    arg("--no-ignore-eos", dest="ignore_eos", action="store_false",
        help="do not send ignore_eos (outputs may then end before --max-tokens)"),
    arg("--extra-body", type=_body, default={}, metavar="JSON", help="fields merged into every request"),
    arg("--timeout", type=_positive(float), default=600.0, metavar="S", help="seconds without data before a request "
                                                                             "fails (default 600)"),
    arg("--out", metavar="FILE.json", help="write every raw number, the settings and the server's identity"),
    arg("--plot", metavar="FILE.png", help="throughput and p99 TTFT against concurrency (needs deploykit[plot])"),
    arg("--compare", nargs="+", metavar="RESULT.json", help="print results of earlier runs side by side, with ratios "
                                                            "against the first"),
    arg("--sweep", action="store_true", help="SPEC: bring up each placement the planner can make here, measure it, "
                                             "tear it down, and mark the best"),
    arg("--runtime", choices=("local", "docker"), default="local", help="--sweep: how candidates run (default local)"),
    arg("--objective", choices=("throughput", "latency"), default="throughput", help="--sweep: what best means"),
    arg("--slo-ttft-ms", type=_positive(float), metavar="MS", help="--sweep: only candidates whose p99 TTFT stays "
                                                                   "within this qualify"),
    arg("--write-spec", metavar="FILE.yaml", help="--sweep: write the spec with the best placement"),
    arg("--budget", type=_positive(float), metavar="S", help="--sweep: stop starting candidates after S seconds"),
    arg("--up-timeout", type=_positive(float), default=900.0, metavar="S", help="--sweep: seconds a candidate may "
                                                                                 "take to become healthy"),
    arg("--state-dir", metavar="DIR", help="where deployments keep their state (as for deploykit up)"),
    arg("--no-progress", dest="progress", action="store_false", help="no live progress display"),
)


def _need_extras() -> None:
    import importlib.util
    for name in ("httpx", "httptools", "rich"):
        if importlib.util.find_spec(name) is None:
            raise TargetError(f"deploykit bench needs {name}", hint="pip install 'deploykit[bench]'")


def settings(args: argparse.Namespace):
    from .run import Settings
    return Settings(concurrency=args.concurrency, requests=args.requests, duration=args.duration,
                    prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, chat=args.chat,
                    seed=args.seed if args.seed is not None else random.SystemRandom().randrange(2**31),
                    warmup=max(0, args.warmup), model=args.model, tokenizer=args.tokenizer,
                    ignore_eos=args.ignore_eos, extra_body=args.extra_body, timeout=args.timeout)


def run(args: argparse.Namespace) -> int:
    _need_extras()
    if args.compare:
        return _compare(args)
    if args.target is None:
        raise TargetError("what should be benchmarked?", path="URL|SPEC",
                          hint="deploykit bench http://127.0.0.1:8000, deploykit bench SPEC [--sweep], or "
                               "deploykit bench --compare A.json B.json")
    if args.sweep:
        from .target import is_url
        if is_url(args.target):
            raise TargetError("--sweep brings deployments up from a spec, not a running server", path="URL|SPEC",
                              value=args.target, hint="deploykit bench SPEC --sweep")
        return _sweep(args)
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    from . import client, plot, report, target
    from .run import Partial, measure
    s = settings(args)
    t = target.resolve(args.target, args.state_dir, args.api_key)
    partial = Partial(s)
    interrupted = False
    try:
        with report.Progress(args.progress) as progress:
            doc = client.run(measure(t, s, partial, progress=progress))
    except KeyboardInterrupt:
        interrupted = True
        if not partial.server:
            return 130
        doc = partial.document(interrupted=True)
    report.show(doc)
    if args.out:
        report.write(doc, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        plot.write({doc["settings"]["model"]: plot.series(doc)}, args.plot, _title(doc))
        print(f"wrote {args.plot}")
    if interrupted:
        return 130
    if doc["levels"] and not any(lv["requests"] for lv in doc["levels"]):
        raise TargetError("every request failed (samples above)", path="URL", value=t.url,
                          hint="check --model, --api-key and the server's log")
    return 0


def _title(doc: dict) -> str:
    s = doc["settings"]
    return (f"{doc['server'].get('url', '')} · {s['model']} · {s['prompt_tokens']} → {s['max_tokens']} tokens · "
            f"{doc['client']['cpu_model']} ({doc['client']['isa_tier']})")


def sweep_title(spec: str, s) -> str:
    from pathlib import Path

    from .report import client_host
    host = client_host()
    return (f"placements of {Path(spec).name} · {s.prompt_tokens} → {s.max_tokens} tokens · {host['cpu_model']} "
            f"({host['isa_tier']}), {host['cpus_allowed']} CPUs")


def _compare(args: argparse.Namespace) -> int:
    from . import plot, report
    docs = [(path, report.load(path)) for path in args.compare]
    con = report.console()
    con.print(report.compare(docs))
    for line in report.differences(docs):
        con.print("  warning: " + line, markup=False)
    if args.plot:
        plot.write({path: plot.series(d) for path, d in docs}, args.plot, "compared")
        print(f"wrote {args.plot}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from . import plot, report
    from .sweep import Objective, best, document, sweep, table, write_spec
    s = settings(args)
    objective = Objective(args.objective, args.slo_ttft_ms)
    with report.Progress(args.progress) as progress:
        tried, notes, interrupted = sweep(args.target, s, runtime=args.runtime, state_dir=args.state_dir,
                                          objective=objective, budget=args.budget, up_timeout=args.up_timeout,
                                          progress=progress)
    con = report.console()
    con.print(table(tried, objective, s.concurrency))
    for line in notes:
        con.print("  " + line, markup=False)
    if interrupted:
        con.print("  interrupted: the table holds what was measured before Ctrl-C", markup=False)
    if args.out:
        report.write(document(tried, notes, objective, args.target, interrupted), args.out)
        print(f"wrote {args.out}")
    if args.plot:
        lines = {f"{t.candidate.label} ({t.candidate.shape()})": plot.series(t.doc) for t in tried if t.doc}
        plot.write(lines, args.plot, sweep_title(args.target, s))
        print(f"wrote {args.plot}")
    winner = best(tried)
    if args.write_spec:
        if winner is None:
            raise TargetError("no candidate qualifies, so no spec was written", path="--write-spec",
                              hint="see the table: failed candidates, errors, or an SLO nobody meets")
        print(write_spec(args.target, winner, objective, args.write_spec))
    return 130 if interrupted else 0
