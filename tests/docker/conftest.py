"""Fixtures for tests against a real Docker engine: `docker` (skip, or fail in CI) and `base_image`.

Docker being absent skips these tests, unless DEPLOYKIT_REQUIRE_DOCKER=1 (set in CI): then it fails them,
so a broken CI runner can never turn the container tests into silent skips.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from deploykit.render.image import BUILT_FOR_LABEL

try:  # tests/ may or may not become a package
    from .base_image import BaseImageUnavailable, ensure_base_image
except ImportError:
    from base_image import BaseImageUnavailable, ensure_base_image

REQUIRED = os.environ.get("DEPLOYKIT_REQUIRE_DOCKER") == "1"
TEST_LABEL = "deploykit-test=1"


def unavailable(reason: str) -> None:
    """Skip, or fail when CI requires Docker."""
    if REQUIRED:
        pytest.fail(f"DEPLOYKIT_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True, slots=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        assert self.returncode == 0, f"{' '.join(self.argv)} exited {self.returncode}:\n{self.stderr}"
        return json.loads(self.stdout)


class Docker:
    """Thin wrapper over the docker CLI (what users run). Every container is removed afterwards."""

    def run(self, image: str, cmd: Sequence[str] = (), *, flags: Sequence[str] = (),
            stdin: str | None = None, timeout: float = 180) -> Result:
        _check_published_ports(flags)
        name = f"deploykit-test-{uuid.uuid4().hex[:12]}"
        argv = ["docker", "run", "--rm", "--name", name, "--label", TEST_LABEL, *flags]
        if stdin is not None:
            argv.append("-i")
        argv += [image, *cmd]
        try:
            done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        finally:  # --rm covers normal exits; this covers timeouts and interrupted runs
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        return Result(tuple(argv), done.returncode, done.stdout, done.stderr)

    def run_python(self, image: str, source: str, *, flags: Sequence[str] = (), timeout: float = 180) -> Result:
        """Run a Python script fed on stdin: no bind mount, so it works with any daemon."""
        return self.run(image, ["python3", "-B", "-"], flags=flags, stdin=source, timeout=timeout)


def _check_published_ports(flags: Sequence[str]) -> None:
    for i, flag in enumerate(flags):
        value = None
        if flag in ("-p", "--publish"):
            value = flags[i + 1]
        elif flag.startswith("--publish="):
            value = flag.split("=", 1)[1]
        if value is not None and not value.startswith("127.0.0.1:"):
            raise ValueError(f"tests publish ports on 127.0.0.1 only, got {value!r}")


@functools.cache
def _docker_problem() -> str:
    """'' when the daemon answers, else why not."""
    try:
        done = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                              capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "the docker CLI is not installed"
    except subprocess.TimeoutExpired:
        return "the Docker daemon did not answer within 30 s"
    if done.returncode != 0:
        return f"the Docker daemon is not usable: {done.stderr.strip()[:300]}"
    return ""


@pytest.fixture(scope="session")
def docker() -> Iterator[Docker]:
    problem = _docker_problem()
    if problem:
        unavailable(problem)
    before = _stage_images()
    yield Docker()
    # Every image build leaves its builder and sbom stages untagged (1-2 GB each; `up` drops only its own
    # deployment's older ones). A CI disk filled up with them once: remove what this session's builds left.
    left = sorted(_stage_images() - before)
    if left:
        subprocess.run(["docker", "image", "rm", *left], capture_output=True, timeout=600)


def _stage_images() -> set[str]:
    """Ids of the untagged images deploykit's builds leave: the intermediate stages its Dockerfile labels, and test
    images whose tag moved on to a newer build."""
    ids: set[str] = set()
    for label in (BUILT_FOR_LABEL, TEST_LABEL):
        done = subprocess.run(["docker", "image", "ls", "-q", "--no-trunc", "--filter", "dangling=true",
                               "--filter", f"label={label}"], capture_output=True, text=True, timeout=120)
        ids.update(done.stdout.split())
    return ids


@pytest.fixture(scope="session")
def base_image(docker: Docker) -> str:
    """deploykit-base:bookworm, built on first use (a few minutes) and reused afterwards."""
    try:
        return ensure_base_image()
    except BaseImageUnavailable as e:
        unavailable(str(e))
        raise  # unreachable: unavailable() always raises


@pytest.fixture(scope="session")
def compose_cli(docker: Docker) -> str:
    """docker-compose (v1.29, Debian's package): the compose tool this machine has; v2's `docker compose` is absent."""
    exe = shutil.which("docker-compose")
    if exe is None:
        unavailable("docker-compose is not installed (Debian: apt-get install docker-compose)")
    return exe
