"""`deploykit render` output hygiene: never clobber what deploykit did not write, atomic sets, clean errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.render.cases import CASES, write_spec

ROOT = Path(__file__).resolve().parents[1]


def render(spec, out, *extra):
    argv = [sys.executable, "-m", "deploykit.cli", "render", str(spec), "-o", str(out), *map(str, extra)]
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)


@pytest.fixture
def spec(tmp_path, sysroots):
    machine, sections = CASES["reserved-cpus-0"]
    return write_spec(tmp_path, {**sections, "hardware": {"sysroot": str(sysroots[machine])}})


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_writes_manifest_with_hashes_and_modes(spec, tmp_path):
    out = tmp_path / "out"
    r = render(spec, out)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "deploykit-manifest.json").read_text())
    on_disk = set(snapshot(out)) - {"deploykit-manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert {"Dockerfile", "run.sh", "compose.yaml", "nginx.conf", "seccomp.json", "seccomp-oci.json", "plan.json",
            "entrypoint.sh", "build.sh", "NOTES.txt", ".dockerignore"} <= on_disk
    assert (out / "run.sh").stat().st_mode & 0o111 and not (out / "compose.yaml").stat().st_mode & 0o111


@pytest.mark.slow
def test_render_twice_is_byte_identical_and_writes_nothing_new(spec, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert render(spec, a).returncode == 0
    first = snapshot(a)
    again = render(spec, a)
    assert again.returncode == 0 and "0 written" in again.stdout
    assert render(spec, b).returncode == 0
    assert snapshot(a) == first == snapshot(b)


def test_refuses_foreign_non_empty_directory_unless_forced(spec, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("user data")
    r = render(spec, out)
    assert r.returncode == 6 and "not written by deploykit" in r.stderr and "Traceback" not in r.stderr
    assert snapshot(out) == {"mine.txt": b"user data"}
    assert render(spec, out, "--force").returncode == 0
    assert (out / "mine.txt").read_text() == "user data" and (out / "Dockerfile").exists()


def test_rerender_removes_only_files_it_wrote(spec, tmp_path, sysroots):
    out = tmp_path / "out"
    assert render(spec, out).returncode == 0
    (out / "wheels").mkdir()
    (out / "wheels" / "torch.whl").write_bytes(b"x")
    (out / "notes-of-mine.md").write_text("keep")
    one = write_spec(tmp_path, {"hardware": {"sysroot": str(sysroots["two-cpu"])},
                                "model": CASES["reserved-cpus-0"][1]["model"],
                                "security": {"seccomp": "runtime-default"}}, name="one.yaml")
    r = render(one, out)
    assert r.returncode == 0, r.stderr
    assert not (out / "seccomp.json").exists()  # the runtime's own profile: no profile file any more
    assert (out / "wheels" / "torch.whl").exists() and (out / "notes-of-mine.md").read_text() == "keep"
    manifest = json.loads((out / "deploykit-manifest.json").read_text())
    assert "seccomp.json" not in manifest["files"] and "nginx.conf" in manifest["files"]  # one replica: nginx too


@pytest.mark.slow
def test_edited_file_is_not_overwritten_without_force(spec, tmp_path):
    out = tmp_path / "out"
    assert render(spec, out).returncode == 0
    (out / "compose.yaml").write_text("# my edits\n")
    r = render(spec, out)
    assert r.returncode == 6 and "compose.yaml" in r.stderr
    assert (out / "compose.yaml").read_text() == "# my edits\n"
    assert render(spec, out, "--force").returncode == 0
    assert (out / "compose.yaml").read_text().startswith("# Deployment")


@pytest.mark.slow
def test_unwritable_or_bad_output_paths_fail_cleanly(spec, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out in (a_file, a_file / "sub"):
        r = render(spec, out)
        assert r.returncode == 6 and "Traceback" not in r.stderr, r.stderr
    assert a_file.read_text() == "x"
    out = tmp_path / "out"
    (out / "run.sh").mkdir(parents=True)
    (out / "run.sh" / "keep").write_text("k")
    r = render(spec, out, "--force")
    assert r.returncode == 6 and "run.sh" in r.stderr
    assert snapshot(out) == {"run.sh/keep": b"k"}  # nothing else was written


def test_read_only_output_directory(spec, tmp_path):
    # Root ignores permission bits; a read-only bind mount needs privileges. /proc refuses new files for everyone.
    r = render(spec, "/proc/deploykit-render-test")
    assert r.returncode == 6 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("sections, code, words", [
    ({"placement": {"strategy": "explicit", "cpus": ["0-7"], "reserved_cpus": 0}}, 5, "do not exist"),
    ({"image": {"base": "python:3.11 slim"}}, 2, "image.base"),
])
def test_bad_input_fails_before_anything_is_written(tmp_path, sysroots, sections, code, words):
    spec = write_spec(tmp_path, {**sections, "hardware": {"sysroot": str(sysroots["two-cpu"])}})
    out = tmp_path / "out"
    r = render(spec, out)
    assert r.returncode == code and words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


def test_target_selection_and_spec_default(spec, tmp_path):
    out = tmp_path / "only-docker"
    assert render(spec, out, "--target", "docker").returncode == 0
    files = set(snapshot(out))
    assert "run.sh" in files and "compose.yaml" not in files


def test_spec_targets_are_the_default(tmp_path, sysroots):
    spec = write_spec(tmp_path, {**CASES["reserved-cpus-0"][1], "targets": ["compose", "helm"],
                                 "hardware": {"sysroot": str(sysroots["two-cpu"])}})
    out = tmp_path / "out"
    r = render(spec, out)
    assert r.returncode == 0, r.stderr
    files = set(snapshot(out))
    assert {"compose.yaml", "helm/values.yaml", "helm/deploykit/Chart.yaml"} <= files
    assert "run.sh" not in files and not any(f.startswith("k8s/") for f in files)


def test_an_edited_manifest_cannot_make_render_delete_outside_the_directory(spec, tmp_path):
    out = tmp_path / "out"
    assert render(spec, out).returncode == 0
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    import hashlib
    m = json.loads((out / "deploykit-manifest.json").read_text())
    digest = hashlib.sha256(precious.read_bytes()).hexdigest()
    m["files"]["../precious.txt"] = {"sha256": digest, "mode": "0644"}
    m["files"][str(precious)] = {"sha256": digest, "mode": "0644"}
    (out / "deploykit-manifest.json").write_text(json.dumps(m))
    assert render(spec, out).returncode == 0
    assert precious.read_text() == "keep me"
