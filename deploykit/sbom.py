"""The engine image's bill of materials (CycloneDX 1.6 JSON): the Python environment as cyclonedx-py reads it
(every installed distribution with its version, purl, licenses and dependencies: torch, transformers, deploykit,
...) and the OS packages dpkg lists, with the distribution they come from, under one root component for the image.
Built and written with cyclonedx-python-lib, and validated against the CycloneDX schema before it is written.

It runs in the Dockerfile's throwaway `sbom` stage, from a virtualenv with `deploykit[sbom]` (so the SBOM tool is
not part of the image it describes):

    python -m deploykit.sbom --python /opt/deploykit/venv/bin/python --name NAME --version TAG --output FILE
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

# Installed packages only ("ii"): ones removed but with configuration left are not in the image's code.
DPKG_FORMAT = "${db:Status-Abbrev}\t${Package}\t${Version}\t${Architecture}\n"


class SbomError(Exception):
    """What stops the SBOM from being made; the build step fails with this message."""


def python_bom(python: str):
    """cyclonedx-py's BOM of the environment of interpreter `python` (a venv's bin/python); validated once merged."""
    from cyclonedx.model.bom import Bom
    done = subprocess.run([sys.executable, "-m", "cyclonedx_py", "environment", "--output-reproducible",
                           "--no-validate", "--of", "JSON", "--output-file", "-", python],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SbomError(f"cyclonedx-py could not read the environment of {python}:\n{done.stderr.strip()}")
    return Bom.from_json(json.loads(done.stdout))


def deb_packages() -> list[tuple[str, str, str]]:
    """(name, version, architecture) of every installed dpkg package; [] without dpkg (not a Debian system)."""
    try:
        done = subprocess.run(["dpkg-query", "--show", f"--showformat={DPKG_FORMAT}"], capture_output=True,
                              text=True, check=True)
    except FileNotFoundError:
        return []
    except subprocess.CalledProcessError as e:
        raise SbomError(f"dpkg-query failed: {e.stderr.strip()}") from None
    rows = (line.split("\t") for line in done.stdout.splitlines())
    return sorted((name, version, arch) for status, name, version, arch in rows if status.strip() == "ii")


def build(python: str, name: str, version: str):
    """The image's Bom: root component `name:version` depending on the Python distributions nothing else in the
    environment requires (deploykit, and what was installed beside it) and on the operating system, which depends
    on its packages."""
    from cyclonedx.model.component import Component, ComponentType
    from packageurl import PackageURL

    bom = python_bom(python)
    required = {str(d.ref) for dep in bom.dependencies for d in dep.dependencies}
    top = [c for c in bom.components if str(c.bom_ref) not in required]
    root = Component(type=ComponentType.CONTAINER, name=name, version=version, bom_ref=f"{name}:{version}")
    bom.metadata.component = root
    debs = deb_packages()
    parts = list(top)
    if debs:
        release = platform.freedesktop_os_release()
        distro_id, distro_version = release.get("ID", "debian"), release.get("VERSION_ID", "")
        distro = f"{distro_id}-{distro_version}" if distro_version else distro_id
        system = Component(type=ComponentType.OPERATING_SYSTEM, name=distro_id, version=distro_version or None,
                           description=release.get("PRETTY_NAME"), bom_ref=f"os:{distro}")
        packages = []
        for pkg, ver, arch in debs:
            purl = PackageURL(type="deb", namespace=distro_id, name=pkg, version=ver,
                              qualifiers={"arch": arch, "distro": distro})
            packages.append(Component(type=ComponentType.LIBRARY, name=pkg, version=ver, purl=purl,
                                      bom_ref=purl.to_string()))
        bom.components.update([system, *packages])
        bom.register_dependency(system, packages)
        parts.append(system)
    bom.register_dependency(root, parts)
    return bom


def dumps(bom) -> str:
    """CycloneDX 1.6 JSON, refused unless it validates against the schema."""
    from cyclonedx.output.json import JsonV1Dot6
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator
    text = JsonV1Dot6(bom).output_as_string(indent=2)
    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    if error is not None:
        raise SbomError(f"the SBOM does not validate against CycloneDX 1.6: {error}")
    return text + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploykit.sbom", description=__doc__.split("\n\n")[0])
    p.add_argument("--python", required=True, help="the interpreter of the environment to describe")
    p.add_argument("--name", required=True, help="the image's name (the root component)")
    p.add_argument("--version", required=True, help="the image's tag")
    p.add_argument("--output", required=True, type=Path, help="where to write the CycloneDX JSON")
    a = p.parse_args(argv)
    try:
        text = dumps(build(a.python, a.name, a.version))
    except SbomError as e:
        print(f"deploykit.sbom: {e}", file=sys.stderr)
        return 1
    a.output.write_text(text)
    print(f"deploykit.sbom: wrote {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
