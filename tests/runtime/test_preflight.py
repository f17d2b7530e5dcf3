"""Mistakes `up` catches before starting anything, each with the field, the value and the fix."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from deploykit.errors import ModelError, PlanError, RuntimeFailure, SpecError
from deploykit.runtime import preflight
from deploykit.runtime.deployment import Deployment
from deploykit.runtime.state import StateDir
from tests.plans import make_plan, replica


def _model(tmp_path, mode=0o644):
    m = tmp_path / "model"
    m.mkdir()
    for name in ("config.json", "model.safetensors"):
        (m / name).write_text("{}")
        (m / name).chmod(mode)
    return m


@pytest.mark.skipif(os.geteuid() != 0, reason="needs files owned by another user than the container's UID")
def test_model_unreadable_by_the_containers_uid(tmp_path):
    m = _model(tmp_path, 0o600)  # owned by root, the container runs as 10001
    with pytest.raises(ModelError) as e:
        preflight.model_readable(str(m), 10001)
    text = str(e.value)
    assert "model.source" in text and "UID 10001" in text and "config.json" in text and "mode 0600" in text
    assert f"chmod -R a+rX {m}" in text
    (m / "config.json").chmod(0o644)
    (m / "model.safetensors").chmod(0o644)
    preflight.model_readable(str(m), 10001)
    m.chmod(0o700)  # the directory itself: the container cannot list it
    with pytest.raises(ModelError):
        preflight.model_readable(str(m), 10001)


def test_model_links_leaving_the_directory_are_refused_for_containers(tmp_path):
    m = _model(tmp_path)
    blob = tmp_path / "blobs" / "abc"
    blob.parent.mkdir()
    blob.write_text("weights")
    (m / "model.safetensors").unlink()
    (m / "model.safetensors").symlink_to(blob)
    with pytest.raises(ModelError) as e:
        preflight.model_readable(str(m), 10001)
    assert "cp -rL" in str(e.value) and "model.safetensors" in str(e.value)
    preflight.model_readable(str(m), None)  # local processes follow the link fine


def test_missing_model_and_unset_api_key(tmp_path, monkeypatch):
    plan = make_plan([replica(0, [0], [], [0], 1 << 20)], model_path=str(tmp_path / "nope"), api_key_env="DK_KEY")
    with pytest.raises(ModelError, match="not there"):
        preflight.model_path(plan)
    monkeypatch.delenv("DK_KEY", raising=False)
    with pytest.raises(SpecError) as e:
        preflight.api_key(plan)
    assert "serving.api_key" in str(e.value) and "export DK_KEY" in str(e.value)
    monkeypatch.setenv("DK_KEY", "k")
    preflight.api_key(plan)


def test_cpus_and_memory_nodes_the_host_lacks(tmp_path):
    plan = make_plan([replica(0, [0, 1], [], [0], 1 << 20), replica(1, [6, 7], [], [1], 1 << 20)])
    preflight.cpus_on_host(plan, range(8), [0, 1], "this host")
    with pytest.raises(PlanError) as e:
        preflight.cpus_on_host(plan, range(2), [0, 1], "this host")
    assert "test-1" in str(e.value) and "6-7" in str(e.value) and "allowed: 0-1" in str(e.value)
    with pytest.raises(PlanError, match="NUMA nodes"):
        preflight.cpus_on_host(plan, range(8), [0], "this host")


def test_port_in_use_unless_the_deployment_holds_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        plan = make_plan([dataclasses.replace(replica(0, [0], [], [0], 1 << 20), port=port)])
        d = Deployment(plan, StateDir(tmp_path, "test"), str(tmp_path), "spec.yaml", b"x")
        with pytest.raises(RuntimeFailure) as e:
            preflight.ports_free(d, d.members, set(), holder=lambda p: "container x of deployment y")
        text = str(e.value)
        assert f"port {port}" in text and "container x of deployment y" in text and "serving.port" in text
        preflight.ports_free(d, d.members, {port})  # ours: `up` replaces or keeps it
