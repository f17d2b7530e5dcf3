"""`deploykit doctor`: pick what to examine from the arguments, build the Report, print it, and turn a ✖ into
the Unhealthy exit code (errors.EXIT_CODES)."""

from __future__ import annotations

import argparse
import os
import sys

from .. import hostsettings, isa, topology
from ..errors import TargetError, Unhealthy
from . import checks, fixes, planfit, report
from .findings import Report


def run(args: argparse.Namespace) -> int:
    targets = [flag for flag, value in (("--pid", args.pid), ("--url", args.url), ("--container", args.container))
               if value is not None]
    if len(targets) > 1:
        raise TargetError("one target at a time", path=" ".join(targets), allowed="--pid, --url or --container",
                          hint="run doctor once per target")
    if targets and (args.spec or args.sysroot):
        raise TargetError(f"{targets[0]} examines a running process; SPEC and --sysroot belong to the host check",
                          path=targets[0], hint="run `deploykit doctor [--sysroot DIR] [SPEC]` separately")
    if args.seconds <= 0 or args.seconds > 600:
        raise TargetError("sampling window out of range", path="--seconds", value=args.seconds, allowed="0-600")
    if args.write_seccomp:
        for path in fixes.write_seccomp(args.write_seccomp):
            print(f"wrote {path}", file=sys.stderr)
        if not targets and not args.spec and not args.sysroot:
            return 0
    if args.pid is not None:
        from . import process_target
        rep = process_target.examine_pid(args.pid, args.seconds)
    elif args.url is not None:
        from . import url_target
        rep = url_target.examine(args.url, args.seconds, args.api_key or os.environ.get("DEPLOYKIT_API_KEY"))
    elif args.container is not None:
        from . import container_target
        rep = container_target.examine(args.container, args.seconds)
    else:
        rep = examine_host(args.sysroot, args.spec)
    sys.stdout.write(report.as_json(rep) if args.format == "json" else report.text(rep, verbose=args.verbose))
    sys.stdout.flush()
    if rep.critical:
        raise Unhealthy(f"{len(rep.critical)} critical problem(s): " + "; ".join(f.id for f in rep.critical),
                        hint="see the ✖ lines of the report for the evidence and the fix")
    return 0


def examine_host(sysroot: str | None, spec: str | None) -> Report:
    with topology.opened(sysroot or "/") as root:
        topo = topology.read(root)
        settings = hostsettings.read(root)
        flags = isa.cpu_flags(root / "proc" / "cpuinfo")
    sections = checks.host(topo, settings, flags)
    if spec:
        sections.append(planfit.check(spec, topo))
    where = f"snapshot {sysroot}" if sysroot else "this host (live)"
    return Report(f"{where}: {topo.cpu_model or 'CPU model unknown'}", tuple(sections))
