"""Build (once) or reuse the offline base image deploykit-base:bookworm via images/base/build-base.sh.

Also runnable by hand: `python tests/docker/base_image.py` (wrap it in the heavy-job flock).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "images" / "base" / "build-base.sh"
IMAGE = os.environ.get("DEPLOYKIT_BASE_IMAGE", "deploykit-base:bookworm")
BUILD_TIMEOUT_S = 1800


class BaseImageUnavailable(RuntimeError):
    """This machine cannot build the image (no root or no debootstrap); not a bug in the script."""


def image_exists(image: str = IMAGE) -> bool:
    done = subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60)
    return done.returncode == 0


def ensure_base_image(image: str = IMAGE) -> str:
    """Return `image`, building it first if Docker does not have it. Raises on a failed build."""
    if image_exists(image):
        return image
    if shutil.which("debootstrap") is None and not Path("/usr/sbin/debootstrap").exists():
        raise BaseImageUnavailable(f"{image} is missing and debootstrap is not installed to build it")
    if os.geteuid() != 0:
        raise BaseImageUnavailable(f"{image} is missing and debootstrap needs root to build it")
    start = time.monotonic()
    done = subprocess.run([str(SCRIPT)], env={**os.environ, "DEPLOYKIT_BASE_IMAGE": image},
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0 or not image_exists(image):
        tail = "\n".join((done.stderr or "").splitlines()[-25:])
        raise RuntimeError(f"{SCRIPT} failed (exit {done.returncode}):\n{tail}")
    print(f"built {image} in {time.monotonic() - start:.0f}s", file=sys.stderr)
    return image


if __name__ == "__main__":
    print(ensure_base_image())
