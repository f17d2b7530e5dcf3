"""`deploykit doctor` and Docker: run inside a container started with Docker's default seccomp profile, it reports
the refused NUMA calls and prints the fix; with deploykit's profile the same calls pass. From the host,
`--container NAME` finds a container-wide GOMP_CPU_AFFINITY, the refused calls (probed inside) and a CPU quota
that throttles.

deploykit goes into the offline base image the way a user installs it: pip from its source and a wheelhouse
(render_image.wheelhouse(), built on the host), streamed in on stdin, so no bind mount is needed.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest

from deploykit.doctor import fixes
from deploykit.render import seccomp
from deploykit.runtime import build

from tests.docker import render_image
from tests.docker.conftest import TEST_LABEL
from tests.waiting import wait_until

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO
CORE_WHEELS = ("pydantic", "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection", "pyyaml",
               "jinja2", "markupsafe", "setuptools")
INSTALL = ("mkdir -p /tmp/dk && tar -x -C /tmp/dk && python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q "
           "--no-index --find-links /tmp/dk/wheels /tmp/dk/src >/dev/null && ")


@pytest.fixture(scope="module")
def bundle() -> bytes:
    """deploykit's source and the wheels of its own dependencies, as one tar for the container's stdin."""
    wheels = render_image.wheelhouse()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in build.SOURCES:
            tar.add(REPO / name, arcname=f"src/{name}",
                    filter=lambda t: None if "__pycache__" in t.name or t.name.endswith((".so", ".pyc")) else t)
        for whl in sorted(wheels.glob("*.whl")):
            if whl.name.split("-")[0].lower() in CORE_WHEELS:
                tar.add(whl, arcname=f"wheels/{whl.name}")
    return buf.getvalue()


def doctor_inside(docker, base_image: str, bundle: bytes, *flags: str) -> tuple[int, dict]:
    name = f"deploykit-test-{uuid.uuid4().hex[:12]}"
    argv = ["docker", "run", "--rm", "-i", "--name", name, "--label", TEST_LABEL, "--network", "none", *flags,
            base_image, "sh", "-c", INSTALL + "/tmp/venv/bin/deploykit doctor --format json"]
    try:
        done = subprocess.run(argv, input=bundle, capture_output=True, timeout=600)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
    assert done.stdout, done.stderr.decode()[-3000:]
    assert b"Traceback" not in done.stderr, done.stderr.decode()
    return done.returncode, json.loads(done.stdout)


def finding(rep: dict, fid: str) -> dict:
    (f,) = [f for s in rep["sections"] for f in s["findings"] if f["id"] == fid]
    return f


def _multi_node() -> bool:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) > 1


def test_inside_a_container_with_dockers_default_profile(docker, base_image, bundle):
    code, rep = doctor_inside(docker, base_image, bundle, "--cap-drop", "ALL")
    f = finding(rep, "numa.syscalls")
    assert f["title"].startswith("NUMA calls refused (EPERM): get_mempolicy, mbind, migrate_pages, move_pages, "
                                 "set_mempolicy"), f
    assert f["level"] == ("fail" if _multi_node() else "warn")
    assert code == (8 if _multi_node() else 0)
    assert "seccomp mode 2 (filter)" in f["evidence"] and "CAP_SYS_NICE not held" in f["evidence"]
    assert "a seccomp filter refuses them" in f["cause"]
    assert f["fix"][0].startswith("docker run --cap-drop ALL") and "--security-opt seccomp=seccomp.json" in f["fix"][0]
    assert any("Localhost" in x for x in f["fix"]) and any("deploykit doctor --write-seccomp" in x for x in f["fix"])


def test_default_profile_with_sys_nice_still_refuses_page_migration(docker, base_image, bundle):
    _, rep = doctor_inside(docker, base_image, bundle, "--cap-drop", "ALL", "--cap-add", "SYS_NICE")
    f = finding(rep, "numa.syscalls")
    assert f["level"] == "warn" and f["title"].startswith("NUMA calls refused (EPERM): migrate_pages, move_pages")


def test_the_printed_fix_works(docker, base_image, bundle, tmp_path):
    """Exactly what doctor printed: deploykit's profile (written by --write-seccomp) with capabilities dropped
    (plus what the profile itself asks for)."""
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "doctor", "--write-seccomp", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "seccomp.json").read_text()) == seccomp.profile()
    add = [x for c in fixes.profile_caps() for x in ("--cap-add", c)]
    code, rep = doctor_inside(docker, base_image, bundle, "--cap-drop", "ALL", *add,
                              "--security-opt", f"seccomp={tmp_path / 'seccomp.json'}")
    assert finding(rep, "numa.syscalls")["level"] == "ok"


@pytest.fixture
def broken_container(docker, base_image):
    """A container doing what the user report describes, from the outside: GOMP_CPU_AFFINITY for the whole
    container, Docker's default seccomp without capabilities, and a CPU quota below its cpuset, with two busy
    processes."""
    name = f"deploykit-test-{uuid.uuid4().hex[:12]}"
    run = subprocess.run(["docker", "run", "-d", "--name", name, "--label", TEST_LABEL, "--network", "none",
                          "--cap-drop", "ALL", "--cpus", "0.5", "-e", "GOMP_CPU_AFFINITY=0", "-e", "OMP_NUM_THREADS=2",
                          base_image, "sh", "-c", "while :; do :; done & while :; do :; done"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr

    def busy() -> bool:  # the shell, looping, and the subshell it started for the other loop
        top = subprocess.run(["docker", "top", name, "-o", "pid"], capture_output=True, text=True, timeout=30)
        return top.returncode == 0 and len(top.stdout.split()) - 1 >= 2
    try:
        wait_until(busy, timeout=30, interval=0.2, what="the container's two busy loops")
        yield name
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def test_doctor_container_from_the_host(broken_container):
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "doctor", "--container", broken_container,
                        "--seconds", "2", "--format", "json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    rep = json.loads(r.stdout)
    assert r.returncode == 9
    env = finding(rep, "container.openmp.affinity_env")
    assert env["level"] == "fail" and "the container's environment" in env["title"] and "CPU 0" in env["title"]
    numa = finding(rep, "numa.syscalls")
    assert numa["title"].startswith("NUMA calls refused (EPERM)")
    assert any("docker exec" in e for e in numa["evidence"])
    assert finding(rep, "container.cpus")["level"] == "warn"
    thr = finding(rep, "cpu.throttled")
    assert thr["level"] == "fail" and thr["title"].startswith("the CFS quota of 0.5 CPUs throttled")


def test_unknown_container_is_a_message(docker):
    r = subprocess.run([sys.executable, "-m", "deploykit.cli", "doctor", "--container", "no-such-container-xyz"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 10 and "no such container" in r.stderr and "Traceback" not in r.stderr
