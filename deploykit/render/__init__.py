"""Render targets: one table from target name to the function turning a Plan into files, plus the shared templates.

Adding a target (helm, manifests) is one entry in TARGETS. Renderers see only the Plan.
"""

from __future__ import annotations

import json
import shlex
from importlib import resources
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path

import jinja2

from .. import __version__
from ..plan import Plan
from .output import File


@cache
def _env() -> jinja2.Environment:
    # render/templates: run.sh, compose, nginx, NOTES; images/ (deploykit.images): the engine image's files.
    loader = jinja2.ChoiceLoader([jinja2.PackageLoader("deploykit.render", "templates"),
                                  jinja2.FileSystemLoader(str(_images_dir()))])
    env = jinja2.Environment(loader=loader,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True, autoescape=False)
    env.filters["sh"] = lambda v: shlex.quote(str(v))
    env.filters["dq"] = dq
    env.filters["json"] = lambda v: json.dumps(v)  # not jinja's tojson: that HTML-escapes quotes
    return env


def _images_dir() -> Path:
    """Installed: the deploykit.images package; a plain checkout on PYTHONPATH: <repo>/images."""
    try:
        return Path(str(resources.files("deploykit.images")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "images"


def dq(text: object) -> str:
    """Escape for use inside a double-quoted shell word ("...$VAR..." stays expandable where we want it)."""
    return "".join("\\" + ch if ch in '"$`\\' else ch for ch in str(text))


def template(name: str, **context: object) -> str:
    return _env().get_template(name).render(version=__version__, **context)


from . import compose, docker  # noqa: E402 - they use template() above

TARGETS: dict[str, Callable[[Plan], list[File]]] = {
    "docker": docker.files,
    "compose": compose.files,
}


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
                    model_dir=docker.MODEL_DIR, seccomp=plan.security.seccomp)
    files["NOTES.txt"] = File("NOTES.txt", text.encode())
    return tuple(files[p] for p in sorted(files))
