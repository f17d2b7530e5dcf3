"""The engine image for `deploykit up`: built through the Docker SDK from the rendered build context (the same
Dockerfile build.sh builds), only when its inputs changed, tagged `<image.name>:<image.tag>-<inputs hash>`.

Inputs: the rendered Dockerfile, .dockerignore and entrypoint; deploykit itself (its source tree, or the wheel
named by DEPLOYKIT_WHEEL); the names and sizes of the wheelhouse's wheels; the base image's id. The staging step
is build.sh's: ./wheels gets a deploykit wheel plus every wheel of image.wheelhouse (offline `pip --no-index`).
As build.sh does, the SBOM the build wrote into the image is copied next to the rendered files.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from ..errors import RuntimeFailure
from ..plan import Plan
from ..render.image import BUILT_FOR_LABEL, SBOM_FILE, SBOM_PATH
from . import Say

# What the deploykit wheel is built from: the image's input hash and the tests' source bundles use this one list.
SOURCES = ("pyproject.toml", "README.md", "deploykit", "engine", "images", "charts")
BUILD_FILES = ("Dockerfile", ".dockerignore", "entrypoint.sh")
_NOT_SOURCE = (".pyc", ".so", ".o")
INPUTS_LABEL = "deploykit.image-inputs"
TAIL = 25  # output lines shown with a failed step
PROGRESS_EVERY = 15.0  # seconds: within a long step, show its latest output line this often
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the classic builder colours a RUN step's stderr
_STEP_RESULT = re.compile(r"^ ---> ([0-9a-f]{12})\s*$")  # the classic builder's "this step's image is <id>"


def ensure(client, plan: Plan, context: Path, say: Say) -> str:
    """The image ref for this plan, built first if Docker does not have it."""
    base_id = _base_image(client, plan.image.base, say)
    source = _deploykit_source()
    wheels = _wheelhouse(plan)
    key = inputs_hash(context, source, wheels, base_id)
    ref = f"{plan.image.name}:{plan.image.tag[:115]}-{key}"
    if _exists(client, ref):
        say(f"image {ref}: up to date")
    else:
        say(f"image {ref}: building (its inputs changed or it was never built)")
        start = time.monotonic()
        _stage(context, source, wheels, say)
        made = _build(client, plan, context, ref, key, say)
        say(f"image {ref}: built in {_took(time.monotonic() - start)}")
        drop_stale_stages(client, plan.name, made, say)
    copy_sbom(client, ref, context / SBOM_FILE)
    client.api.tag(ref, plan.image.name, plan.image.tag, force=True)  # what run.sh and compose.yaml refer to
    return ref


def inputs_hash(context: Path, source: Path, wheels: list[Path], base_id: str) -> str:
    h = hashlib.sha256(b"base\0" + base_id.encode() + b"\0")
    for name in BUILD_FILES:
        h.update(name.encode() + b"\0" + (context / name).read_bytes() + b"\0")
    if source.is_file():  # a wheel given as is
        h.update(b"wheel\0" + source.read_bytes())
    else:
        for name in SOURCES:
            for p in sorted((source / name).rglob("*")) if (source / name).is_dir() else [source / name]:
                if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(_NOT_SOURCE):
                    h.update(str(p.relative_to(source)).encode() + b"\0" + p.read_bytes() + b"\0")
    for w in wheels:  # versions are in the names; sizes catch a rebuilt wheel without hashing hundreds of MB
        h.update(f"{w.name}\0{w.stat().st_size}\0".encode())
    return h.hexdigest()[:12]


def copy_sbom(client, ref: str, dest: Path) -> None:
    """The image's bill of materials (written by its build) to `dest`, through a container that never starts."""
    import docker.errors
    ctr = client.containers.create(ref)
    try:
        stream, _ = ctr.get_archive(SBOM_PATH)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            data = tar.extractfile(tar.getmembers()[0]).read()
    except docker.errors.NotFound:
        raise RuntimeFailure(f"image {ref} has no bill of materials at {SBOM_PATH}", path="image",
                             hint="rebuild it from this deploykit's Dockerfile (deploykit down, then up)") from None
    finally:
        ctr.remove(force=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(dest)


def prune(client, plan: Plan, keep: str, say: Say) -> None:
    """Drop this deployment's older engine images (each is over a GB); ones a container still uses stay."""
    import docker.errors
    for image in client.images.list(filters={"label": f"{BUILT_FOR_LABEL}={plan.name}"}):
        for t in image.tags:
            if t != keep and t.startswith(f"{plan.image.name}:{plan.image.tag[:115]}-"):
                try:
                    client.images.remove(t)
                    say(f"image {t}: removed (superseded by {keep})")
                except docker.errors.APIError:
                    pass  # in use by a container, or shared with another tag: leave it


def drop_stale_stages(client, deployment: str, made: set[str], say: Say) -> None:
    """Remove deployment's untagged stage images (builder, sbom) that the build just made did not use.

    Docker keeps every multi-stage build's intermediate stages as untagged images; ours are 1-2 GB each and would
    fill a disk within a few dozen `up`s. The ones this build made or reused stay: they are its layer cache.
    """
    import docker.errors
    freed = 0
    for image in client.images.list(filters={"dangling": True, "label": f"{BUILT_FOR_LABEL}={deployment}"}):
        if image.id.removeprefix("sha256:")[:12] in made:
            continue
        try:
            client.images.remove(image.id)
            freed += 1
        except docker.errors.APIError:
            pass  # a child image or a container still uses it
    if freed:
        say(f"removed {freed} untagged stage image(s) of earlier builds")


def _base_image(client, base: str, say: Say) -> str:
    import docker.errors
    try:
        return client.images.get(base).id
    except docker.errors.ImageNotFound:
        pass
    say(f"base image {base}: not on this host, pulling")
    from docker.utils import parse_repository_tag
    repo, tag = parse_repository_tag(base.split("@")[0] if "@" in base else base)
    digest = base.partition("@")[2]
    try:
        last = ""
        for chunk in client.api.pull(repo, tag=digest or tag or "latest", stream=True, decode=True):
            if "error" in chunk:
                raise docker.errors.APIError(chunk["error"])
            status = chunk.get("status", "")
            if status != last and not chunk.get("progressDetail"):
                say(f"  {chunk.get('id', '')} {status}".rstrip())
                last = status
        return client.images.get(base).id
    except docker.errors.APIError as e:
        raise RuntimeFailure(f"the base image is not on this host and cannot be pulled: {_explain(e)}",
                             path="image.base", value=base,
                             hint="pull or `docker load` it on this host, or set image.base to an image it has "
                                  "(docker image ls)") from None


def _deploykit_source() -> Path:
    """The wheel to install in the image (DEPLOYKIT_WHEEL), else the source checkout to build one from (DEPLOYKIT_SRC,
    else the checkout this deploykit runs from): the same two knobs as build.sh."""
    if os.environ.get("DEPLOYKIT_WHEEL"):
        wheel = Path(os.environ["DEPLOYKIT_WHEEL"])
        if not wheel.is_file() or wheel.suffix != ".whl":
            raise RuntimeFailure("DEPLOYKIT_WHEEL is not a wheel file", path="DEPLOYKIT_WHEEL", value=str(wheel),
                                 hint="point it at a built deploykit-*.whl, or unset it to build one from source")
        return wheel
    import deploykit
    src = Path(os.environ.get("DEPLOYKIT_SRC") or Path(deploykit.__file__).resolve().parents[1])
    if not (src / "pyproject.toml").is_file() or not (src / "engine").is_dir():
        raise RuntimeFailure("the engine image needs deploykit's sources or a wheel, and this deploykit is not "
                             "installed from a source checkout", path="DEPLOYKIT_SRC", value=str(src),
                             hint="set DEPLOYKIT_SRC to a deploykit checkout, or DEPLOYKIT_WHEEL to a built wheel")
    return src


def _wheelhouse(plan: Plan) -> list[Path]:
    if plan.image.wheelhouse is None:
        return []
    where = Path(plan.image.wheelhouse)
    wheels = sorted(w for w in where.glob("*.whl") if not w.name.startswith("deploykit-"))
    if not wheels:
        raise RuntimeFailure("the offline wheelhouse has no wheels", path="image.wheelhouse", value=str(where),
                             hint="fill it with `pip wheel --wheel-dir DIR 'deploykit[engine,sbom]'` on a machine with "
                                  "PyPI access, or remove image.wheelhouse to install from PyPI during the build")
    return wheels


def _stage(context: Path, source: Path, wheels: list[Path], say: Say) -> None:
    """build.sh's staging: ./wheels holds one deploykit wheel and the wheelhouse (hard links where possible)."""
    staged = context / "wheels"
    staged.mkdir(exist_ok=True)
    for old in staged.glob("*.whl"):
        old.unlink()
    if source.is_file():
        _link_or_copy(source, staged)
    else:
        say(f"  building the deploykit wheel from {source}")
        cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(staged), str(source)]
        try:  # offline-friendly when setuptools is already here, as build.sh does
            import setuptools  # noqa: F401
            cmd.insert(4, "--no-build-isolation")
        except ImportError:
            pass
        # A fixed timestamp makes the wheel byte-identical for an unchanged source, so Docker's layer cache holds
        # for the expensive `pip install` step when only the Dockerfile's metadata (port, labels) changed.
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"})
        if done.returncode != 0:
            raise RuntimeFailure("building the deploykit wheel for the image failed:\n" + _tail(done.stderr),
                                 path="DEPLOYKIT_SRC", value=str(source),
                                 hint="fix the error above, or set DEPLOYKIT_WHEEL to a built wheel")
    for w in wheels:
        _link_or_copy(w, staged)


def _build(client, plan: Plan, context: Path, ref: str, key: str, say: Say) -> set[str]:
    """Build `ref`; return the short ids of every image the build made or took from its cache."""
    import docker.errors
    lines: list[str] = []
    made: set[str] = set()
    step = ""
    shown = time.monotonic()
    try:
        stream = client.api.build(path=str(context), tag=ref, rm=True, forcerm=True, decode=True, pull=False,
                                  labels={BUILT_FOR_LABEL: plan.name, INPUTS_LABEL: key})
        for chunk in stream:
            if "error" in chunk:
                raise _failed(ref, step, chunk.get("error", ""), lines)
            for line in _ANSI.sub("", chunk.get("stream", "")).splitlines():
                if line.strip():
                    lines.append(line.rstrip())
                if m := _STEP_RESULT.match(line):
                    made.add(m.group(1))
                if line.startswith("Step "):
                    step = line.strip()
                    say(f"  {step}")
                    shown = time.monotonic()
                elif line.strip() and time.monotonic() - shown > PROGRESS_EVERY:  # a long RUN step is not stuck
                    say(f"    ... {line.strip()[:110]}")
                    shown = time.monotonic()
    except docker.errors.APIError as e:
        raise _failed(ref, step, _explain(e), lines) from None
    if not _exists(client, ref):
        raise _failed(ref, step, "the build ended without producing the image", lines)
    return made


def _failed(ref: str, step: str, error: str, lines: list[str]) -> RuntimeFailure:
    where = f" at {step}" if step else ""
    return RuntimeFailure(f"building image {ref} failed{where}\n{error.strip()}\nlast build output:\n"
                          + _tail("\n".join(lines)), path="image",
                          hint="fix the failing step (the build context is in the state directory's rendered/); "
                               "offline builds need every dependency in image.wheelhouse")


def _exists(client, ref: str) -> bool:
    import docker.errors
    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def _explain(e: Exception) -> str:
    return str(getattr(e, "explanation", None) or e)


def _tail(text: str) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()[-TAIL:])


def _link_or_copy(src: Path, directory: Path) -> None:
    """A hard link where possible: a wheelhouse with torch is hundreds of MB."""
    try:
        os.link(src, directory / src.name)
    except OSError:  # another file system
        shutil.copyfile(src, directory / src.name)


def _took(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 90 else f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
