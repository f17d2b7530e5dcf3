"""Build (once) and reuse what the rendered-image tests need: an offline wheelhouse and the engine image.

Both are cached by content hash, so a second test run (or CI on the same machine) skips the minutes of work:
- the wheelhouse (~/.cache/deploykit-tests/wheelhouse-<hash of the dependency list>): every dependency of
  deploykit[engine] as wheels, made on the host with `pip wheel` (containers cannot reach PyPI here);
- the image `deploykit-e2e:<hash>` over the rendered build files, deploykit's sources and the wheelhouse.
Runnable by hand to pre-build: `flock /tmp/deploykit-heavy.lock python tests/docker/render_image.py SPEC`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from deploykit.runtime.build import SOURCES

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DEPLOYKIT_TEST_CACHE", Path.home() / ".cache" / "deploykit-tests"))
IMAGE_REPO = "deploykit-e2e"
BUILD_FILES = ("Dockerfile", ".dockerignore", "entrypoint.sh", "build.sh")
TIMINGS: dict[str, float] = {}  # what this process built and how long it took (seconds), for reports


def _locked(name: str):
    CACHE.mkdir(parents=True, exist_ok=True)
    fh = open(CACHE / f"{name}.lock", "w")
    fcntl.flock(fh, fcntl.LOCK_EX)
    return fh


def requirements() -> list[str]:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    return sorted(meta["dependencies"] + extras["engine"] + extras["sbom"])  # sbom: the image's SBOM stage


def wheelhouse() -> Path:
    """Directory of wheels for every dependency of deploykit[engine,sbom] (not deploykit itself)."""
    reqs = requirements()
    key = hashlib.sha256("\n".join([sys.implementation.cache_tag, *reqs]).encode()).hexdigest()[:16]
    final = CACHE / f"wheelhouse-{key}"
    if final.is_dir():
        return final
    with _locked("wheelhouse"):
        if final.is_dir():
            return final
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix="wheelhouse-", dir=CACHE))
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(tmp), *reqs],
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"pip wheel failed:\n{done.stderr[-3000:]}")
        tmp.rename(final)
        TIMINGS["wheelhouse_s"] = time.monotonic() - start
    return final


def source_copy(dest: Path) -> Path:
    """deploykit's sources without caches or build output: what build.sh turns into the wheel."""
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


def _tree_hash(h: "hashlib._Hash", root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")


def image_key(out: Path, src: Path, wheels: Path) -> str:
    h = hashlib.sha256()
    for name in BUILD_FILES:
        h.update(name.encode() + b"\0" + (out / name).read_bytes())
    _tree_hash(h, src)
    for whl in sorted(wheels.glob("*.whl")):
        h.update(whl.name.encode() + str(whl.stat().st_size).encode())
    return h.hexdigest()[:16]


def image_exists(ref: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", ref], capture_output=True, timeout=60).returncode == 0


def engine_image(out: Path, base_image: str) -> str:
    """Build the image from the rendered directory `out` (its spec must use base_image and the wheelhouse)."""
    wheels = wheelhouse()
    with tempfile.TemporaryDirectory(prefix="deploykit-src-") as tmp:
        src = source_copy(Path(tmp))
        ref = f"{IMAGE_REPO}:{image_key(out, src, wheels)}"
        if image_exists(ref):
            return ref
        with _locked("image"):
            if image_exists(ref):
                return ref
            start = time.monotonic()
            env = {**os.environ, "IMAGE": ref, "DEPLOYKIT_SRC": str(src), "WHEELHOUSE": str(wheels),
                   "PYTHON": sys.executable, "DOCKER_BUILDKIT": "0"}
            done = subprocess.run(["bash", str(out / "build.sh"), "--label", "deploykit-test=1"], env=env,
                                  capture_output=True, text=True, timeout=3600)
            if done.returncode != 0 or not image_exists(ref):
                raise RuntimeError(f"build.sh failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-5000:]}")
            TIMINGS["image_build_s"] = time.monotonic() - start
            (out / "build.log").write_text(done.stdout + done.stderr)
            _drop_stale(ref)
    return ref


def _drop_stale(keep: str) -> None:
    """Older test images are hundreds of MB each; keep only the newest."""
    refs = subprocess.run(["docker", "image", "ls", IMAGE_REPO, "--format", "{{.Repository}}:{{.Tag}}"],
                          capture_output=True, text=True, timeout=60).stdout.split()
    stale = [r for r in refs if r != keep]
    if stale:
        subprocess.run(["docker", "image", "rm", *stale], capture_output=True, timeout=300)


if __name__ == "__main__":
    t = time.monotonic()
    print(wheelhouse(), f"{time.monotonic() - t:.0f}s")
