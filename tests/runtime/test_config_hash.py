"""`up` replaces exactly what a changed spec changes: each member's config hash covers what it runs with and the part
of plan.json it reads, and nothing else. Also: the Docker create arguments carry every setting of the Container."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deploykit import render
from deploykit.render import output
from deploykit.runtime.deployment import Deployment
from deploykit.runtime.docker import DockerRuntime, _config_hash
from deploykit.runtime.state import StateDir
from tests.plans import make_plan, replica


def _plan(**changes):
    cpus1 = changes.pop("cpus1", [1])
    plan = make_plan([replica(0, [0], [], [0], 1 << 26), replica(1, cpus1, [], [0], 1 << 26)], api_key_env="DK_KEY")
    return dataclasses.replace(plan, serving=dataclasses.replace(plan.serving, **changes)) if changes else plan


def _deployment(tmp_path, plan, salt=b"salt" * 4) -> Deployment:
    sd = StateDir(tmp_path / "state", plan.name)
    output.write(sd.rendered, render.render(plan, ("docker", "compose")), force=True)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return Deployment(plan, sd, str(model), "spec.yaml", salt)


def _hashes(tmp_path, plan, **kw) -> dict[str, str]:
    """Rendered into the same state directory each time, as a second `up` of the deployment would."""
    d = _deployment(tmp_path, plan, **kw)
    rt = DockerRuntime(None, "test")
    return {m.name: _config_hash(d, m, rt._settings(d, m, "img:1")) for m in d.members}


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("DK_KEY", "secret-1")


def test_same_plan_same_hashes(tmp_path):
    assert _hashes(tmp_path, _plan()) == _hashes(tmp_path, _plan())


def test_one_replica_changed_replaces_only_that_replica(tmp_path):
    before, after = _hashes(tmp_path, _plan()), _hashes(tmp_path, _plan(cpus1=[2]))
    assert before["test-0"] == after["test-0"]
    assert before["test-1"] != after["test-1"]
    assert before["test-lb"] == after["test-lb"]  # nginx.conf names the replicas, not their CPUs


def test_a_serving_setting_replaces_the_replicas_not_the_load_balancer(tmp_path):
    before, after = _hashes(tmp_path, _plan()), _hashes(tmp_path, _plan(max_num_seqs=8))
    assert before["test-0"] != after["test-0"] and before["test-1"] != after["test-1"]
    assert before["test-lb"] == after["test-lb"]


def test_the_port_replaces_the_load_balancer(tmp_path):
    before, after = _hashes(tmp_path, _plan()), _hashes(tmp_path, _plan(port=9000))
    assert before["test-lb"] != after["test-lb"]


def test_a_new_api_key_replaces_the_replicas_but_the_key_never_appears(tmp_path, monkeypatch):
    before = _hashes(tmp_path, _plan())
    monkeypatch.setenv("DK_KEY", "secret-2")
    after = _hashes(tmp_path, _plan())
    assert before["test-0"] != after["test-0"] and before["test-lb"] == after["test-lb"]
    d = _deployment(tmp_path, _plan())
    hashed = {**DockerRuntime(None, "test")._settings(d, d.members[0], "img:1"),
              "environment": d.hashed_env(d.members[0].container)}
    assert "secret-2" not in json.dumps(hashed)


def test_the_salt_keeps_hashes_of_one_deployment_apart_from_another(tmp_path):
    assert _hashes(tmp_path, _plan()) != _hashes(tmp_path, _plan(), salt=b"other" * 4)


def test_the_image_replaces_everything(tmp_path):
    d = _deployment(tmp_path, _plan())
    rt = DockerRuntime(None, "test")
    for m in d.members:
        assert _config_hash(d, m, rt._settings(d, m, "img:1")) != _config_hash(d, m, rt._settings(d, m, "img:2"))


def test_docker_create_arguments_carry_every_container_setting(tmp_path):
    d = _deployment(tmp_path, _plan())
    rt = DockerRuntime(None, "test")
    replica0, lb = d.members[0], d.members[-1]
    s = rt._settings(d, replica0, "img:1")
    hc = s["host_config"]
    assert (hc["cpuset_cpus"], hc["cpuset_mems"]) == ("0", "0")
    assert hc["mem_limit"] == hc["memswap_limit"] == 4 << 30
    assert hc["cap_drop"] == ["ALL"] and hc["cap_add"] == (list(replica0.container.caps_add) or None)
    assert hc["security_opt"][0] == "no-new-privileges"
    assert hc["security_opt"][1] == "seccomp=" + (d.state.rendered / "seccomp.json").read_text()
    assert hc["read_only"] is True and hc["tmpfs"] == {"/tmp": "rw,nosuid,nodev,size=1g"}
    assert hc["restart_policy"] == {"Name": "unless-stopped"}
    assert hc["port_bindings"] is None and s["ports"] == [] and s["networks"] == ["test-internal"]  # not published
    assert hc["sysctls"] is None
    assert hc["binds"] == {str(tmp_path / "model"): {"bind": "/model", "mode": "ro"},
                           str(d.state.rendered / "plan.json"): {"bind": "/etc/deploykit/plan.json", "mode": "ro"}}
    assert s["environment"]["DK_KEY"] == "secret-1"  # passed by name from our environment, as run.sh does
    assert s["environment"]["DEPLOYKIT_REPLICA"] == "0" and s["environment"]["DEPLOYKIT_CPUS"] == "0"
    assert s["labels"] == {"deploykit.deployment": "test", "deploykit.replica": "0"}
    assert s["user"] == "10001:10001" and s["stop_timeout"] == 50 and s["entrypoint"] is None
    s = rt._settings(d, lb, "img:1")
    assert s["entrypoint"] == ["/usr/sbin/nginx"]
    assert s["command"] == ["-e", "stderr", "-c", "/etc/deploykit/nginx.conf"]
    assert s["stop_signal"] == "SIGQUIT" and s["labels"]["deploykit.replica"] == "lb"
    # The only published port, on the edge network and the engines' internal one; fails fast on a vanished replica.
    assert s["host_config"]["port_bindings"] == {8000: ("127.0.0.1", 8000)} and s["ports"] == [8000]
    assert s["networks"] == ["test-edge", "test-internal"]
    assert s["host_config"]["sysctls"]["net.ipv4.tcp_keepalive_time"] == "2"
    assert s["host_config"]["binds"] == {str(d.state.rendered / "nginx.conf"): {"bind": "/etc/deploykit/nginx.conf",
                                                                                "mode": "ro"}}
