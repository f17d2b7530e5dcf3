"""Render targets: one table from target name to the function turning a Plan into files.

Adding a target is one entry in TARGETS. Renderers see only the Plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..errors import OutputError
from ..plan import Plan
from . import compose, container, docker, helm, manifests
from .output import File
from .templating import template

TARGETS: dict[str, Callable[[Plan], list[File]]] = {
    "docker": docker.files,
    "compose": compose.files,
    "helm": helm.files,
    "manifests": manifests.files,
}

# Targets whose renderer needs an optional dependency: target -> why it cannot render here (None: it can).
REQUIRES: dict[str, Callable[[], OutputError | None]] = {"manifests": manifests.missing}


def unavailable(target: str) -> OutputError | None:
    """Why `target` cannot render on this install (its optional dependency is missing), or None."""
    check = REQUIRES.get(target)
    return check() if check else None


def render(plan: Plan, targets: Iterable[str]) -> tuple[File, ...]:
    """Every file of the chosen targets, deduplicated (targets share the image files), sorted by path."""
    chosen = tuple(dict.fromkeys(targets))
    files: dict[str, File] = {}
    for name in chosen:
        for f in TARGETS[name](plan):
            if f.path in files and files[f.path] != f:
                raise AssertionError(f"targets disagree about {f.path}")
            files[f.path] = f
    text = template("NOTES.txt.j2", plan=plan, targets=chosen, files=sorted(files), lb=plan.serving.load_balancer,
                    model=container.model_mount(plan), seccomp=plan.security.seccomp)
    files["NOTES.txt"] = File("NOTES.txt", text.encode())
    return tuple(files[p] for p in sorted(files))
