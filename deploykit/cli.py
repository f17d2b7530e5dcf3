"""The `deploykit` command: one command table (deploykit.commands), and one exception -> exit-code table.

User mistakes (DeploykitError) print a clear message and exit with errors.EXIT_CODES; only bugs show tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .bench.command import ARGS as BENCH_ARGS  # argparse only: httpx, rich and matplotlib load when bench runs
from .commands import Tool, arg
from .errors import DeploykitError, exit_code
from .quant import ON_LOAD
from .runtime import RUNTIMES


def _describe(e: Exception) -> str:
    return f"deploykit: {e.kind}:\n" + "\n".join("  " + line for line in str(e).splitlines())


cli = Tool("deploykit", "NUMA-correct LLM inference deployments on CPUs.", errors=DeploykitError,
           describe=_describe, exit_code=exit_code, version=__version__)
cli.group("topology", "inspect this host or a snapshot")
SPEC = arg("spec", help="the deployment spec (YAML)")
SYSROOT = arg("--sysroot", metavar="DIR", help="plan for a snapshot instead of the spec's hardware")


def load_plan(spec_path: str, sysroot: str | None, quantization: str | None = None):
    """spec file -> (Spec, Topology, Plan): the one pipeline every command uses. quantization: overrides
    model.quantization (deploykit serve --quantization), before planning so memory is sized for it."""
    from . import hardware, memory, planner, specfile
    spec = specfile.load(spec_path)
    if quantization is not None:
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"quantization": quantization})})
    topo = hardware.resolve(spec, sysroot)
    return spec, topo, planner.make_plan(spec, topo, memory.shape(spec.model))


@cli.command("validate", "check a spec file", SPEC)
def _validate(args: argparse.Namespace) -> int:
    from . import specfile
    spec = specfile.load(args.spec)
    print(f"{args.spec}: valid deploykit/v1 Deployment '{spec.name}'")
    return 0


@cli.command("plan", "show where every replica, thread and byte goes", SPEC, SYSROOT,
             arg("--format", choices=("table", "json"), default="table"))
def _plan(args: argparse.Namespace) -> int:
    from . import report
    _, topo, plan = load_plan(args.spec, args.sysroot)
    sys.stdout.write(plan.to_json() if args.format == "json" else report.plan_text(plan, topo))
    return 0


@cli.command("topology show", "sockets, NUMA nodes, cores and SMT siblings, cpuset, ISA",
             arg("--sysroot", metavar="DIR"), arg("--format", choices=("text", "json"), default="text"))
def _topology_show(args: argparse.Namespace) -> int:
    from . import report, topology
    topo = topology.read(args.sysroot or "/")
    if args.format == "json":
        print(json.dumps(topo.to_dict(), indent=2, sort_keys=True))
    else:
        sys.stdout.write(report.topology_text(topo))
    return 0


@cli.command("topology snapshot", "copy the files topology reads into DIR (for --sysroot elsewhere)", arg("dir"),
             arg("--sysroot", metavar="DIR", help=argparse.SUPPRESS),
             arg("--force", action="store_true", help="write into a non-empty directory"))
def _topology_snapshot(args: argparse.Namespace) -> int:
    from . import snapshot
    files = snapshot.take(args.dir, args.sysroot or "/", force=args.force)
    print(f"wrote {len(files)} files to {args.dir}; plan against it with --sysroot {args.dir}")
    return 0


@cli.command("render", "write the Dockerfile, run.sh, compose.yaml... for a spec", SPEC,
             arg("-o", "--out", required=True, metavar="DIR", help="output directory (new, empty, or ours)"),
             arg("--target", action="append", metavar="TARGET",
                 help="docker, compose, helm, manifests or all (repeatable; default: the spec's targets)"),
             SYSROOT,
             arg("--force", action="store_true", help="write into a directory deploykit did not write, overwriting "
                                                     "files it did not write or that were edited"),
             arg("--check", action="store_true", help="write nothing; exit 0 if DIR holds exactly what would be "
                                                     "rendered, else print a unified diff and exit 8 (GitOps CI)"))
def _render(args: argparse.Namespace) -> int:
    from . import render
    from .errors import OutputError, did_you_mean
    from .render import output
    for t in args.target or ():
        if t not in (*render.TARGETS, "all"):
            raise OutputError("unknown render target", path="--target", value=t,
                              allowed=", ".join((*render.TARGETS, "all")), hint=did_you_mean(t, render.TARGETS))
    _, _, plan = load_plan(args.spec, args.sysroot)
    targets = list(args.target or plan.targets)
    if "all" in targets:
        targets = list(render.TARGETS)
    if not args.target and not args.check:
        # The spec's own targets: one whose optional dependency is missing is skipped with one line naming the
        # extra, so a first render works on a minimal install. Asked for by --target (or --check, which must
        # compare everything), it is an error instead.
        for t in list(targets):
            if (why := render.unavailable(t)) is not None:
                targets.remove(t)
                p = why.problems[0]
                print(f"warning: skipped the spec's target {t}: {p.message.removeprefix('--target ')}; "
                      f"to render it: {p.hint}", file=sys.stderr)
    if not targets:
        raise OutputError("nothing to render", value=list(plan.targets), allowed=", ".join(render.TARGETS),
                          hint="pass --target")
    files = render.render(plan, targets)
    if args.check:
        return _check(args.out, files, args.spec)
    done = output.write(args.out, files, force=args.force)
    print(f"rendered {', '.join(targets)} into {done.directory}: {len(done.written)} written, "
          f"{len(done.unchanged)} unchanged, {len(done.removed)} removed")
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


def _check(out: str, files, spec: str) -> int:
    from .errors import OutOfDate
    from .render import output
    diffs = output.drift(out, files)
    if not diffs:
        print(f"{out}: up to date ({len(files) + 1} files)")
        return 0
    sys.stdout.write("".join(diffs))
    raise OutOfDate(f"differs from what {spec} renders in {len(diffs)} file(s) (diff above)", path=out,
                    hint=f"deploykit render {spec} -o {out} (and commit the result)")


@cli.command("serve", "run a replica of the plan on this host with the bundled engine (no Docker)", SPEC,
             arg("--replica", type=int, default=0, help="which replica of the plan (default 0)"),
             arg("--host", help="listen address (default: serving.publish_address)"),
             arg("--port", type=int, help="listen port (default: the replica's port; 0 = any free port)"),
             arg("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                 help="reuse the KV cache of prompt prefixes seen before (default: serving.prefix_caching)"),
             arg("--quantization", choices=ON_LOAD,
                 help="override model.quantization (what the engine holds quantized; see the spec reference)"))
def _serve(args: argparse.Namespace) -> int:
    """Run one replica of the plan on this host without Docker, with the plan handed to the engine as an object
    (the containers' entry point reads the same plan from plan.json)."""
    from .errors import ModelError, PlanError, RuntimeFailure
    spec, _, plan = load_plan(args.spec, None, args.quantization)
    if spec.hardware != "auto":
        raise PlanError("deploykit serve runs the plan on this host, but the spec describes other hardware",
                        path="hardware", value="sysroot" if hasattr(spec.hardware, "sysroot") else "inline",
                        allowed="auto", hint="use hardware: auto (or render the spec and run it on that machine)")
    if not 0 <= args.replica < len(plan.replicas):
        raise PlanError(f"the plan has {len(plan.replicas)} replica(s)", path="--replica", value=args.replica,
                        allowed=f"0-{len(plan.replicas) - 1}")
    if plan.model.path is None:
        raise ModelError("deploykit serve needs the model on this machine", path="model.source",
                         value=plan.model.source, hint="point model.source at a local model directory or .gguf file")
    try:  # the one place deploykit imports the engine
        from engine.errors import EngineError
        from engine.server import launch
    except ImportError as e:
        raise ModelError(f"the bundled engine is not installed ({e.name} is missing)",
                         hint="pip install 'deploykit[engine]'") from None
    replica = plan.replicas[args.replica]
    host = (args.host or plan.serving.publish_address).strip("[]")  # Docker writes IPv6 as [::]; bind() does not
    try:
        options = launch.options(plan.model.path, plan=plan, replica=args.replica, host=host,
                                 port=replica.port if args.port is None else args.port,
                                 prefix_caching=args.prefix_caching)
    except EngineError as e:
        raise PlanError(str(e)) from None
    if len(plan.replicas) > 1:
        print(f"deploykit: serving replica {args.replica} of {len(plan.replicas)} on port {options.port}; start the "
              "others with --replica, or use the rendered compose.yaml for all of them behind nginx", file=sys.stderr)
    code = launch.serve(options)
    if code:
        raise RuntimeFailure(f"the engine server stopped with exit code {code}", hint="see the log lines above")
    return 0


@cli.command("doctor", "say why inference is slow here: this host, a spec's plan on it, or a running process",
             arg("spec", nargs="?", help="also check that this spec's plan fits the host"),
             arg("--sysroot", metavar="DIR", help="examine a snapshot (`topology snapshot`) instead of this host"),
             arg("--pid", type=int, help="examine a running process and its children (vLLM, llama.cpp, Ollama...)"),
             arg("--url", help="examine a running deploykit server, driving a short generation while sampling"),
             arg("--container", metavar="NAME", help="examine a Docker container (its processes, seccomp, cpuset)"),
             arg("--seconds", type=float, default=2.0, help="how long to sample threads (default 2)"),
             arg("--api-key", help="for --url (default: $DEPLOYKIT_API_KEY)"),
             arg("--format", choices=("text", "json"), default="text"),
             arg("-v", "--verbose", action="store_true", help="show the evidence of passing checks too"),
             arg("--write-seccomp", metavar="DIR", help="write deploykit's least-privilege seccomp profiles "
                                                        "(Docker and OCI form) into DIR, the fix for refused NUMA calls"))
def _doctor(args: argparse.Namespace) -> int:
    from .doctor import command
    return command.run(args)


RUNTIME = arg("--runtime", choices=RUNTIMES, default=None,
              help="docker (the Docker Engine API) or local (processes); default: the deployment's own runtime, else "
                   "Docker when it answers, else local")
STATE_DIR = arg("--state-dir", metavar="DIR", help="where deployments keep their rendered files, state and logs "
                                                   "(default $DEPLOYKIT_STATE_DIR, else ~/.local/state/deploykit)")
TARGET = arg("target", nargs="?", metavar="SPEC|NAME", help="a spec file or a deployment name (default: the only "
                                                            "deployment that is up)")


@cli.command("up", "start (or update) a deployment and wait until it is healthy", SPEC, RUNTIME, STATE_DIR,
             arg("--timeout", type=float, default=900, metavar="SECONDS",
                 help="how long replicas may take to become healthy (default 900)"),
             arg("--keep-on-failure", action="store_true", help="leave a failed deployment as it is, to inspect it"))
def _up(args: argparse.Namespace) -> int:
    from .runtime import lifecycle
    _, _, plan = load_plan(args.spec, None)
    return lifecycle.up(plan, args.spec, runtime=args.runtime or "auto", state_dir=args.state_dir,
                        timeout=args.timeout, keep_on_failure=args.keep_on_failure)


@cli.command("down", "stop and remove a deployment's containers or processes (and its network)", TARGET, RUNTIME,
             STATE_DIR, arg("--volumes", action="store_true", help="also remove its volumes and state directory"))
def _down(args: argparse.Namespace) -> int:
    from .runtime import lifecycle
    return lifecycle.down(args.target, runtime=args.runtime, state_dir=args.state_dir, volumes=args.volumes)


@cli.command("status", "per replica: state, health, planned vs engine CPUs and NUMA nodes, load, tokens/s", TARGET,
             RUNTIME, STATE_DIR, arg("--format", choices=("table", "json"), default="table"),
             arg("--interval", type=float, default=1.0, metavar="SECONDS", help="tokens/s sampling window"))
def _status(args: argparse.Namespace) -> int:
    from .runtime import lifecycle
    return lifecycle.status(args.target, runtime=args.runtime, state_dir=args.state_dir, fmt=args.format,
                            interval=args.interval)


@cli.command("logs", "show a deployment's logs (every replica, or one)", TARGET,
             arg("replica", nargs="?", help="replica index, 'lb', or a member name"), RUNTIME, STATE_DIR,
             arg("-f", "--follow", action="store_true"), arg("--tail", type=int, metavar="N", help="last N lines"))
def _logs(args: argparse.Namespace) -> int:
    from .runtime import lifecycle
    return lifecycle.logs(args.target, args.replica, runtime=args.runtime, state_dir=args.state_dir,
                          follow=args.follow, tail=args.tail)


@cli.command("bench", "load-test an OpenAI-compatible endpoint or a deployment (TTFT, inter-token latency, "
                      "throughput per concurrency); --sweep measures a spec's placements", *BENCH_ARGS)
def _bench(args: argparse.Namespace) -> int:
    from .bench import command
    return command.run(args)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
