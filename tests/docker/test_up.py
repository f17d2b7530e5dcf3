"""`deploykit up / status / logs / down` against the real Docker engine on this 2-CPU machine: two single-CPU
replicas behind nginx, a chat completion from the `openai` client, every plan setting on the containers, `up` twice
changes nothing (same container ids), a changed spec replaces only the replicas, a replica that vanishes under load
(cut from its network, then docker kill) fails its in-flight requests within seconds on nginx and on the built-in
proxy while every other request succeeds, and replicas silent for longer than that (paused) still finish; a second
deployment (one replica, still behind nginx on an internal network) is untouched by the first's `down`, and `down`
leaves no container or network. Failure paths: a corrupt model (the engine's own error, non-zero exit, nothing
left), a failing image build (the failing step shown), Ctrl-C during `up`.

The image is built by `up` itself (offline: the host wheelhouse of render_image.py, on deploykit-base:bookworm).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from deploykit import cpulist
from deploykit.plan import Plan
from deploykit.render.container import containers
from deploykit.render.image import BUILT_FOR_LABEL
from tests.runtime.helpers import ROOT, Load, corrupt_copy, deploykit, free_port, nothing_listens, spec_file
from tests.waiting import wait_until

try:
    from . import render_image
except ImportError:
    import render_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]
NAME, OTHER, FAILING = "dkup", "dkup2", "dkupfail"
IMAGE_NAME = "deploykit-up-test"
KEY = "docker-test-key"  # the spec names the variable; the value reaches the containers from the environment
UP_TIMEOUT = 3600  # the first run builds the engine image (torch install, kernel compile): minutes


@dataclass
class Deployed:
    spec: Path
    env: dict
    port: int
    state: Path
    model: Path
    first_up: subprocess.CompletedProcess
    image: dict

    @property
    def plan(self) -> Plan:
        return Plan.from_json((self.state / NAME / "rendered" / "plan.json").read_text())


def _client():
    import docker
    return docker.from_env(timeout=300)


def _labelled(name: str) -> tuple[list, list]:
    import docker
    c = _client()
    flt = {"label": f"deploykit.deployment={name}"}
    for _ in range(20):  # list() inspects each container it found: one that `up` or `down` removed in between is a 404
        try:
            return c.containers.list(all=True, filters=flt), c.networks.list(filters=flt)
        except docker.errors.NotFound:
            time.sleep(0.1)
    return c.containers.list(all=True, filters=flt), c.networks.list(filters=flt)


def _ids(name: str) -> dict[str, str]:
    return {c.name: c.id for c in _labelled(name)[0]}


def _chat(port: int, model: str = NAME) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8)
    assert reply.choices[0].finish_reason in ("length", "stop")
    return reply.choices[0].message.content


def _model(base: Path) -> Path:
    """A tiny random-weight model readable by the containers' UID (pytest's temp dirs are 0700)."""
    model = base / "model"
    subprocess.run([sys.executable, "-m", "engine", "tiny-model", str(model)], check=True, capture_output=True,
                   cwd=ROOT, timeout=300)
    model.chmod(0o755)
    for f in model.iterdir():
        f.chmod(0o644)
    return model


def _remove_images(built_for: str) -> None:
    c = _client()
    for image in c.images.list(filters={"label": f"{BUILT_FOR_LABEL}={built_for}"}):
        for tag in image.tags:
            try:
                c.images.remove(tag)
            except Exception:  # in use, or already gone
                pass


@pytest.fixture(scope="module")
def deployed(docker, base_image, tmp_path_factory):
    base = tmp_path_factory.mktemp("up")
    model = _model(base)
    port = free_port(3)
    image = {"name": IMAGE_NAME, "tag": "t", "base": base_image, "wheelhouse": str(render_image.wheelhouse())}
    spec = spec_file(base / "spec.yaml", NAME, model, port, image=image, serving={"api_key": {"env": "DKUP_KEY"}})
    env = {"DEPLOYKIT_STATE_DIR": str(base / "state"), "DKUP_KEY": KEY}
    start = time.monotonic()
    r = deploykit("up", spec, "--runtime", "docker", env=env, timeout=UP_TIMEOUT)
    print(f"first deploykit up: {time.monotonic() - start:.0f}s", file=sys.stderr)
    try:
        assert r.returncode == 0, r.stderr[-6000:]
        yield Deployed(spec, env, port, base / "state", model, r, image)
    finally:
        deploykit("down", NAME, "--volumes", env=env)
        deploykit("down", OTHER, "--volumes", env=env)


def test_up_serves_a_chat_completion_through_nginx(deployed):
    out = deployed.first_up.stdout
    assert f"endpoint: http://127.0.0.1:{deployed.port}/v1" in out and "curl -s" in out and "OpenAI(" in out
    err = deployed.first_up.stderr
    assert "runtime: docker" in err and ("Step 1/" in err or "up to date" in err)  # built here, or by an earlier run
    assert isinstance(_chat(deployed.port), str)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{deployed.port}/v1", api_key=KEY, max_retries=0)
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            stream=True, extra_body={"ignore_eos": True})
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) >= 2


def test_the_images_sbom_lies_next_to_the_rendered_files(deployed):
    """`up` copies the bill of materials its build wrote into the image: the Python packages (torch with its version)
    and the OS packages (nginx, which every deployment runs)."""
    bom = json.loads((deployed.state / NAME / "rendered" / "sbom.cdx.json").read_text())
    versions = {c["name"]: c.get("version") for c in bom["components"]}
    assert versions["torch"].split("+")[0] == "2.13.0" and versions["nginx"] and versions["deploykit"] == "0.1.0"
    assert bom["metadata"]["component"]["name"] == IMAGE_NAME


def test_each_replica_container_runs_on_its_own_cpu(deployed):
    c = _client()
    for r in deployed.plan.replicas:
        status = c.containers.get(r.name).exec_run(["cat", "/proc/1/status"]).output.decode()
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        assert line.split()[1] == cpulist.format(r.cpus) == str(r.index)


def test_every_plan_setting_reaches_the_containers(deployed):
    c = _client()
    rendered = deployed.state / NAME / "rendered"
    profile = (rendered / "seccomp.json").read_text()
    for want in containers(deployed.plan):
        a = c.containers.get(want.name).attrs
        hc, cfg = a["HostConfig"], a["Config"]
        assert hc["CpusetCpus"] == (want.cpuset or "") and hc["CpusetMems"] == (want.mems or "")
        assert hc["Memory"] == hc["MemorySwap"] == want.memory
        assert hc["CapDrop"] == ["ALL"] and (hc["CapAdd"] or []) == list(want.caps_add)
        assert hc["SecurityOpt"] == ["no-new-privileges", "seccomp=" + profile]
        assert hc["ReadonlyRootfs"] is want.read_only
        assert hc["Tmpfs"] == dict([want.tmpfs.split(":", 1)])
        assert hc["RestartPolicy"]["Name"] == "unless-stopped"
        assert cfg["User"] == want.user and cfg["StopTimeout"] == want.stop_seconds
        assert cfg.get("StopSignal") == want.stop_signal
        assert all(b.endswith(":ro") for b in hc["Binds"])
        assert {b.split(":")[1] for b in hc["Binds"]} == {m.target for m in want.mounts}
        # Only nginx publishes a port; the engines are on the internal network alone.
        assert sorted(a["NetworkSettings"]["Networks"]) == sorted(f"{NAME}-{role}" for role in want.networks)
        assert bool(hc["PortBindings"]) is (want.replica is None)
        assert (hc.get("Sysctls") or {}) == dict(want.sysctls)
        labels = cfg["Labels"]
        assert labels["deploykit.deployment"] == NAME and labels["deploykit.replica"] == dict(want.labels)[
            "deploykit.replica"] and len(labels["deploykit.config-hash"]) == 16
        env = dict(e.split("=", 1) for e in cfg["Env"])
        for k, v in want.env:
            assert env[k] == (KEY if v is None else v)  # None: passed by name from the caller's environment


def test_up_again_changes_nothing(deployed):
    before = _ids(NAME)
    r = deploykit("up", deployed.spec, env=deployed.env, timeout=UP_TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert _ids(NAME) == before and len(before) == 3
    assert "runtime: docker" in r.stderr  # auto keeps the deployment on its runtime
    assert "0 started, 3 unchanged" in r.stderr and "up to date" in r.stderr


def test_status_shows_both_replicas_healthy(deployed):
    r = deploykit("status", NAME, "--format", "json", env=deployed.env)
    assert r.returncode == 0, r.stderr
    rows = {m["member"]: m for m in json.loads(r.stdout)["members"]}
    for rep in deployed.plan.replicas:
        row = rows[rep.name]
        assert (row["state"], row["health"]) == ("running", "healthy")
        assert row["plan_cpus"] == row["engine_cpus"] == row["runtime_cpus"] == str(rep.index)
        assert row["engine_mems"].startswith(cpulist.format(rep.mems))
        assert isinstance(row["tokens_per_s"], float) and row["running"] == 0
    assert rows[f"{NAME}-lb"]["health"] == "healthy" and rows[f"{NAME}-lb"]["state"] == "running"


def test_logs(deployed):
    r = deploykit("logs", NAME, "0", "--tail", "200", env=deployed.env)
    assert r.returncode == 0 and "engine ready" in r.stdout, r.stdout[-2000:]
    r = deploykit("logs", NAME, "lb", env=deployed.env)
    assert r.returncode == 0 and "POST /v1/chat/completions" in r.stdout, r.stdout[-2000:]
    follow = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "logs", NAME, "-f", "--tail", "0"], cwd=ROOT,
                              env={**os.environ, **deployed.env}, stdout=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(follow.stdout.readline, "")), daemon=True)
    reader.start()

    def followed_a_chat() -> bool:  # until `logs -f` is attached, a chat's log line goes unseen: send another
        _chat(deployed.port)
        return any(line.startswith(f"{NAME}-lb | ") and "POST /v1/chat/completions" in line for line in out)
    try:
        wait_until(followed_a_chat, timeout=60, interval=0.5, what="`logs -f` to print nginx's line for a chat")
    finally:
        follow.send_signal(signal.SIGINT)
    assert follow.wait(timeout=30) == 130


def test_a_changed_spec_replaces_the_replicas_one_at_a_time_and_keeps_nginx_serving(deployed):
    before = _ids(NAME)
    deployed.spec.write_text(deployed.spec.read_text().replace("max_num_seqs: 4", "max_num_seqs: 2"))
    with Load(deployed.port, NAME, KEY, retries=0, keepalive=False) as load:  # no retries: nginx hides the update
        r = deploykit("up", deployed.spec, env=deployed.env, timeout=UP_TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert load.errors == [] and load.ok > 0, load.errors[:3]
    rolled = r.stderr.index(f"{NAME}-0: waiting until it is healthy"), r.stderr.index(f"{NAME}-1: stopping")
    assert rolled[0] < rolled[1]  # replica 1 went only once the new replica 0 served
    after = _ids(NAME)
    assert after[f"{NAME}-lb"] == before[f"{NAME}-lb"]
    assert all(after[f"{NAME}-{i}"] != before[f"{NAME}-{i}"] for i in (0, 1))
    assert set(after) == {f"{NAME}-0", f"{NAME}-1", f"{NAME}-lb"}  # no *.replaced left behind
    assert "reloaded" in r.stderr
    for _ in range(4):  # both new replicas answer through the reloaded nginx
        assert isinstance(_chat(deployed.port), str)


def test_a_port_held_by_another_deployment_is_named_before_anything_starts(deployed, tmp_path):
    spec = spec_file(tmp_path / "clash.yaml", FAILING, deployed.model, deployed.port, cpus=["1"], image=deployed.image)
    r = deploykit("up", spec, "--runtime", "docker", env=deployed.env)
    assert r.returncode == 7, r.stderr
    held = f"port {deployed.port} on 127.0.0.1 is already in use by container {NAME}-lb of deployment {NAME}"
    assert held in r.stderr
    assert "Step 1/" not in r.stderr and _labelled(FAILING) == ([], [])


def test_a_model_the_containers_uid_cannot_read(deployed, tmp_path):
    model = tmp_path / "private"
    model.mkdir(mode=0o700)  # root's, and the containers run as 10001
    for f in deployed.model.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    spec = spec_file(tmp_path / "private.yaml", FAILING, model, free_port(3), image=deployed.image)
    r = deploykit("up", spec, "--runtime", "docker", env=deployed.env)
    assert r.returncode == 4, r.stderr
    assert "model files are not readable by UID 10001" in r.stderr and f"chmod -R a+rX {model}" in r.stderr
    assert _labelled(FAILING) == ([], [])


def test_a_failed_update_brings_the_previous_containers_back(deployed, tmp_path):
    before = _ids(NAME)
    model = corrupt_copy(deployed.model, tmp_path / "corrupt")
    broken = tmp_path / "broken.yaml"
    broken.write_text(deployed.spec.read_text().replace(str(deployed.model), str(model)))
    r = deploykit("up", broken, env=deployed.env, timeout=UP_TIMEOUT)
    assert r.returncode == 7 and "exited during start-up" in r.stderr, r.stderr[-4000:]
    assert "the previous container is back" in r.stderr
    assert _ids(NAME) == before
    r = deploykit("up", deployed.spec, env=deployed.env, timeout=UP_TIMEOUT)  # waits for them to be healthy again
    assert r.returncode == 0 and _ids(NAME) == before, r.stderr[-4000:]
    assert isinstance(_chat(deployed.port), str)


PROXY = f"{NAME}-builtin"
VANISH_LIMIT = 15.0  # seconds: no request may wait longer on a replica that vanished
SILENCE = 12.0  # seconds replicas stay paused: longer than keep-alive probes take to give up on a vanished peer


@pytest.fixture
def builtin_proxy(deployed):
    """deploykit's built-in proxy (the local runtime's load balancer without nginx) in a container beside nginx, from
    the deployment's image: on the edge network with a loopback port, and on the engines' internal network."""
    c, plan, port = _client(), deployed.plan, free_port()
    backends = [a for r in plan.replicas for a in ("--backend", f"{r.name}:{plan.serving.port}")]
    ctr = c.containers.create(f"{IMAGE_NAME}:t", ["--listen", f"0.0.0.0:{plan.serving.port}", *backends],
                              entrypoint=["python", "-m", "deploykit.runtime.proxy"], name=PROXY, user="10001:10001",
                              labels={"deploykit-test": "1"}, read_only=True, cap_drop=["ALL"],
                              ports={plan.serving.port: ("127.0.0.1", port)}, network=f"{NAME}-edge")
    try:
        c.networks.get(f"{NAME}-internal").connect(ctr)
        ctr.start()
        wait_until(lambda: _answers(port), timeout=60, interval=0.5, what="the built-in proxy container to answer")
        yield port
    finally:
        ctr.remove(force=True)


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Call:
    via: str
    stream: bool
    start: float
    end: float = 0.0
    error: str = ""


def _call(port: int, via: str, stream: bool, max_tokens: int) -> Call:
    """One completion, streamed or not, read to its end; the error (if any) instead of an exception."""
    call = Call(via, stream, time.monotonic())
    body = {"model": NAME, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            text = r.read()
            if r.status_code != 200 or (stream and not text.rstrip().endswith(b"data: [DONE]")):
                call.error = f"HTTP {r.status_code}: {text[-200:]!r}"
    except httpx.HTTPError as e:
        call.error = repr(e)
    call.end = time.monotonic()
    return call


def _traffic(ports: dict[str, int], stop: threading.Event, calls: list[Call], max_tokens: int) -> list[threading.Thread]:
    """Per load balancer, two clients streaming and two not, each one request after another until `stop`."""
    def client(via: str, stream: bool) -> None:
        while not stop.is_set():
            calls.append(_call(ports[via], via, stream, max_tokens))
    threads = [threading.Thread(target=client, args=(via, stream), daemon=True)
               for via in ports for stream in (True, True, False, False)]
    for th in threads:
        th.start()
    return threads


def test_replicas_silent_longer_than_the_probes_still_finish_their_requests(deployed, builtin_proxy):
    """Both engines frozen (docker pause: what a long prefill or a long non-streaming generation looks like from
    outside, no byte for many seconds): their kernels still answer the keep-alive probes, so nothing is cut off and
    every request, streamed or not, through nginx and through the built-in proxy, finishes once they resume."""
    c = _client()
    replicas = [c.containers.get(r.name) for r in deployed.plan.replicas]
    ports = {"nginx": deployed.port, "builtin": builtin_proxy}
    for r in replicas:
        r.pause()
    try:
        calls: list[Call] = []
        threads = [threading.Thread(target=lambda v=v, s=s: calls.append(_call(ports[v], v, s, 16)))
                   for v in ports for s in (True, False)]
        for th in threads:
            th.start()
        time.sleep(SILENCE)
    finally:
        for r in replicas:
            r.unpause()
    for th in threads:
        th.join(60)
    assert len(calls) == 4 and [x.error for x in calls if x.error] == [], calls
    assert all(x.end - x.start >= SILENCE - 1 for x in calls)  # they really waited through the silence


def test_a_vanished_replica_fails_its_requests_within_seconds_and_the_rest_succeed(deployed, builtin_proxy):
    """A replica cut off under load: first its network goes (a partition or a lost node: no reset, no answer at all,
    its processes still alive), then `docker kill` ends it, with no restart. Requests in flight on it fail within
    seconds, or go to the other replica when it had not answered yet; no request waits longer than VANISH_LIMIT;
    every request that started after it vanished succeeds, through nginx and through the built-in proxy."""
    c = _client()
    victim = c.containers.get(deployed.plan.replicas[1].name)
    internal = c.networks.get(f"{NAME}-internal")
    victim.update(restart_policy={"Name": "no"})
    stop, calls = threading.Event(), []
    threads = _traffic({"nginx": deployed.port, "builtin": builtin_proxy}, stop, calls, max_tokens=40)
    try:
        time.sleep(6)
        vanished = time.monotonic()
        internal.disconnect(victim, force=True)
        cut = time.monotonic()  # the partition took effect somewhere in [vanished, cut]: the API call returned
        time.sleep(12)
        victim.kill()
        time.sleep(12)
    finally:
        stop.set()
        for th in threads:
            th.join(90)
        victim.update(restart_policy={"Name": "unless-stopped"})
        internal.reload()
        if victim.id not in {x.id for x in internal.containers}:
            internal.connect(victim, aliases=[victim.name])
        victim.start()
    waits = sorted(round(x.end - x.start, 1) for x in calls)
    # A request sent while the disconnect call ran may have reached the victim before the cut: in flight, not late.
    in_flight = [x for x in calls if x.start < cut and x.end > vanished]
    failed = [x for x in calls if x.error]
    late = [x for x in calls if x.start > cut]
    print(f"vanished replica: {len(calls)} requests, {len(in_flight)} in flight when it vanished, {len(failed)} "
          f"failed (after {sorted(round(x.end - vanished, 1) for x in failed)} s), longest waits {waits[-5:]} s",
          file=sys.stderr)
    assert in_flight and late and waits[-1] <= VANISH_LIMIT, waits[-5:]
    assert all(x in in_flight for x in failed), [x for x in failed if x not in in_flight]
    assert {x.via for x in late} == {"nginx", "builtin"} and not [x for x in late if x.error]
    # Back to two healthy replicas behind nginx (it resolved the names when it started: reload it).
    r = deploykit("up", deployed.spec, env=deployed.env, timeout=UP_TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    c.containers.get(f"{NAME}-lb").kill(signal="SIGHUP")


def test_a_second_deployment_is_untouched_by_the_first_down_and_down_leaves_nothing(deployed, tmp_path):
    port2 = free_port(1)
    spec2 = spec_file(tmp_path / "other.yaml", OTHER, deployed.model, port2, cpus=["1"], image=deployed.image)
    r = deploykit("up", spec2, "--runtime", "docker", env=deployed.env, timeout=UP_TIMEOUT)
    assert r.returncode == 0, r.stderr[-4000:]
    other = _ids(OTHER)
    assert sorted(other) == [f"{OTHER}-0", f"{OTHER}-lb"]  # one replica, still behind nginx: the only port
    r = deploykit("down", NAME, env=deployed.env)
    assert r.returncode == 0, r.stderr
    assert f"removed network {NAME}-internal" in r.stdout and f"removed network {NAME}-edge" in r.stdout
    assert _labelled(NAME) == ([], [])
    assert all(nothing_listens(deployed.port + i) for i in range(3))
    assert _ids(OTHER) == other
    assert all(c.status == "running" for c in _labelled(OTHER)[0])
    assert isinstance(_chat(port2, OTHER), str)
    assert deploykit("down", OTHER, "--volumes", env=deployed.env).returncode == 0
    assert _labelled(OTHER) == ([], []) and not (deployed.state / OTHER).exists()


@pytest.fixture
def failing(deployed, tmp_path):
    """A third deployment name; its images are removed afterwards (it never comes up)."""
    yield tmp_path
    deploykit("down", FAILING, "--volumes", env=deployed.env)
    _remove_images(FAILING)


def test_a_corrupt_model_fails_with_the_engines_error_and_leaves_nothing(deployed, failing):
    model = corrupt_copy(deployed.model, failing / "corrupt")
    port = free_port(3)
    spec = spec_file(failing / "spec.yaml", FAILING, model, port, image=deployed.image)
    r = deploykit("up", spec, "--runtime", "docker", "--timeout", "600", env=deployed.env, timeout=UP_TIMEOUT)
    assert r.returncode == 7, r.stderr[-4000:]
    assert "exited during start-up" in r.stderr and "ERROR" in r.stderr.split("its last log lines")[1]
    assert "undoing what this up started" in r.stderr
    assert _labelled(FAILING) == ([], [])
    assert all(nothing_listens(port + i) for i in range(3))


def test_ctrl_c_during_up_stops_cleanly(deployed, failing):
    port = free_port(3)
    spec = spec_file(failing / "spec.yaml", FAILING, deployed.model, port, image=deployed.image)
    env = {**os.environ, **deployed.env}
    proc = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "up", str(spec), "--runtime", "docker"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + UP_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None and not _labelled(FAILING)[0]:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted: undoing" in err
    assert _labelled(FAILING) == ([], [])


def test_a_failing_image_build_shows_the_failing_step(deployed, failing):
    wheels = failing / "wheels"
    wheels.mkdir()
    one = next(Path(deployed.image["wheelhouse"]).glob("PyYAML-*.whl"), None) or next(
        Path(deployed.image["wheelhouse"]).glob("*.whl"))
    (wheels / one.name).write_bytes(one.read_bytes())  # a wheelhouse missing almost every dependency
    spec = spec_file(failing / "spec.yaml", FAILING, deployed.model, free_port(3),
                     image={**deployed.image, "wheelhouse": str(wheels)})
    r = deploykit("up", spec, "--runtime", "docker", env=deployed.env, timeout=UP_TIMEOUT)
    assert r.returncode == 7, r.stderr[-3000:]
    assert "failed at Step" in r.stderr and "pip install --no-index" in r.stderr
    assert "No matching distribution" in r.stderr and "image.wheelhouse" in r.stderr
    assert _labelled(FAILING) == ([], [])
