"""The shared jinja2 environment (StrictUndefined) for every rendered text file, and its shell-quoting filters."""

from __future__ import annotations

import json
import shlex
import importlib.util
from functools import cache
from pathlib import Path

import jinja2

from .. import __version__, cpulist


@cache
def _env() -> jinja2.Environment:
    # render/templates: run.sh, compose, nginx, NOTES; images/ (deploykit.images): the engine image's files.
    loader = jinja2.ChoiceLoader([jinja2.PackageLoader("deploykit.render", "templates"),
                                  jinja2.FileSystemLoader(str(package_dir("deploykit.images", "images")))])
    env = jinja2.Environment(loader=loader,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
                             lstrip_blocks=True, autoescape=False)
    env.filters["sh"] = lambda v: shlex.quote(str(v))
    env.filters["dq"] = dq
    env.filters["json"] = lambda v: json.dumps(v)  # not jinja's tojson: that HTML-escapes quotes
    env.filters["cpulist"] = cpulist.format  # (0, 1, 2, 8) -> 0-2,8
    return env


def package_dir(package: str, checkout: str) -> Path:
    """The real directory of a data package shipped inside deploykit (deploykit.images, deploykit.chart): where it is
    installed (a wheel, or an editable install's mapping), else <repo>/<checkout> for a plain checkout on PYTHONPATH.
    Not importlib.resources.files: for a package without __init__.py (the chart) that is a MultiplexedPath, whose
    str() is no path, and Helm's engine and jinja2 need one."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / checkout


def dq(text: object) -> str:
    """Escape for use inside a double-quoted shell word ("...$VAR..." stays expandable where we want it)."""
    return "".join("\\" + ch if ch in '"$`\\' else ch for ch in str(text))


def template(name: str, **context: object) -> str:
    return _env().get_template(name).render(version=__version__, **context)
