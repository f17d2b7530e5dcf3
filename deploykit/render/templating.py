"""The shared jinja2 environment (StrictUndefined) for every rendered text file, and its shell-quoting filters."""

from __future__ import annotations

import json
import shlex
from functools import cache
from importlib import resources
from pathlib import Path

import jinja2

from .. import __version__


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
