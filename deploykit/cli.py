"""The `deploykit` command: argument parsing, one command table, and one exception -> exit-code table.

User mistakes (DeploykitError) print a clear message and exit with errors.EXIT_CODES; only bugs show tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from . import __version__
from .errors import DeploykitError, exit_code

Command = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, Command] = {}


def command(name: str) -> Callable[[Command], Command]:
    def register(fn: Command) -> Command:
        COMMANDS[name] = fn
        return fn
    return register


def load_plan(spec_path: str, sysroot: str | None):
    """spec file -> (Spec, Topology, Plan): the one pipeline every command uses."""
    from . import hardware, memory, planner, specfile
    spec = specfile.load(spec_path)
    topo = hardware.resolve(spec, sysroot)
    return spec, topo, planner.make_plan(spec, topo, memory.shape(spec.model))


@command("validate")
def _validate(args: argparse.Namespace) -> int:
    from . import specfile
    spec = specfile.load(args.spec)
    print(f"{args.spec}: valid deploykit/v1 Deployment '{spec.name}'")
    return 0


@command("plan")
def _plan(args: argparse.Namespace) -> int:
    from . import report
    _, topo, plan = load_plan(args.spec, args.sysroot)
    sys.stdout.write(plan.to_json() if args.format == "json" else report.plan_text(plan, topo))
    return 0


@command("topology show")
def _topology_show(args: argparse.Namespace) -> int:
    from . import report, topology
    topo = topology.read(args.sysroot or "/")
    if args.format == "json":
        from dataclasses import asdict
        print(json.dumps({**asdict(topo), "isa_tier": topo.isa_tier}, indent=2, sort_keys=True))
    else:
        sys.stdout.write(report.topology_text(topo))
    return 0


@command("topology snapshot")
def _topology_snapshot(args: argparse.Namespace) -> int:
    from . import snapshot
    files = snapshot.take(args.dir, args.sysroot or "/", force=args.force)
    print(f"wrote {len(files)} files to {args.dir}; plan against it with --sysroot {args.dir}")
    return 0


@command("render")
def _render(args: argparse.Namespace) -> int:
    from . import render
    from .render import output
    from .errors import OutputError, did_you_mean
    for t in args.target or ():
        if t not in (*render.TARGETS, "all"):
            raise OutputError("unknown render target", path="--target", value=t,
                              allowed=", ".join((*render.TARGETS, "all")), hint=did_you_mean(t, render.TARGETS))
    _, _, plan = load_plan(args.spec, args.sysroot)
    targets = list(args.target or plan.targets)
    if "all" in targets:
        targets = list(render.TARGETS)
    for t in [t for t in targets if t not in render.TARGETS]:  # only spec targets can get here
        print(f"deploykit: target {t!r} from the spec's targets is not implemented yet; skipped", file=sys.stderr)
    targets = [t for t in targets if t in render.TARGETS]
    if not targets:
        raise OutputError("nothing to render", value=list(plan.targets), allowed=", ".join(render.TARGETS),
                          hint="pass --target")
    done = output.write(args.out, render.render(plan, targets), force=args.force)
    print(f"rendered {', '.join(targets)} into {done.directory}: {len(done.written)} written, "
          f"{len(done.unchanged)} unchanged, {len(done.removed)} removed")
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


@command("serve")
def _serve(args: argparse.Namespace) -> int:
    """Run one replica of the plan on this host without Docker, through the same entry point the containers use
    (`python -m engine serve MODEL --plan plan.json --replica N`)."""
    import tempfile

    from .errors import ModelError, PlanError, RuntimeFailure
    spec, _, plan = load_plan(args.spec, None)
    if spec.hardware != "auto":
        raise PlanError("deploykit serve runs the plan on this host, but the spec describes other hardware",
                        path="hardware", value="sysroot" if hasattr(spec.hardware, "sysroot") else "inline",
                        allowed="auto", hint="use hardware: auto (or render the spec and run it on that machine)")
    if not 0 <= args.replica < len(plan.replicas):
        raise PlanError(f"the plan has {len(plan.replicas)} replica(s)", path="--replica", value=args.replica,
                        allowed=f"0-{len(plan.replicas) - 1}")
    if plan.model.path is None:
        raise ModelError("deploykit serve needs the model on this machine", path="model.source",
                         value=plan.model.source, hint="point model.source at a local model directory")
    try:
        from engine.server import launch
    except ImportError as e:
        raise ModelError(f"the bundled engine is not installed ({e.name} is missing)",
                         hint="pip install 'deploykit[engine]'") from None
    replica = plan.replicas[args.replica]
    host = (args.host or plan.serving.publish_address).strip("[]")  # Docker writes IPv6 as [::]; bind() does not
    port = replica.port if args.port is None else args.port
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="deploykit-plan-") as f:
        f.write(plan.to_json())
        f.flush()
        p = argparse.ArgumentParser()
        launch.add_arguments(p)
        ns = p.parse_args([plan.model.path, "--plan", f.name, "--replica", str(args.replica), "--host", host,
                           "--port", str(port)])
        if len(plan.replicas) > 1:
            print(f"deploykit: serving replica {args.replica} of {len(plan.replicas)} on port {port}; start the others "
                  "with --replica, or use the rendered compose.yaml for all of them behind nginx", file=sys.stderr)
        code = launch.run_args(ns)
    if code:
        raise RuntimeFailure(f"the engine server stopped with exit code {code}", hint="see the log lines above")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deploykit", description="NUMA-correct LLM inference deployments on CPUs.")
    p.add_argument("--version", action="version", version=f"deploykit {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    v = sub.add_parser("validate", help="check a spec file")
    v.add_argument("spec")

    pl = sub.add_parser("plan", help="show where every replica, thread and byte goes")
    pl.add_argument("spec")
    pl.add_argument("--sysroot", metavar="DIR", help="plan for a snapshot instead of the spec's hardware")
    pl.add_argument("--format", choices=("table", "json"), default="table")

    r = sub.add_parser("render", help="write the Dockerfile, run.sh, compose.yaml... for a spec")
    r.add_argument("spec")
    r.add_argument("-o", "--out", required=True, metavar="DIR", help="output directory (new, empty, or ours)")
    r.add_argument("--target", action="append", metavar="TARGET",
                   help="docker, compose or all (repeatable; default: the spec's targets)")
    r.add_argument("--sysroot", metavar="DIR", help="plan for a snapshot instead of the spec's hardware")
    r.add_argument("--force", action="store_true", help="write into a directory deploykit did not write, "
                                                        "overwriting files it did not write or that were edited")

    sv = sub.add_parser("serve", help="run a replica of the plan on this host with the bundled engine (no Docker)")
    sv.add_argument("spec")
    sv.add_argument("--replica", type=int, default=0, help="which replica of the plan (default 0)")
    sv.add_argument("--host", help="listen address (default: serving.publish_address)")
    sv.add_argument("--port", type=int, help="listen port (default: the replica's port; 0 = any free port)")

    t = sub.add_parser("topology", help="inspect this host or a snapshot")
    tsub = t.add_subparsers(dest="topology_command", metavar="ACTION", required=True)
    ts = tsub.add_parser("show", help="sockets, NUMA nodes, cores and SMT siblings, cpuset, ISA")
    ts.add_argument("--sysroot", metavar="DIR")
    ts.add_argument("--format", choices=("text", "json"), default="text")
    tn = tsub.add_parser("snapshot", help="copy the files topology reads into DIR (for --sysroot elsewhere)")
    tn.add_argument("dir")
    tn.add_argument("--sysroot", metavar="DIR", help=argparse.SUPPRESS)
    tn.add_argument("--force", action="store_true", help="write into a non-empty directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    name = args.command + (f" {args.topology_command}" if args.command == "topology" else "")
    try:
        return COMMANDS[name](args)
    except DeploykitError as e:
        print(f"deploykit: {e.kind}:\n" + "\n".join("  " + line for line in str(e).splitlines()), file=sys.stderr)
        return exit_code(e)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
