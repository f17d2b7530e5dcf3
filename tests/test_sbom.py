"""`python -m deploykit.sbom`, what the image build's SBOM stage runs, on this test environment (which has torch, as
the engine image does) and this host's dpkg: a CycloneDX document that validates, lists torch with its version and
purl, the OS packages with Debian purls, and hangs them all under the image's root component."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("DEPLOYKIT_REQUIRE_DOCKER") == "1":  # CI installs the sbom extra: never a silent skip
    import cyclonedx_py  # noqa: F401
else:
    pytest.importorskip("cyclonedx_py", reason="pip install 'deploykit[sbom]'")
pytestmark = pytest.mark.slow  # schema validation of ~1000 components: seconds

ROOT = Path(__file__).resolve().parents[1]


def _sbom(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploykit.sbom", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_sbom_lists_the_python_environment_and_the_os_packages(tmp_path):
    import torch
    out = tmp_path / "sbom.cdx.json"
    r = _sbom("--python", sys.executable, "--name", "deploykit-engine", "--version", "0.1.0", "--output", str(out))
    assert r.returncode == 0, r.stderr
    bom = json.loads(out.read_text())
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.6"
    root = bom["metadata"]["component"]
    assert (root["type"], root["name"], root["version"]) == ("container", "deploykit-engine", "0.1.0")
    by_name = {c["name"]: c for c in bom["components"]}
    assert by_name["torch"]["version"] == torch.__version__
    assert by_name["torch"]["purl"].startswith("pkg:pypi/torch@" + torch.__version__.split("+")[0])
    assert by_name["deploykit"]["version"] == "0.1.0"
    depends = {d["ref"]: d.get("dependsOn", []) for d in bom["dependencies"]}
    assert by_name["deploykit"]["bom-ref"] in depends[root["bom-ref"]]
    if Path("/var/lib/dpkg/status").exists():  # a Debian host, as the engine image is
        system = next(c for c in bom["components"] if c["type"] == "operating-system")
        assert system["bom-ref"] in depends[root["bom-ref"]]
        libc = by_name["libc6"]
        assert libc["purl"].startswith(f"pkg:deb/{system['name']}/libc6@") and "arch=" in libc["purl"]
        assert libc["bom-ref"] in depends[system["bom-ref"]]


def test_an_unreadable_environment_is_a_clear_error_and_writes_nothing(tmp_path):
    out = tmp_path / "sbom.cdx.json"
    r = _sbom("--python", str(tmp_path / "no-python"), "--name", "x", "--version", "1", "--output", str(out))
    assert r.returncode == 1 and "deploykit.sbom: cyclonedx-py could not read the environment" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
