"""Rendered files match the reviewed goldens in tests/golden/<case>/ byte for byte (UPDATE_GOLDEN=1 rewrites them).

Every target is rendered; the helm target's copy of the chart (helm/deploykit/) is left out of the goldens (it is
charts/deploykit itself, compared byte for byte below), its values file and the manifests are in.
"""

from __future__ import annotations

import difflib
import os
import shutil
from pathlib import Path

import pytest

from deploykit import render
from deploykit.cli import load_plan
from deploykit.render import helm, output
from tests.render.cases import CASES, write_spec

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SPEC_DIR = "/spec"  # the spec's directory, wherever the test put it
CHART_COPY = f"helm/{helm.CHART}/"


def rendered(case: str, tmp_path: Path, sysroots: dict) -> dict[str, bytes]:
    machine, sections = CASES[case]
    spec = write_spec(tmp_path, sections)
    _, _, plan = load_plan(str(spec), str(sysroots[machine]))
    files = tuple(output.File(f.path, f.data.replace(str(tmp_path).encode(), SPEC_DIR.encode()), f.mode)
                  for f in render.render(plan, render.TARGETS))
    return {f.path: f.data for f in (*files, output.manifest_file(files)) if not f.path.startswith(CHART_COPY)}


def _tree(where: Path) -> dict[str, bytes]:
    return {p.relative_to(where).as_posix(): p.read_bytes() for p in where.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_golden(case, tmp_path, sysroots):
    got = rendered(case, tmp_path, sysroots)
    where = GOLDEN / case
    if os.environ.get("UPDATE_GOLDEN") == "1":
        shutil.rmtree(where, ignore_errors=True)
        for rel, data in got.items():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / rel).write_bytes(data)
    want = _tree(where) if where.is_dir() else {}
    assert sorted(got) == sorted(want), f"file set differs from {where} (UPDATE_GOLDEN=1 to accept)"
    diffs = ["".join(difflib.unified_diff(want[rel].decode().splitlines(True), got[rel].decode().splitlines(True),
                                          f"golden/{case}/{rel}", f"rendered/{rel}"))
             for rel in sorted(got) if got[rel] != want[rel]]
    assert not diffs, "\n".join(diffs) + "\n(UPDATE_GOLDEN=1 to accept)"


def test_rendering_is_deterministic(tmp_path, sysroots):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert rendered("two-replicas-2socket", a, sysroots) == rendered("two-replicas-2socket", b, sysroots)


def test_helm_target_copies_the_chart_byte_for_byte(tmp_path, sysroots):
    machine, sections = CASES["two-replicas-2socket"]
    _, _, plan = load_plan(str(write_spec(tmp_path, sections)), str(sysroots[machine]))
    copy = {f.path[len(CHART_COPY):]: f.data for f in helm.files(plan) if f.path.startswith(CHART_COPY)}
    chart = {rel: data for rel, data in _tree(helm.chart_dir()).items()
             if "__pycache__" not in rel and not rel.endswith(".pyc")}
    assert copy == chart and "values.schema.json" in copy and "templates/tests/test-placement.yaml" in copy
