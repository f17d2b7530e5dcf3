"""`deploykit up --runtime local` end to end on this host: two single-CPU engine replicas (on a 2-CPU host planned
with `replicas_per_node: 2`) behind the built-in proxy,
a chat completion from the `openai` client, each replica on its own CPU, `up` twice changes nothing, `status`,
`logs`, a changed spec, a crashed replica shown by `status`, `down` leaving nothing; and the failure paths: a corrupt
model (the engine's own error, non-zero exit, nothing left) and Ctrl-C during `up`.

Heavy (real engines): run under the heavy-job lock.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from deploykit.runtime.local import MARKER
from tests.runtime.helpers import ROOT, Load, corrupt_copy, deploykit, free_port, nothing_listens, spec_file
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
NAME = "dkloc"
KEY = "local-test-key"  # the spec names the variable; the value only ever lives in the environment


@dataclass
class Local:
    spec: Path
    env: dict
    port: int
    state: Path
    first_up: subprocess.CompletedProcess

    def processes(self, name: str = NAME) -> dict[str, int]:
        data = json.loads((self.state / name / "state.json").read_text())
        return {p["name"]: p["pid"] for p in data["processes"]}

    def status(self) -> dict:
        r = deploykit("status", NAME, "--format", "json", env=self.env)
        assert r.returncode == 0, r.stderr
        return {m["member"]: m for m in json.loads(r.stdout)["members"]}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY, max_retries=0, timeout=60)


def _marked(state_dir: Path) -> list[int]:
    marker = f"{MARKER}={state_dir}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            zombie = (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            if marker in (d / "environ").read_bytes().split(b"\0") and not zombie:
                found.append(int(d.name))
        except OSError:
            continue
    return found


def _chat(client: openai.OpenAI) -> str:
    reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
    assert reply.choices[0].finish_reason in ("length", "stop")
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def local(tmp_path_factory, tiny_model):
    base = tmp_path_factory.mktemp("local")
    port = free_port(3)
    spec = spec_file(base / "spec.yaml", NAME, tiny_model, port, serving={"api_key": {"env": "DKLOC_KEY"}})
    env = {"DEPLOYKIT_STATE_DIR": str(base / "state"), "DEPLOYKIT_LOCAL_LB": "builtin", "DKLOC_KEY": KEY}
    r = deploykit("up", spec, "--runtime", "local", env=env)
    try:
        assert r.returncode == 0, r.stderr
        yield Local(spec, env, port, base / "state", r)
    finally:
        deploykit("down", NAME, env=env)


def test_up_prints_the_endpoint_and_serves_chat_through_the_proxy(local):
    out = local.first_up.stdout
    assert f"endpoint: http://127.0.0.1:{local.port}/v1" in out
    assert f"curl -s http://127.0.0.1:{local.port}/v1/chat/completions" in out and "from openai import OpenAI" in out
    assert 'Authorization: Bearer $DKLOC_KEY' in out and 'os.environ["DKLOC_KEY"]' in out and KEY not in out
    assert "runtime: local" in local.first_up.stderr
    client = local.client()
    assert isinstance(_chat(client), str)
    with pytest.raises(openai.AuthenticationError):  # the key reached the engines
        openai.OpenAI(base_url=f"http://127.0.0.1:{local.port}/v1", api_key="wrong", max_retries=0).models.list()
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
    assert len(chunks) >= 2


def test_each_replica_runs_on_its_own_cpu(local):
    plan = json.loads((local.state / NAME / "rendered" / "plan.json").read_text())
    if len(os.sched_getaffinity(0)) == 2:  # planned by replicas_per_node: 2, one thread each
        assert plan["layout"]["replicas_per_node"] == 2 and [r["cpus"] for r in plan["replicas"]] == ["0", "1"]
    procs = local.processes()
    for i in (0, 1):
        status = Path(f"/proc/{procs[f'{NAME}-{i}']}/status").read_text()
        assert f"Cpus_allowed_list:\t{i}\n" in status


def test_up_again_changes_nothing(local):
    before = local.processes()
    r = deploykit("up", local.spec, "--runtime", "local", env=local.env)
    assert r.returncode == 0, r.stderr
    assert local.processes() == before
    assert "0 started, 3 unchanged" in r.stderr


def test_status_shows_both_replicas_healthy_on_their_planned_cpus(local):
    rows = local.status()
    assert set(rows) == {f"{NAME}-0", f"{NAME}-1", f"{NAME}-lb"}
    for i in (0, 1):
        row = rows[f"{NAME}-{i}"]
        assert (row["state"], row["health"]) == ("running", "healthy")
        assert row["plan_cpus"] == row["engine_cpus"] == str(i)
        assert row["plan_mems"] == "0" and row["engine_mems"].startswith("0")
        assert row["running"] == 0 and isinstance(row["tokens_per_s"], float)
    assert rows[f"{NAME}-lb"]["health"] == "healthy"
    table = deploykit("status", NAME, env=local.env).stdout
    assert "CPUS (PLAN)" in table and "CPUS (ENGINE)" in table and "TOK/S" in table
    # /debug/binding needs the key: without it in the environment, status says so instead of guessing
    r = deploykit("status", NAME, "--format", "json", env={**local.env, "DKLOC_KEY": ""})
    row = {m["member"]: m for m in json.loads(r.stdout)["members"]}[f"{NAME}-0"]
    assert row["engine_cpus"] is None and "export DKLOC_KEY" in row["detail"]


def test_logs_of_one_replica_and_of_all(local):
    r = deploykit("logs", NAME, "1", "--tail", "50", env=local.env)
    assert r.returncode == 0 and "deploykit up:" in r.stdout and "engine ready" in r.stdout, r.stdout
    r = deploykit("logs", NAME, env=local.env)
    assert f"{NAME}-0 | " in r.stdout and f"{NAME}-lb | deploykit-proxy" in r.stdout
    r = deploykit("logs", NAME, "7", env=local.env)
    assert r.returncode == 7 and "no such replica" in r.stderr
    follow = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "logs", NAME, "0", "-f", "--tail", "0"],
                              cwd=ROOT, env={**os.environ, **local.env}, stdout=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(follow.stdout.readline, "")), daemon=True)
    reader.start()

    def followed_a_chat() -> bool:  # least connections over two idle replicas: some chats reach replica 0
        _chat(local.client())
        return any("POST /v1/chat/completions" in line for line in out)
    try:
        wait_until(followed_a_chat, timeout=60, interval=0.5, what="`logs -f` to print a chat request")
    finally:
        follow.send_signal(signal.SIGINT)
    assert follow.wait(timeout=30) == 130


def test_bench_finds_the_deployment_and_reports_each_replicas_metrics(local, tmp_path):
    # after the logs test: bench's requests fill the replicas' access logs past its --tail 50
    r = deploykit("bench", NAME, "--concurrency", "2", "--requests", "6", "--max-tokens", "4", "--prompt-tokens", "8",
                  "--warmup", "0", "--no-progress", "--out", tmp_path / "r.json", env=local.env)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["server"]["url"] == f"http://127.0.0.1:{local.port}" and doc["server"]["deployment"] == NAME
    [lv] = doc["levels"]
    assert (lv["requests"], lv["errors"], lv["output_tokens"]) == (6, 0, 24)
    metrics = lv["replica_metrics"]
    assert set(metrics) == {f"{NAME}-0", f"{NAME}-1"}
    # the replicas' own counters account for every token and request the client saw
    assert sum(m["deltas"].get("deploykit_generation_tokens_total", 0) for m in metrics.values()) == 24
    assert sum(m["deltas"].get("deploykit_request_success_total", 0) for m in metrics.values()) == 6
    assert all("deploykit_kv_cache_usage_ratio" in m["peaks"] for m in metrics.values())
    assert re.search(rf"{NAME}-[01]: deploykit_generation_tokens_total \+", r.stdout), r.stdout


def test_a_changed_spec_replaces_the_replicas_one_at_a_time_and_keeps_the_proxy(local):
    before = local.processes()
    local.spec.write_text(local.spec.read_text().replace("max_num_seqs: 4", "max_num_seqs: 2"))
    # The built-in proxy balances connections, not requests: a draining replica's 503 reaches the client, which
    # retries (the openai client's default). nginx retries those itself (the Docker test asserts zero errors).
    with Load(local.port, NAME, KEY, retries=2) as load:
        r = deploykit("up", local.spec, "--runtime", "local", env=local.env)
    assert r.returncode == 0, r.stderr
    assert load.errors == [] and load.ok > 0, load.errors[:3]
    assert r.stderr.index(f"{NAME}-0: waiting until it is healthy") < r.stderr.index(f"{NAME}-1: stopping")
    after = local.processes()
    assert after[f"{NAME}-lb"] == before[f"{NAME}-lb"]
    assert after[f"{NAME}-0"] != before[f"{NAME}-0"] and after[f"{NAME}-1"] != before[f"{NAME}-1"]
    assert not any(Path(f"/proc/{before[n]}").exists() for n in (f"{NAME}-0", f"{NAME}-1"))
    assert isinstance(_chat(local.client()), str)


def test_a_crashed_replica_shows_in_status_and_the_next_up_restarts_only_it(local):
    procs = local.processes()
    os.kill(procs[f"{NAME}-1"], signal.SIGKILL)
    rows = wait_until(lambda: (r := local.status())[f"{NAME}-1"]["state"] == "exited" and r, timeout=30,
                      interval=0.2, what="status to show the killed replica exited")
    assert rows[f"{NAME}-1"]["state"] == "exited" and rows[f"{NAME}-1"]["health"].startswith("no answer")
    assert rows[f"{NAME}-0"]["health"] == "healthy"
    assert isinstance(_chat(local.client()), str)  # the proxy routes around it
    r = deploykit("up", local.spec, "--runtime", "local", env=local.env)
    assert r.returncode == 0, r.stderr
    assert "is gone; cleaning up its stale state" in r.stderr
    after = local.processes()
    assert after[f"{NAME}-1"] != procs[f"{NAME}-1"]
    assert after[f"{NAME}-0"] == procs[f"{NAME}-0"] and after[f"{NAME}-lb"] == procs[f"{NAME}-lb"]


def test_down_leaves_nothing(local):
    pids = local.processes()
    r = deploykit("down", NAME, env=local.env)
    assert r.returncode == 0, r.stderr
    assert all(f"stopped {n}" in r.stdout for n in pids)
    assert not _marked(local.state / NAME)
    assert all(nothing_listens(local.port + i) for i in range(3))
    assert deploykit("status", NAME, env=local.env).returncode == 7


def test_a_corrupt_model_fails_with_the_engines_error_and_leaves_nothing(tmp_path, tiny_model):
    model = corrupt_copy(tiny_model, tmp_path / "corrupt")
    port = free_port(3)
    spec = spec_file(tmp_path / "spec.yaml", "dkbad", model, port)
    env = {"DEPLOYKIT_STATE_DIR": str(tmp_path / "state"), "DEPLOYKIT_LOCAL_LB": "builtin"}
    r = deploykit("up", spec, "--runtime", "local", "--timeout", "300", "--keep-on-failure", env=env)
    assert r.returncode == 7 and "left as it is (--keep-on-failure)" in r.stderr, r.stderr
    assert _marked(tmp_path / "state" / "dkbad")  # the proxy still runs, for inspection
    assert deploykit("down", "dkbad", env=env).returncode == 0 and not _marked(tmp_path / "state" / "dkbad")
    r = deploykit("up", spec, "--runtime", "local", "--timeout", "300", env=env)
    assert r.returncode == 7, r.stderr
    assert "exited during start-up" in r.stderr and "its last log lines" in r.stderr
    assert "ERROR" in r.stderr and "Traceback" not in r.stderr.split("its last log lines")[0]
    assert not _marked(tmp_path / "state" / "dkbad")
    assert all(nothing_listens(port + i) for i in range(3))
    assert not (tmp_path / "state" / "dkbad" / "state.json").exists()  # `status` does not list it as up


def test_a_timeout_shows_the_replicas_logs_and_leaves_nothing(tmp_path, tiny_model):
    port = free_port(3)
    spec = spec_file(tmp_path / "spec.yaml", "dkslow", tiny_model, port)
    env = {"DEPLOYKIT_STATE_DIR": str(tmp_path / "state"), "DEPLOYKIT_LOCAL_LB": "builtin"}
    r = deploykit("up", spec, "--runtime", "local", "--timeout", "0.5", env=env)  # loading takes seconds
    assert r.returncode == 7, r.stderr
    assert "not healthy within 0.5s" in r.stderr and "last log lines" in r.stderr and "--timeout SECONDS" in r.stderr
    assert not _marked(tmp_path / "state" / "dkslow") and all(nothing_listens(port + i) for i in range(3))


def test_ctrl_c_during_up_stops_cleanly(tmp_path, tiny_model):
    port = free_port(3)
    spec = spec_file(tmp_path / "spec.yaml", "dkint", tiny_model, port)
    env = {**os.environ, "DEPLOYKIT_STATE_DIR": str(tmp_path / "state"), "DEPLOYKIT_LOCAL_LB": "builtin"}
    proc = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "up", str(spec), "--runtime", "local"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = tmp_path / "state" / "dkint" / "state.json"
    wait_until(lambda: state.exists() and json.loads(state.read_text())["processes"], timeout=120,
               what="up to start a process")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted: undoing" in err
    assert not _marked(tmp_path / "state" / "dkint")
    assert all(nothing_listens(port + i) for i in range(3))


@pytest.mark.skipif(shutil.which("nginx") is None, reason="no nginx binary on PATH (scripts/test installs nginx-light)")
def test_nginx_is_the_load_balancer_when_it_is_installed(tmp_path, tiny_model):
    port = free_port(3)
    spec = spec_file(tmp_path / "spec.yaml", "dkngx", tiny_model, port)
    env = {"DEPLOYKIT_STATE_DIR": str(tmp_path / "state"), "DEPLOYKIT_LOCAL_LB": ""}
    r = deploykit("up", spec, "--runtime", "local", env=env)
    try:
        assert r.returncode == 0, r.stderr
        lb = json.loads((tmp_path / "state" / "dkngx" / "state.json").read_text())["processes"]
        pid = next(p["pid"] for p in lb if p["replica"] is None)
        assert Path(f"/proc/{pid}/exe").resolve().name == "nginx"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model="dkngx", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, stream=True, extra_body={"ignore_eos": True})
        assert len([c for c in stream if c.choices and c.choices[0].delta.content]) >= 2
        rows = json.loads(deploykit("status", "dkngx", "--format", "json", env=env).stdout)["members"]
        assert {m["member"]: m["health"] for m in rows}["dkngx-lb"] == "healthy"
    finally:
        r = deploykit("down", "dkngx", env=env)
    assert r.returncode == 0 and "stopped dkngx-lb" in r.stdout, r.stdout + r.stderr
    assert not _marked(tmp_path / "state" / "dkngx") and all(nothing_listens(port + i) for i in range(3))
