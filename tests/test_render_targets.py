"""run.sh and compose.yaml describe the same containers: what one says about CPUs, memory, privileges, mounts and
environment, the other says too (run.sh executed against a recording `docker`, compose.yaml parsed as YAML)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from deploykit import cpulist, render
from deploykit.cli import load_plan
from deploykit.render import output
from tests.render.cases import CASES, write_spec

RECORDER = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["DOCKER_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit(1 if "inspect" in sys.argv[1:3] else 0)
"""


def rendered(case: str, tmp_path: Path, sysroots) -> tuple[Path, dict]:
    machine, sections = CASES[case]
    spec = write_spec(tmp_path, sections)
    _, _, plan = load_plan(str(spec), str(sysroots[machine]))
    out = tmp_path / "out"
    output.write(out, render.render(plan, render.TARGETS))
    return out, plan.to_dict()


def docker_runs(out: Path, tmp_path: Path, api_key: str | None = "test-key") -> dict[str, list[str]]:
    rec = tmp_path / "docker"
    rec.write_text(RECORDER)
    rec.chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "DOCKER": str(rec), "DOCKER_LOG": str(log), "MODEL_DIR": "/models/m", "IMAGE": "img:1"}
    env.pop("DEPLOYKIT_API_KEY", None)
    if api_key is not None:
        env["DEPLOYKIT_API_KEY"] = api_key
    done = subprocess.run(["bash", str(out / "run.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    made = {a[a.index("--name") + 1]: a for a in runs if a[0] in ("run", "create")}
    for a in runs:  # `network connect --alias NAME NETWORK NAME`: recorded as the container's --network flags
        if a[:2] == ["network", "connect"]:
            made[a[-1]] += ["--network", a[-2]]
    return made


def values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_run_sh_and_compose_agree(case, tmp_path, sysroots):
    out, plan = rendered(case, tmp_path, sysroots)
    runs = docker_runs(out, tmp_path)
    services = yaml.safe_load((out / "compose.yaml").read_text())["services"]
    assert set(runs) == set(services)
    for name, argv in runs.items():
        svc = services[name]
        assert values(argv, "--cpuset-cpus") == ([svc["cpuset"]] if "cpuset" in svc else [])
        assert values(argv, "--memory") == [str(svc["mem_limit"])]
        assert values(argv, "--cap-add") == svc.get("cap_add", [])
        assert values(argv, "--cap-drop") == svc["cap_drop"] == ["ALL"]
        assert values(argv, "--tmpfs") == svc["tmpfs"]
        assert values(argv, "--user") == [svc["user"]]
        assert ("--read-only" in argv) == svc["read_only"]
        assert values(argv, "--publish") == svc.get("ports", [])
        assert values(argv, "--network") == [f"{plan['name']}-{net}" for net in svc["networks"]]
        assert sorted(values(argv, "--sysctl")) == sorted(f"{k}={v}" for k, v in svc.get("sysctls", {}).items())
        env = dict(e.split("=", 1) if "=" in e else (e, None) for e in values(argv, "--env"))
        by_name = {k: None if str(v).startswith(f"${{{k}:?") else v for k, v in svc.get("environment", {}).items()}
        assert env == by_name
        mounts = [v.replace(str(out), ".").replace("/models/m", "MODEL") for v in values(argv, "--volume")]
        assert [m.split(":", 1)[1] for m in mounts] == [v.rsplit(":", 2)[-2] + ":ro" for v in svc["volumes"]]
        sec_run = [s.replace(str(out), ".") for s in values(argv, "--security-opt")]
        assert sorted(s.replace("no-new-privileges", "no-new-privileges:true") for s in sec_run) == \
            sorted(svc["security_opt"])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_replicas_get_plan_cpus_mems_and_their_index(case, tmp_path, sysroots):
    out, plan = rendered(case, tmp_path, sysroots)
    runs = docker_runs(out, tmp_path)
    for r in plan["replicas"]:
        argv = runs[r["name"]]
        cpus, front = cpulist.parse(r["cpus"]), cpulist.parse(r["frontend_cpus"])
        assert values(argv, "--cpuset-cpus") == [cpulist.format(cpus + front)]
        assert values(argv, "--cpuset-mems") == [r["mems"]]
        env = dict(e.split("=", 1) for e in values(argv, "--env") if "=" in e)
        assert env["DEPLOYKIT_REPLICA"] == str(r["index"])
        # the placement, derived from the plan's fields where the container is rendered
        assert (env["DEPLOYKIT_CPUS"], env["DEPLOYKIT_FRONTEND_CPUS"], env["DEPLOYKIT_MEMS"]) == \
            (r["cpus"], r["frontend_cpus"], r["mems"])
        assert env["OMP_NUM_THREADS"] == str(r["omp_threads"]) == str(len(cpus))
        # Only on the internal network, no port of its own: clients reach it through nginx.
        assert values(argv, "--publish") == [] and values(argv, "--network") == [f"{plan['name']}-internal"]
    lb = runs[f"{plan['name']}-lb"]
    assert values(lb, "--publish") == [f"{plan['serving']['publish_address']}:{plan['serving']['port']}:"
                                       f"{plan['serving']['port']}"]
    assert values(lb, "--network") == [f"{plan['name']}-edge", f"{plan['name']}-internal"]


@pytest.mark.slow
def test_seccomp_modes(tmp_path, sysroots):
    seen = {}
    for case in ("one-replica-two-cpu", "custom-base", "local-model-unconfined"):
        out, plan = rendered(case, tmp_path / case, sysroots)
        argv = docker_runs(out, tmp_path / case)[plan["replicas"][0]["name"]]
        seen[plan["security"]["seccomp"]] = [s for s in values(argv, "--security-opt") if s.startswith("seccomp")]
        if plan["security"]["seccomp"] == "unconfined":
            assert "WARNING" in (out / "run.sh").read_text() and "WARNING" in (out / "compose.yaml").read_text()
    assert seen["least-privilege"] == [f"seccomp={tmp_path / 'one-replica-two-cpu' / 'out' / 'seccomp.json'}"]
    assert seen["runtime-default"] == []
    assert seen["unconfined"] == ["seccomp=unconfined"]


@pytest.mark.slow
def test_api_key_is_passed_by_name_only(tmp_path, sysroots):
    out, plan = rendered("two-replicas-2socket", tmp_path, sysroots)
    runs = docker_runs(out, tmp_path, api_key="sk-secret-value")
    for r in plan["replicas"]:
        assert "DEPLOYKIT_API_KEY" in values(runs[r["name"]], "--env")
    assert not any("sk-secret-value" in " ".join(a) for a in runs.values())
    services = yaml.safe_load((out / "compose.yaml").read_text())["services"]
    for r in plan["replicas"]:  # compose interpolates it from the caller's environment, and refuses if unset
        assert services[r["name"]]["environment"]["DEPLOYKIT_API_KEY"].startswith("${DEPLOYKIT_API_KEY:?")
    with pytest.raises(AssertionError, match="requires an API key"):
        docker_runs(out, tmp_path, api_key=None)  # never start an engine that would serve without its key


def test_api_key_from_a_kubernetes_secret_still_protects_docker_targets(tmp_path, sysroots):
    from deploykit import memory, planner, specfile, topology
    from tests.conftest import make_spec
    spec = specfile.from_data(make_spec(serving={"api_key": {"secret": "llm-key"}}))
    plan = planner.make_plan(spec, topology.read(sysroots["two-cpu"]), memory.shape(spec.model))
    assert plan.serving.api_key_env == "DEPLOYKIT_API_KEY" and plan.serving.api_key_secret == ("llm-key", "api-key")


@pytest.mark.slow
def test_stopping_gives_engines_time_to_drain_and_nginx_a_graceful_quit(tmp_path, sysroots):
    """SIGTERM drains in-flight requests for up to 30 s; Docker's default 10 s before SIGKILL would cut them."""
    out, plan = rendered("two-replicas-2socket", tmp_path, sysroots)
    runs = docker_runs(out, tmp_path)
    services = yaml.safe_load((out / "compose.yaml").read_text())["services"]
    lb = f"{plan['name']}-lb"
    for name, argv in runs.items():
        assert values(argv, "--stop-timeout") == ["50"] and services[name]["stop_grace_period"] == "50s"
        want = ["SIGQUIT"] if name == lb else []  # nginx's graceful stop finishes the streams it proxies
        assert values(argv, "--stop-signal") == want and services[name].get("stop_signal") == (want or [None])[0]
    text = (out / "run.sh").read_text()
    assert '"$DOCKER" stop $ids' in text and '"$DOCKER" stop "$1"' in text  # down / re-run: stop, then remove
