"""`up` drops a superseded build's untagged stage images (1-2 GB each), and only its own deployment's."""

from __future__ import annotations

import subprocess
import uuid

from deploykit.runtime.build import drop_stale_stages


def _stage_image(base: str, deployment: str) -> str:
    """An untagged image labelled as one of `deployment`'s build stages; its short id as the build prints it."""
    dockerfile = f"FROM {base}\nLABEL deploykit.image-built-for={deployment} nonce={uuid.uuid4().hex}\n"
    done = subprocess.run(["docker", "build", "-q", "-"], input=dockerfile, capture_output=True, text=True,
                          timeout=120, env={"DOCKER_BUILDKIT": "0", "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().removeprefix("sha256:")[:12]


def _exists(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60).returncode == 0


def test_only_the_deployments_stages_the_new_build_did_not_use_are_removed(docker, base_image):
    import docker as docker_sdk
    name, other = f"dkprune{uuid.uuid4().hex[:6]}", f"dkprune{uuid.uuid4().hex[:6]}"
    used, stale, foreign = _stage_image(base_image, name), _stage_image(base_image, name), _stage_image(base_image, other)
    said: list[str] = []
    try:
        drop_stale_stages(docker_sdk.from_env(), name, {used}, said.append)
        assert _exists(used) and not _exists(stale) and _exists(foreign)
        assert said == ["removed 1 untagged stage image(s) of earlier builds"]
    finally:
        subprocess.run(["docker", "image", "rm", "-f", used, stale, foreign], capture_output=True, timeout=120)
