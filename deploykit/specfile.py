"""Read a spec file: YAML (strict: no duplicate keys) -> Spec, with every failure turned into a SpecError.

Each problem names the field path, the bad value, what is allowed and a did-you-mean for misspelt keys.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .errors import Problem, SpecError, did_you_mean
from .modelfiles import HF_ID
from .spec import Spec

# Discriminator tags pydantic puts into error paths, right after the union field they belong to.
_TAGS = {"hardware": {"auto", "sysroot", "inline"}, "api_key": {"env", "secret"}}


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a plain value",
                                                    key_node.start_mark) from None
        if key in out:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def parse_yaml(text: str, source: str = "<spec>") -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise SpecError(f"not valid YAML: {e.problem or e.context}", path=where,
                        hint="check indentation and quoting at that line") from None
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError) as e:
        raise SpecError(f"not valid YAML: {type(e).__name__}: {e}"[:300], path=source) from None


def load(path: str | Path) -> Spec:
    """Read and validate a spec file. Relative paths inside (model.source, hardware.sysroot, image.wheelhouse)
    are resolved against the file's directory."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("spec file not found", path=str(p), hint="check the path") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read spec file: {e}", path=str(p)) from None
    spec = from_data(parse_yaml(text, str(p)))
    return resolve_paths(spec, p.parent)


def from_data(data: Any) -> Spec:
    if not isinstance(data, dict):
        raise SpecError("the spec must be a YAML mapping with apiVersion, kind, name and model",
                        value=data if data is None or isinstance(data, (str, int, float, list)) else type(data).__name__,
                        hint="start from one of the files in examples/")
    try:
        return Spec.model_validate(data)
    except ValidationError as e:
        raise SpecError(problems=_problems(e)) from None
    except RecursionError:
        raise SpecError("the spec nests too deeply (a recursive YAML alias?)") from None


def resolve_paths(spec: Spec, base: Path) -> Spec:
    def fix(p: str) -> str:
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (base / q).resolve())

    updates: dict[str, Any] = {}
    src = spec.model.source
    # A hub id ("org/name") stays an id unless a directory of that name sits next to the spec; any other
    # relative source is a path relative to the spec file, never to the current directory.
    if not HF_ID.match(src) or (base / src).exists():
        updates["model"] = spec.model.model_copy(update={"source": fix(src)})
    if not isinstance(spec.hardware, str) and hasattr(spec.hardware, "sysroot"):
        updates["hardware"] = spec.hardware.model_copy(update={"sysroot": fix(spec.hardware.sysroot)})
    if spec.image.wheelhouse:
        updates["image"] = spec.image.model_copy(update={"wheelhouse": fix(spec.image.wheelhouse)})
    return spec.model_copy(update=updates) if updates else spec


def _problems(err: ValidationError) -> list[Problem]:
    raw = err.errors(include_url=False)
    paths = [_path(e["loc"]) for e in raw]
    misspelt: set[str] = set()
    out: list[Problem] = []
    for e, path in zip(raw, paths):
        if e["type"] == "extra_forbidden":
            parent, _, key = path.rpartition(".")
            key = key.split("[")[0]
            fields = _fields_at(e["loc"][:-1])
            hint = did_you_mean(key, fields)
            if hint:
                misspelt.add(f"{parent}.{hint.split('`')[1]}" if parent else hint.split("`")[1])
            out.append(Problem(f"unknown key `{key}`", path, allowed=", ".join(sorted(fields)),
                               hint=hint or "remove it"))
    for e, path in zip(raw, paths):
        kind = e["type"]
        if kind == "extra_forbidden" or (kind == "missing" and path in misspelt):
            continue
        if kind == "too_short" and any(q != path and q.startswith(path) for q in paths):
            continue  # an item failed, so the list looks empty "after validation"; the item's error says why
        value = e.get("input")
        if path == "serving.api_key" and isinstance(value, str):
            value = "<hidden>"  # somebody pasted the key itself: never echo it
        msg = e["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if kind == "missing":
            out.append(Problem("required field is missing", path, hint=f"add `{path.rsplit('.', 1)[-1]}`"))
        elif kind in ("literal_error", "enum"):
            choices = [c.strip(" '") for c in e["ctx"]["expected"].replace(" or ", ", ").split(",")]
            hint = did_you_mean(value, choices) if isinstance(value, str) else ""
            out.append(Problem("not one of the allowed values", path, value, allowed=e["ctx"]["expected"],
                               hint=hint))
        elif kind == "hardware_form":
            hint = did_you_mean(value, ["auto"]) if isinstance(value, str) else ""
            out.append(Problem(msg, path, value, allowed="auto | {sysroot: DIR} | {numa_nodes: [...], ...}",
                               hint=hint or "write `hardware: auto` to plan for this host"))
        else:
            out.append(Problem(msg[:1].lower() + msg[1:] if msg[1:2].islower() else msg, path, value))
    return out


def _path(loc: tuple) -> str:
    s = ""
    prev = None
    for part in loc:
        if isinstance(part, int):
            s += f"[{part}]"
        elif part in _TAGS.get(prev, ()) or part.startswith(("function-", "literal[", "tagged-union[")):
            prev = None
            continue
        else:
            s += f".{part}" if s else str(part)
        prev = part
    return s


def _fields_at(loc: tuple) -> list[str]:
    """Field names of the model found by walking `loc` from Spec; [] when the walk leaves the models."""
    model: Any = Spec
    prev = None
    for part in loc:
        if isinstance(part, int) or part in _TAGS.get(prev, ()):
            if not isinstance(part, int):
                model = _tagged(model, part)
            prev = None
            continue
        prev = part
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return []
        model = _inner(model.model_fields[part].annotation)
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _inner(annotation: Any) -> Any:
    """Unwrap Optional/tuple/Annotated to the model class inside, or a union to pick from by tag later."""
    for _ in range(6):
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (tuple, list):
            annotation = typing.get_args(annotation)[0]
        elif origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
            models = []
            for a in map(_strip, typing.get_args(annotation)):
                inner = _inner(a) if typing.get_origin(a) is not None else a
                models += list(inner) if isinstance(inner, tuple) else [inner]
            models = [a for a in models if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(models) == 1:
                return models[0]
            return tuple(models) or annotation
        else:
            return annotation
    return annotation


def _strip(a: Any) -> Any:
    while typing.get_origin(a) is typing.Annotated:
        a = typing.get_args(a)[0]
    return a


def _tagged(models: Any, tag: str) -> Any:
    names = {"sysroot": "SysrootHardware", "inline": "InlineHardware", "env": "ApiKeyFromEnv",
             "secret": "ApiKeyFromSecret"}
    if isinstance(models, tuple):
        for m in models:
            if m.__name__ == names.get(tag):
                return m
    return models
