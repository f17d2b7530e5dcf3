"""The rendered run.sh and compose.yaml, run by a real Docker engine, give each replica exactly its planned CPUs and
memory nodes, NUMA syscalls, no root and a read-only root file system.

The probe runs with the flags the rendered files produce, not hand-written ones: run.sh is executed with DOCKER
pointing at a recorder, and compose.yaml is run by docker-compose with only image and entrypoint overridden.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from deploykit import cpulist

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
PROBE = (Path(__file__).parent / "numa_probe.py").read_text()
NUMA_CALLS = ("get_mempolicy", "set_mempolicy", "mbind", "migrate_pages", "move_pages")
SENTINEL_IMAGE = "deploykit-probe-sentinel:none"
RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["DOCKER_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit(1 if "inspect" in sys.argv[1:3] else 0)  # nothing exists yet
"""
# Flags that only matter for a long-running service, not for what the process inside may do.
SERVICE_ONLY = {"--name", "--restart", "--network", "--publish"}


def cpuset(replica: dict) -> str:
    """Every CPU a replica's container may use, from its plan.json entry."""
    return cpulist.format(cpulist.parse(replica["cpus"]) + cpulist.parse(replica["frontend_cpus"]))


def host_spec() -> dict:
    """Two one-CPU replicas on this host (strategy explicit, nothing reserved), as the e2e test runs them."""
    allowed = cpulist.parse(next(line.split(":", 1)[1] for line in open("/proc/self/status")
                                 if line.startswith("Cpus_allowed_list")))
    placement = ({"strategy": "explicit", "cpus": [str(allowed[0]), str(allowed[1])], "reserved_cpus": 0}
                 if len(allowed) >= 2 else {"strategy": "single", "reserved_cpus": 0})
    return {"apiVersion": "deploykit/v1", "kind": "Deployment", "name": "probe",
            "model": {"source": "Qwen/Qwen2.5-0.5B-Instruct", "max_model_len": 4096,
                      "architecture": {"num_parameters": 494_032_768, "num_hidden_layers": 24,
                                       "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 32768}},
            "placement": placement, "serving": {"publish_address": "127.0.0.1", "kv_cache": "256MiB"}}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[Path, dict, Path]:
    """(output dir, plan as JSON, an empty model dir) for this host."""
    base = tmp_path_factory.mktemp("render-probe")
    spec = base / "spec.yaml"
    spec.write_text(yaml.safe_dump(host_spec()))
    out = base / "out"
    done = subprocess.run([sys.executable, "-m", "deploykit.cli", "render", str(spec), "-o", str(out),
                           "--target", "all"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    model = base / "model"
    model.mkdir()
    return out, json.loads((out / "plan.json").read_text()), model


def run_sh_commands(out: Path, model: Path, tmp: Path) -> list[list[str]]:
    """Every `docker run` and `docker create` argv that run.sh issues (nginx is created, joined to the engines'
    network, then started)."""
    recorder = tmp / "docker"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    log = tmp / "docker.log"
    env = {**os.environ, "DOCKER": str(recorder), "DOCKER_LOG": str(log), "IMAGE": SENTINEL_IMAGE,
           "MODEL_DIR": str(model)}
    done = subprocess.run(["bash", str(out / "run.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [c for c in calls if c[0] in ("run", "create")]


def probe_flags(argv: list[str]) -> list[str]:
    """`docker run` flags of one container minus the service-only ones; fails on anything unexpected."""
    assert argv[0] == "run" and argv[1] == "--detach"
    end = argv.index(SENTINEL_IMAGE)
    flags, i = [], 2
    while i < end:
        if argv[i] in SERVICE_ONLY:
            i += 2
            continue
        flags.append(argv[i])
        i += 1
    return flags


def test_run_sh_flags_give_each_replica_its_plan(docker, base_image, rendered, tmp_path):
    out, plan, model = rendered
    runs = run_sh_commands(out, model, tmp_path)
    replicas = plan["replicas"]
    assert len(runs) == len(replicas) + 1  # nginx in front, even of one replica: the only published port
    for argv, replica in zip(runs, replicas, strict=False):  # the load balancer comes last
        seen = docker.run_python(base_image, PROBE, flags=probe_flags(argv)).json()
        assert seen["cpus_allowed_list"] == cpuset(replica)
        assert seen["mems_allowed_list"] == replica["mems"]
        assert {n: seen["syscalls"][n] for n in NUMA_CALLS} == {n: 0 for n in NUMA_CALLS}
        assert (seen["uid"], seen["gid"]) == (10001, 10001)
        assert seen["root_write_errno"] == errno.EROFS
        assert seen["no_new_privs"] == "1" and seen["seccomp_mode"] == "2"
        assert int(seen["cap_bnd"], 16) == int(seen["cap_eff"], 16) == 0  # no capability at all
        assert seen["syscalls"]["mount"] == errno.EPERM


def test_run_sh_publishes_only_nginx_on_the_planned_address_and_port(rendered, tmp_path):
    out, plan, model = rendered
    runs = run_sh_commands(out, model, tmp_path)
    published = [a[a.index("--publish") + 1] if "--publish" in a else None for a in runs]
    port = plan["serving"]["port"]
    assert published == [None] * len(plan["replicas"]) + [f"127.0.0.1:{port}:{port}"]  # nginx's alone


def test_compose_file_gives_each_replica_its_plan(compose_cli, base_image, rendered, tmp_path):
    out, plan, model = rendered
    override = tmp_path / "override.yaml"
    services = {r["name"]: {"image": base_image, "entrypoint": ["python3", "-B", "-"]} for r in plan["replicas"]}
    override.write_text(yaml.safe_dump({"services": services}))
    project = f"deploykit-test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "MODEL_DIR": str(model)}
    base_cmd = [compose_cli, "-p", project, "-f", str(out / "compose.yaml"), "-f", str(override)]
    try:
        for r in plan["replicas"]:
            done = subprocess.run([*base_cmd, "run", "--rm", "-T", "--no-deps", r["name"]], input=PROBE,
                                  capture_output=True, text=True, env=env, timeout=180, cwd=out)
            assert done.returncode == 0, done.stderr
            seen = json.loads(done.stdout.strip().splitlines()[-1])
            assert seen["cpus_allowed_list"] == cpuset(r)
            # No cpuset-mems in compose: Docker leaves every node allowed and the engine binds memory itself,
            # which the NUMA syscalls below make possible.
            assert {n: seen["syscalls"][n] for n in NUMA_CALLS} == {n: 0 for n in NUMA_CALLS}
            assert (seen["uid"], seen["root_write_errno"], seen["no_new_privs"]) == (10001, errno.EROFS, "1")
            assert int(seen["cap_bnd"], 16) == int(seen["cap_eff"], 16) == 0
    finally:
        subprocess.run([*base_cmd, "down", "--remove-orphans"], capture_output=True, env=env, timeout=120, cwd=out)


def test_every_golden_compose_file_is_valid_for_docker_compose(compose_cli, tmp_path):
    golden = REPO / "tests" / "golden"
    checked = 0
    for case in sorted(golden.iterdir()):
        if not (case / "compose.yaml").is_file():  # tests/golden/plans holds plans only
            continue
        work = tmp_path / case.name
        shutil.copytree(case, work)
        env = {k: v for k, v in os.environ.items() if k != "DEPLOYKIT_API_KEY"} | {"MODEL_DIR": str(tmp_path)}
        config = [compose_cli, "-f", str(work / "compose.yaml"), "config", "-q"]
        if "DEPLOYKIT_API_KEY:?" in (work / "compose.yaml").read_text():
            # A deployment whose key lives in a secret must not start unprotected when the key is not exported.
            refused = subprocess.run(config, capture_output=True, text=True, env=env, timeout=60, cwd=work)
            assert refused.returncode != 0 and "export DEPLOYKIT_API_KEY" in refused.stderr, case.name
            env["DEPLOYKIT_API_KEY"] = "k"
        done = subprocess.run(config, capture_output=True, text=True, env=env, timeout=60, cwd=work)
        assert done.returncode == 0, f"{case.name}: {done.stderr}"
        checked += 1
    assert checked >= 5
