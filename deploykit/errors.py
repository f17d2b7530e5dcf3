"""User-facing errors: each names where (field path), what (bad value), what is allowed and the fix.

The CLI maps every subclass to one exit code (EXIT_CODES) and prints `str(err)`; user mistakes never
produce a traceback. Library code raises these and nothing else for bad input.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

_UNSET = object()


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with the input. `path` is dotted with [i] for list items, e.g. `placement.threads`."""

    message: str
    path: str = ""
    value: object = _UNSET
    allowed: str = ""
    hint: str = ""

    def render(self) -> str:
        head = f"{self.path}: {self.message}" if self.path else self.message
        lines = [head]
        if self.value is not _UNSET:
            lines.append(f"  got: {_show(self.value)}")
        if self.allowed:
            lines.append(f"  allowed: {self.allowed}")
        if self.hint:
            lines.append(f"  fix: {self.hint}")
        return "\n".join(lines)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class DeploykitError(Exception):
    """Base class. `problems` holds one or more Problems; str() renders all of them."""

    kind = "error"

    def __init__(self, message: str = "", *, path: str = "", value: object = _UNSET,
                 allowed: str = "", hint: str = "", problems: Iterable[Problem] = ()):
        probs = list(problems)
        if message:
            probs.insert(0, Problem(message, path, value, allowed, hint))
        self.problems: tuple[Problem, ...] = tuple(probs)
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return "\n".join(p.render() for p in self.problems)


class SpecError(DeploykitError):
    """The spec file is unreadable, not YAML, or does not validate."""

    kind = "invalid spec"


class TopologyError(DeploykitError):
    """The host (or --sysroot snapshot) cannot be read or makes no sense."""

    kind = "topology"


class ModelError(DeploykitError):
    """Model files are missing, unreadable, or describe something we cannot size or run."""

    kind = "model"


class PlanError(DeploykitError):
    """The spec is valid but cannot be placed on this hardware (CPUs or memory do not fit)."""

    kind = "placement"


class OutputError(DeploykitError):
    """Rendering or writing output failed (existing directory, unwritable path...)."""

    kind = "output"


class RuntimeFailure(DeploykitError):
    """An external runtime (Docker, Kubernetes, the engine process) refused or failed."""

    kind = "runtime"


class OutOfDate(DeploykitError):
    """`render --check`: the directory does not hold exactly what the spec renders (GitOps drift)."""

    kind = "out of date"


class Unhealthy(DeploykitError):
    """`deploykit doctor` found something critical (a ✖ line); the report itself went to stdout."""

    kind = "doctor"


class TargetError(DeploykitError):
    """The process, server, container or endpoint `deploykit doctor` or `deploykit bench` was pointed at does not
    exist or cannot be read (or, for bench, failed every request)."""

    kind = "target"


# One table, used by the CLI. 1 is left for unexpected bugs (those do print a traceback).
EXIT_CODES: dict[type[DeploykitError], int] = {
    SpecError: 2,
    TopologyError: 3,
    ModelError: 4,
    PlanError: 5,
    OutputError: 6,
    RuntimeFailure: 7,
    OutOfDate: 8,
    Unhealthy: 9,
    TargetError: 10,
}


def exit_code(err: DeploykitError) -> int:
    for cls in type(err).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'did you mean `numa_nodes`?' or '' when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean `{match[0]}`?" if match else ""
