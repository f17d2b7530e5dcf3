"""The chart's README values table is generated from values.yaml's comments (scripts/chart_readme.py) and is current;
values.yaml and values.schema.json describe the same keys with the same types, and every key is documented."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("chart_readme", ROOT / "scripts" / "chart_readme.py")
chart_readme = sys.modules["chart_readme"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(chart_readme)
CHART = chart_readme.CHART
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
              type(None): "null"}


def test_the_readme_table_is_generated_from_values_yaml_and_current():
    assert (CHART / "README.md").read_text() == chart_readme.readme(), "run python scripts/chart_readme.py"


@pytest.mark.parametrize("value", chart_readme.values(), ids=lambda v: v.path)
def test_every_value_is_documented_and_typed_as_the_schema_says(value):
    node = chart_readme.schema_node(SCHEMA, value.path)
    assert node is not None, f"{value.path} missing from values.schema.json"
    assert value.description, f"{value.path}: no `# --` comment in values.yaml"
    if value.optional:
        return
    if "enum" in node:
        assert value.default in node["enum"], f"{value.path}: default {value.default!r} not in {node['enum']}"
    else:
        allowed = node["type"] if isinstance(node["type"], list) else [node["type"]]
        assert JSON_TYPES[type(value.default)] in allowed, f"{value.path}: {value.default!r} is not {allowed}"


def test_every_key_of_the_schema_is_in_values_yaml():
    """Every property of an object values.yaml spells out (and of a list's items, e.g. placement.slots[]) is a
    value of the chart; objects values.yaml leaves empty ({} or []) are free-form or Kubernetes objects."""
    paths = {v.path for v in chart_readme.values()}
    missing = []

    def walk(node: dict, prefix: str) -> None:
        for key, sub in node.get("properties", {}).items():
            path = prefix + key
            if path not in paths and not any(p.startswith(path + ".") or p.startswith(path + "[]") for p in paths):
                missing.append(path)
            elif "properties" in sub and any(p.startswith(path + ".") for p in paths):
                walk(sub, path + ".")
            elif "properties" in sub.get("items", {}) and any(p.startswith(path + "[].") for p in paths):
                walk(sub["items"], path + "[].")
    walk(SCHEMA, "")
    assert not missing, f"in values.schema.json but not in values.yaml: {missing}"
