"""A command-line tool as one table: each command's name, help, arguments and function, the argparse parser built
from it, and one mapping from the tool's error family to a message and an exit code.

`deploykit`, `python -m engine` and `python -m engine.kernels` are all built this way.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

Run = Callable[[argparse.Namespace], int]
AddArguments = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True, slots=True)
class Arg:
    flags: tuple[str, ...]
    options: dict = field(default_factory=dict)


def arg(*flags: str, **options) -> Arg:
    """One argparse argument: arg("--port", type=int, help=...)."""
    return Arg(flags, options)


@dataclass(frozen=True, slots=True)
class Command:
    name: str  # "plan", or "topology show" for a sub-command
    help: str
    args: tuple[Arg | AddArguments, ...]
    run: Run


class Tool:
    """`errors`: the tool's own error family; `describe(err)` is what it prints, `exit_code(err)` what it returns.
    Anything else escaping a command is a bug and keeps its traceback."""

    def __init__(self, prog: str, description: str, *, errors: type[Exception],
                 describe: Callable[[Exception], str], exit_code: Callable[[Exception], int],
                 version: str | None = None, setup: Callable[[], None] = lambda: None):
        self.prog, self.description, self.version = prog, description, version
        self.errors, self.describe, self.exit_code, self.setup = errors, describe, exit_code, setup
        self.commands: dict[str, Command] = {}
        self.groups: dict[str, str] = {}  # "topology" -> its help

    def group(self, name: str, help: str) -> None:
        self.groups[name] = help

    def command(self, name: str, help: str, *args: Arg | AddArguments) -> Callable[[Run], Run]:
        def register(fn: Run) -> Run:
            self.commands[name] = Command(name, help, args, fn)
            return fn
        return register

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=self.prog, description=self.description)
        if self.version:
            p.add_argument("--version", action="version", version=f"{self.prog} {self.version}")
        sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
        groups: dict[str, argparse._SubParsersAction] = {}
        for cmd in self.commands.values():
            head, _, tail = cmd.name.partition(" ")
            if tail:
                if head not in groups:
                    g = sub.add_parser(head, help=self.groups.get(head, ""))
                    groups[head] = g.add_subparsers(dest=f"{head}_command", metavar="ACTION", required=True)
                cp = groups[head].add_parser(tail, help=cmd.help)
            else:
                cp = sub.add_parser(head, help=cmd.help)
            for a in cmd.args:
                if isinstance(a, Arg):
                    cp.add_argument(*a.flags, **a.options)
                else:
                    a(cp)
            cp.set_defaults(run=cmd.run)
        return p

    def main(self, argv: list[str] | None = None) -> int:
        args = self.parser().parse_args(argv)
        self.setup()
        try:
            return args.run(args)
        except self.errors as e:
            print(self.describe(e), file=sys.stderr)
            return self.exit_code(e)
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            return 0
