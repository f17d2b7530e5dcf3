"""`deploykit up` refuses common mistakes before starting anything: exit code from the one table, the field, the
value and the fix, no traceback, and nothing left running."""

from __future__ import annotations

import socket

import pytest

from tests.runtime.helpers import deploykit, free_port, spec_file


def _env(tmp_path, **extra):
    return {"DEPLOYKIT_STATE_DIR": str(tmp_path / "state"), **extra}


@pytest.mark.slow
def test_docker_not_running_says_how_to_start_it(tmp_path, tiny_model):
    spec = spec_file(tmp_path / "s.yaml", "dkerr", tiny_model, free_port(3))
    r = deploykit("up", spec, "--runtime", "docker", env=_env(tmp_path, DOCKER_HOST=f"unix://{tmp_path}/no.sock"))
    assert r.returncode == 7, r.stderr
    assert "Docker is not running" in r.stderr and "systemctl start docker" in r.stderr
    assert "--runtime local" in r.stderr and "Traceback" not in r.stderr


def test_auto_says_it_falls_back_to_local_and_a_port_in_use_is_named(tmp_path, tiny_model):
    port = free_port(3)
    spec = spec_file(tmp_path / "s.yaml", "dkerr", tiny_model, port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port + 2))
        s.listen()
        r = deploykit("up", spec, env=_env(tmp_path, DOCKER_HOST=f"unix://{tmp_path}/no.sock"))
    assert r.returncode == 7, r.stderr
    assert "runtime: local, because Docker is not available" in r.stderr
    assert f"port {port + 2} on 127.0.0.1 is already in use" in r.stderr and "serving.port" in r.stderr
    assert "Traceback" not in r.stderr
    assert "started" not in r.stderr  # refused before any process started


def test_cpus_the_host_does_not_have(tmp_path, tiny_model):
    hardware = {"threads_per_core": 1, "isa": ["avx512f"],
                "numa_nodes": [{"id": 0, "socket": 0, "cpus": "0-63", "memory": "64GiB"}]}
    spec = spec_file(tmp_path / "s.yaml", "dkerr", tiny_model, free_port(3), cpus=["60", "61"], hardware=hardware)
    r = deploykit("up", spec, "--runtime", "local", env=_env(tmp_path))
    assert r.returncode == 5, r.stderr
    assert "planned on CPUs this process's cpuset does not have" in r.stderr and "60" in r.stderr
    assert "hardware: auto" in r.stderr


def test_missing_model_and_missing_api_key(tmp_path, tiny_model):
    spec = spec_file(tmp_path / "s.yaml", "dkerr", tiny_model, free_port(3),
                     serving={"api_key": {"env": "DKERR_KEY"}})
    r = deploykit("up", spec, "--runtime", "local", env=_env(tmp_path))
    assert r.returncode == 2 and "export DKERR_KEY" in r.stderr, r.stderr
    spec = spec_file(tmp_path / "s.yaml", "dkerr", tiny_model, free_port(3))
    gone = tmp_path / "gone"
    spec.write_text(spec.read_text().replace(str(tiny_model), str(gone)))
    r = deploykit("up", spec, "--runtime", "local", env=_env(tmp_path))
    assert r.returncode == 4 and "model.source" in r.stderr, r.stderr


def test_status_logs_and_down_of_nothing(tmp_path):
    env = _env(tmp_path)
    r = deploykit("status", "nothing-here", "--runtime", "local", env=env)
    assert r.returncode == 7 and "is not up" in r.stderr and "deploykit up SPEC" in r.stderr
    r = deploykit("status", env=env)
    assert r.returncode == 7 and "no deployment is up" in r.stderr
    r = deploykit("down", "nothing-here", "--runtime", "local", env=env)
    assert r.returncode == 0 and "nothing to remove" in r.stdout
