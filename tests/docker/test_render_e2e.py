"""End to end: build the rendered Dockerfile (offline, from a host-built wheelhouse on the debootstrap base), start
two replicas plus nginx with run.sh and then with compose, and get /health and a completion through nginx.

Also checks what only a running engine shows: one OpenMP runtime mapped, the planned CPUs, a non-root user; that
an engine container can open no connection outside its internal network (not even to this host) while clients
reach it through nginx; and the image's SBOM.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from deploykit import cpulist

try:
    from . import render_image
    from .conftest import unavailable
except ImportError:
    import render_image
    from conftest import unavailable

pytestmark = [pytest.mark.docker, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NAME = "dke2e"
RUN_IMAGE = "deploykit-e2e-run:local"  # the plan's image ref; compose uses it, so the built image is tagged so
PORTS = (18480, 18580, 18680)  # fixed: the port is part of the image (EXPOSE, HEALTHCHECK) and so of its cache key
READY_TIMEOUT_S = 420
# Run inside a replica: its cgroup cpuset, Mems_allowed, and per process the OpenMP runtimes and tcmalloc mapped.
INSIDE = """
import glob, json, os
def first(*paths):
    for p in paths:
        if os.path.exists(p):
            return open(p).read().strip()
status = dict(l.split(":\\t", 1) for l in open("/proc/1/status") if ":\\t" in l)
omp, tcm, uids = {}, {}, set()
for d in glob.glob("/proc/[0-9]*"):
    if d == f"/proc/{os.getpid()}":
        continue
    try:
        maps = open(d + "/maps").read().splitlines()
        uids.add(int(open(d + "/status").read().split("Uid:")[1].split()[0]))
    except OSError:
        continue
    omp[d] = sorted({l.split()[-1] for l in maps if any(x in l for x in ("libgomp", "libiomp", "libomp"))})
    tcm[d] = any("libtcmalloc" in l for l in maps)
print(json.dumps({"cpuset": first("/sys/fs/cgroup/cpuset/cpuset.cpus", "/sys/fs/cgroup/cpuset.cpus.effective"),
                  "mems": status["Mems_allowed_list"].strip(), "omp": omp, "tcmalloc": tcm, "uids": sorted(uids)}))
"""


def _engine_serves() -> str:
    """'' when this checkout's engine has `python -m engine serve`, else why not."""
    done = subprocess.run([sys.executable, "-m", "engine", "serve", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    return "" if done.returncode == 0 else "engine has no `serve` command yet"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def _wait_healthy(url: str, what: str, logs) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if _get(url)[0] == 200:
            return
        time.sleep(2)
    pytest.fail(f"{what}: {url} not 200 within {READY_TIMEOUT_S}s\n{logs()}")


def _stream(port: int) -> list[str]:
    """A streamed completion through `port`: the SSE `data:` payloads as they arrive (nginx must not buffer)."""
    body = json.dumps({"model": NAME, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers.get_content_type() == "text/event-stream"
        return [line[6:].decode().strip() for line in r if line.startswith(b"data: ")]


def _inside(container: str, port: int, path: str) -> tuple[int, bytes]:
    """GET a replica's path from inside its container: only nginx publishes a port, and the engines' network has
    no way in from the host."""
    code = ("import sys, urllib.request as u, urllib.error as e\n"
            "try:\n    r = u.urlopen(sys.argv[1], timeout=5); s, b = r.status, r.read()\n"
            "except e.HTTPError as x:\n    s, b = x.code, x.read()\n"
            "except OSError:\n    s, b = 0, b''\n"
            "sys.stdout.buffer.write(b'%d\\n' % s + b)\n")
    done = subprocess.run(["docker", "exec", container, "python", "-c", code, f"http://127.0.0.1:{port}{path}"],
                          capture_output=True, timeout=60)
    if done.returncode != 0:
        return 0, b""
    status, _, body = done.stdout.partition(b"\n")
    return int(status), body


def _wait_replica(container: str, port: int, logs) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if _inside(container, port, "/health")[0] == 200:
            return
        time.sleep(2)
    pytest.fail(f"{container}: /health not 200 within {READY_TIMEOUT_S}s\n{logs()}")


def _compose_container(project: str, service: str) -> str:
    return _docker("ps", "-q", "--filter", f"label=com.docker.compose.project={project}", "--filter",
                   f"label=com.docker.compose.service={service}").strip()


# An engine container tries every address outside its network: this host's (where a listener waits), nginx's on
# the edge network. Each must fail; its peer replica on the internal network must answer.
ESCAPE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def attempt(target):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((target[0], int(target[1]))); return "connected"
    except OSError as e:
        return type(e).__name__ + ": " + str(e)
    finally:
        s.close()
targets = json.loads(sys.argv[1])
with ThreadPoolExecutor(len(targets)) as pool:
    print(json.dumps(dict(zip([f"{h}:{p}" for h, p in targets], pool.map(attempt, targets)))))
"""


def _host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=30).stdout
    return sorted({line.split()[3].split("/")[0] for line in out.splitlines()} - {"127.0.0.1"})


def _check_engines_reach_nothing_outside(plan: dict, lb: str, edge: str) -> None:
    with socket.socket() as listener:  # a service of this host on every address: an engine must not reach it
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        host_port = listener.getsockname()[1]
        lb_edge = json.loads(_docker("inspect", lb))[0]["NetworkSettings"]["Networks"][edge]["IPAddress"]
        a, b = plan["replicas"][:2]
        targets = [[h, host_port] for h in _host_addresses()] + [[lb_edge, plan["serving"]["port"]]]
        seen = json.loads(_docker("exec", a["name"], "python", "-c", ESCAPE,
                                  json.dumps(targets + [[b["name"], plan["serving"]["port"]]])))
        assert seen.pop(f"{b['name']}:{plan['serving']['port']}") == "connected"  # its own network works
        assert len(seen) >= 3 and not [t for t, what in seen.items() if what == "connected"], seen


def _check_replicas_bound_their_memory(plan: dict, container=lambda r: r["name"]) -> None:
    """Each engine's binding report: its plan's CPUs, memory bound to the plan's nodes, no refused call. Under
    compose this is the only memory binding (compose has no cpuset-mems)."""
    for r in plan["replicas"]:
        rep = json.loads(_inside(container(r), plan["serving"]["port"], "/debug/binding")[1])["engine"]
        assert rep["planned_cpus"] == r["cpus"] and rep["planned_mems"] == r["mems"], rep
        assert rep["memory_policy"]["nodes"] == r["mems"], rep["memory_policy"]
        assert rep["memory_policy"]["mode"] in ("bind", "interleave"), rep["memory_policy"]
        assert rep["warnings"] == [], rep["warnings"]


def _check_streaming_through_the_lb(port: int) -> None:
    events = _stream(port)
    assert events[-1] == "[DONE]" and len(events) >= 3, events
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def _complete(port: int) -> dict:
    body = json.dumps({"model": NAME, "prompt": "Hello, world", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def _docker(*args: str, timeout: float = 120, input_: str | None = None) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, input=input_)
    assert done.returncode == 0, f"docker {' '.join(args)}: {done.stderr}"
    return done.stdout


def _logs(*containers: str):
    def show() -> str:
        parts = []
        for c in containers:
            done = subprocess.run(["docker", "logs", "--tail", "40", c], capture_output=True, text=True)
            parts.append(f"--- {c}\n{done.stdout}{done.stderr}")
        return "\n".join(parts)
    return show


@pytest.fixture(scope="module")
def deployment(docker, base_image, tmp_path_factory):
    """(rendered dir, plan, model dir, image ref) for two replicas on this host's first two CPUs."""
    why = _engine_serves()
    if why:
        unavailable(why)
    port = next((p for p in PORTS if all(_free(p + i) for i in range(3))), None)
    if port is None:
        unavailable(f"ports {PORTS} (+1, +2) are all taken on 127.0.0.1")
    base = tmp_path_factory.mktemp("e2e")
    model = base / "model"
    subprocess.run([sys.executable, "-m", "engine", "tiny-model", str(model)], check=True, capture_output=True,
                   timeout=300)
    for f in model.iterdir():  # the containers run as UID 10001, not as the owner of the files
        f.chmod(0o644)
    allowed = cpulist.parse(Path("/proc/self/status").read_text().split("Cpus_allowed_list:")[1].split()[0])
    if len(allowed) < 2:
        unavailable("two replicas need two CPUs")
    name, tag = RUN_IMAGE.split(":")
    spec = {"apiVersion": "deploykit/v1", "kind": "Deployment", "name": NAME,
            "model": {"source": str(model), "max_model_len": 512},
            "placement": {"strategy": "explicit", "cpus": [str(allowed[0]), str(allowed[1])], "reserved_cpus": 0},
            "serving": {"port": port, "publish_address": "127.0.0.1", "kv_cache": "64MiB", "max_num_seqs": 4,
                        "served_model_name": NAME},
            "image": {"name": name, "tag": tag, "base": base_image, "wheelhouse": str(render_image.wheelhouse())}}
    (base / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = base / "out"
    done = subprocess.run([sys.executable, "-m", "deploykit.cli", "render", str(base / "spec.yaml"), "-o", str(out),
                           "--target", "all"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    start = time.monotonic()
    ref = render_image.engine_image(out, base_image)
    print(f"engine image {ref}: {time.monotonic() - start:.0f}s {render_image.TIMINGS}", file=sys.stderr)
    _docker("tag", ref, RUN_IMAGE)
    plan = json.loads((out / "plan.json").read_text())
    yield out, plan, model, ref
    subprocess.run(["bash", str(out / "run.sh"), "down"], capture_output=True, timeout=120)


def test_image_is_offline_non_root_and_labelled(deployment):
    out, plan, _, ref = deployment
    cfg = json.loads(_docker("image", "inspect", ref))[0]["Config"]
    assert cfg["User"] == "10001:10001"
    assert f"{plan['serving']['port']}/tcp" in cfg["ExposedPorts"]
    assert cfg["Healthcheck"]["Test"][0] == "CMD"
    assert cfg["Labels"]["org.opencontainers.image.version"] == "local"
    assert "LD_PRELOAD=libtcmalloc_minimal.so.4" in cfg["Env"]
    # No unresolvable base: the FROM lines name the spec's base image itself.
    froms = [line.split()[1] for line in (out / "Dockerfile").read_text().splitlines() if line.startswith("FROM ")]
    assert froms == [plan["image"]["base"], plan["image"]["base"], "runtime", "runtime"], froms
    assert cfg["Labels"]["org.opencontainers.image.base.name"] == plan["image"]["base"]
    # The bill of materials the build wrote into the image: the Python packages (torch with its version) and the
    # OS packages, nothing of the SBOM tool itself.
    path = cfg["Labels"]["io.deploykit.sbom"]
    bom = json.loads(_docker("run", "--rm", "--label", "deploykit-test=1", "--entrypoint", "cat", ref, path))
    versions = {c["name"]: c.get("version") for c in bom["components"]}
    torch = json.loads(_docker("run", "--rm", "--label", "deploykit-test=1", "--entrypoint", "python", ref, "-c",
                               "import json, torch; print(json.dumps(torch.__version__))"))
    assert versions["torch"] == torch and versions["deploykit"] == "0.1.0"
    assert {"nginx", "libtcmalloc-minimal4", "libc6"} <= set(versions) and "cyclonedx-bom" not in versions
    assert bom["metadata"]["component"]["name"] == plan["image"]["name"]


def test_run_sh_serves_through_nginx(deployment):
    out, plan, model, ref = deployment
    names = [r["name"] for r in plan["replicas"]] + [f"{NAME}-lb"]
    env = {**os.environ, "IMAGE": ref, "MODEL_DIR": str(model)}
    done = subprocess.run(["bash", str(out / "run.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    try:
        port = plan["serving"]["port"]
        _wait_healthy(f"http://127.0.0.1:{port}/health", "nginx", _logs(*names))
        for r in plan["replicas"]:
            _wait_replica(r["name"], port, _logs(r["name"]))
        reply = _complete(port)
        assert reply["choices"] and isinstance(reply["choices"][0]["text"], str)
        _check_streaming_through_the_lb(port)
        _check_replicas_bound_their_memory(plan)
        for r in plan["replicas"]:  # nothing but nginx publishes a port
            assert not json.loads(_docker("inspect", r["name"]))[0]["HostConfig"]["PortBindings"]
        _check_engines_reach_nothing_outside(plan, f"{NAME}-lb", f"{NAME}-edge")
        for r in plan["replicas"]:
            seen = json.loads(_docker("exec", "-i", r["name"], "python", "-", input_=INSIDE))
            assert seen["cpuset"] == cpulist.format(cpulist.parse(r["cpus"]) + cpulist.parse(r["frontend_cpus"]))
            assert seen["mems"] == r["mems"]
            assert seen["uids"] == [10001]
            torch_procs = [libs for libs in seen["omp"].values() if libs]
            assert torch_procs, f"no process in {r['name']} has an OpenMP runtime mapped: {seen}"
            assert all(len(libs) == 1 for libs in torch_procs), f"two OpenMP runtimes in one process: {seen}"
            assert all(seen["tcmalloc"].values()), seen
        # Passive health and restarts aside, Docker's own HEALTHCHECK (from the Dockerfile) must agree.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states = [json.loads(_docker("inspect", "--format", "{{json .State.Health.Status}}", n)) for n in names]
            if all(s == "healthy" for s in states):
                break
            time.sleep(3)
        assert states == ["healthy"] * len(names), _logs(*names)()
    finally:
        subprocess.run(["bash", str(out / "run.sh"), "down"], capture_output=True, timeout=120)
    assert not _docker("ps", "-aq", "--filter", f"label=deploykit.deployment={NAME}").strip()


def test_compose_up_serves_through_nginx(deployment, compose_cli):
    out, plan, model, _ = deployment
    exe = compose_cli
    env = {**os.environ, "MODEL_DIR": str(model)}
    cmd = [exe, "-p", NAME, "-f", str(out / "compose.yaml")]
    done = subprocess.run([*cmd, "up", "-d"], env=env, capture_output=True, text=True, timeout=300, cwd=out)
    try:
        assert done.returncode == 0, done.stderr
        port = plan["serving"]["port"]

        def logs() -> str:
            return subprocess.run([*cmd, "logs", "--tail", "40"], env=env, capture_output=True, text=True,
                                  cwd=out).stdout

        _wait_healthy(f"http://127.0.0.1:{port}/health", "compose nginx", logs)
        for r in plan["replicas"]:
            _wait_replica(_compose_container(NAME, r["name"]), port, logs)
        assert _complete(port)["choices"]
        _check_streaming_through_the_lb(port)
        _check_replicas_bound_their_memory(plan, lambda r: _compose_container(NAME, r["name"]))
    finally:
        subprocess.run([*cmd, "down", "--remove-orphans"], env=env, capture_output=True, timeout=180, cwd=out)


def _binding_in_container(ref: str, model: Path, port: int, out: Path, flags: list[str]) -> dict:
    """Start the engine the way a Kubernetes pod does (no plan, `DEPLOYKIT_CPUS=auto`, no capabilities, the
    Localhost profile's rules) with extra docker flags, and return its /debug/binding engine report."""
    name = f"dkbind-{port}"
    _docker("run", "--detach", "--rm", "--name", name, "--label", "deploykit-test=1", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--security-opt", f"seccomp={out / 'seccomp-oci.json'}",
            "--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev,size=1g", "--user", "10001:10001",
            "--volume", f"{model}:/model:ro", "--publish", f"127.0.0.1:{port}:8000",
            "--env", "DEPLOYKIT_CPUS=auto", "--env", "DEPLOYKIT_KV_CACHE=64MiB", "--env", "DEPLOYKIT_MAX_MODEL_LEN=512",
            *flags, "--entrypoint", "python", ref,
            "-m", "engine", "serve", "/model", "--host", "0.0.0.0", "--port", "8000")  # the chart's command
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", name, _logs(name))
        return json.loads(_get(f"http://127.0.0.1:{port}/debug/binding")[1])["engine"]
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def test_binding_auto_follows_the_cpuset_and_quota_the_container_got(deployment):
    """The chart never writes host CPU ids: the engine reads the cpuset and CFS quota it was given and pins one
    OpenMP thread per physical core, with memory bound and no capability."""
    out, plan, model, ref = deployment
    port = plan["serving"]["port"] + 10
    allowed = cpulist.parse(Path("/proc/self/status").read_text().split("Cpus_allowed_list:")[1].split()[0])
    last = str(allowed[-1])
    one = _binding_in_container(ref, model, port, out, ["--cpuset-cpus", last])
    assert (one["source"], one["cpuset"], one["planned_cpus"], one["omp_threads"]) == ("auto", last, last, 1)
    omp = [t for t in one["threads"] if t["omp_thread"] is not None]
    assert [t["allowed_cpus"] for t in omp] == [last]
    assert one["memory_policy"]["mode"] == "bind" and one["warnings"] == [], one
    both = cpulist.format(allowed[:2])
    full = _binding_in_container(ref, model, port, out, ["--cpuset-cpus", both])
    assert (full["cpuset"], full["planned_cpus"], full["omp_threads"]) == (both, both, 2)
    assert sorted(t["allowed_cpus"] for t in full["threads"] if t["omp_thread"] is not None) == \
        [str(c) for c in allowed[:2]]
    quota = _binding_in_container(ref, model, port, out, ["--cpuset-cpus", both, "--cpus", "1"])
    assert (quota["cpuset"], quota["quota_cpus"], quota["omp_threads"]) == (both, 1.0, 1)
    assert any("CFS quota" in n for n in quota["notes"]), quota["notes"]


def _chart_objects(plan_json: Path) -> list[dict]:
    """Every object `helm install` + `helm test` create for this plan, the test hooks included (Helm's own engine)."""
    import helm_python

    from deploykit.plan import Plan
    from deploykit.render import helm
    plan = Plan.from_json(plan_json.read_text())
    with helm_python.Chart.load(str(helm.chart_dir())) as chart:
        rendered = chart.render(values=helm.values(plan), name=plan.name, namespace="llm")
    return [o for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            for o in yaml.safe_load_all(text) if o]


def _container_argv(c: dict, env_from: dict[str, str], override: dict[str, str] | None = None) -> list[str]:
    """A Kubernetes container's command and environment (envFrom's, then its own env, then `override`) as
    `docker run` arguments: command replaces the image's entrypoint, as in a pod."""
    plain = [e for e in c.get("env", ()) if "value" in e]
    assert len(plain) == len(c.get("env", ())), "a secret reference: this test has no API key"
    env = {**env_from, **{e["name"]: e["value"] for e in plain}, **(override or {})}
    return [a for k, v in env.items() for a in ("--env", f"{k}={v}")] + ["--entrypoint", c["command"][0]]


def test_the_charts_helm_test_pod_passes_a_pod_style_engine_and_fails_a_broken_promise(deployment, tmp_path):
    """What `helm test` runs, in Docker: the rendered engine pod's command and environment (its ConfigMap, no host
    CPU ids) on two CPUs, reachable under the Services' names; then the rendered test pod's command, with the
    check script from its ConfigMap, in the same image (deploykit's own report types and placement rule)."""
    out, plan, model, ref = deployment
    objs = _chart_objects(out / "plan.json")
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    fullname = plan["name"]
    test_pod = by[("Pod", f"{fullname}-test-placement")]["spec"]["containers"][0]
    script = by[("ConfigMap", f"{fullname}-test-placement")]["data"]["placement_check.py"]
    engine = by[("Deployment", f"{fullname}-0")]["spec"]["template"]["spec"]["containers"][0]
    config = {}
    for source in engine.get("envFrom", ()):
        config |= by[("ConfigMap", source["configMapRef"]["name"])]["data"]
    check_env = {e["name"]: e["value"] for e in test_pod["env"]}
    service_host, pods_host = check_env["SERVICE"].split(":")[0], check_env["PODS"]
    (tmp_path / "check").mkdir(mode=0o755)
    (tmp_path / "check" / "placement_check.py").write_text(script)
    tmp_path.chmod(0o755)
    (tmp_path / "check" / "placement_check.py").chmod(0o644)
    allowed = cpulist.parse(Path("/proc/self/status").read_text().split("Cpus_allowed_list:")[1].split()[0])
    net, name = f"dkcheck-{os.getpid()}", f"dkcheck-engine-{os.getpid()}"
    _docker("network", "create", "--internal", "--label", "deploykit-test=1", net)
    try:
        _docker("run", "--detach", "--rm", "--name", name, "--label", "deploykit-test=1", "--network", net,
                "--network-alias", service_host, "--network-alias", pods_host,
                "--cpuset-cpus", cpulist.format(allowed[:2]), "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--security-opt", f"seccomp={out / 'seccomp-oci.json'}",
                "--read-only", "--tmpfs", "/tmp:rw,nosuid,nodev,size=1g", "--user", "10001:10001",
                "--volume", f"{model}:/model:ro", *_container_argv(engine, config), ref, *engine["command"][1:])
        _wait_replica(name, int(check_env["PORT"]), _logs(name))

        def helm_test(override: dict[str, str] | None = None) -> subprocess.CompletedProcess:
            argv = ["docker", "run", "--rm", "--label", "deploykit-test=1", "--network", net, "--user", "10001:10001",
                    "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                    "--volume", f"{tmp_path / 'check'}:/check:ro",
                    *_container_argv(test_pod, {}, override), ref, *test_pod["command"][1:]]
            return subprocess.run(argv, capture_output=True, text=True, timeout=300)

        done = helm_test()
        assert done.returncode == 0 and done.stdout.startswith("ok   pod "), done.stdout + done.stderr
        # The same check against values this engine does not meet: a cap of one thread where it runs two.
        done = helm_test({"THREADS": "1"})
        assert done.returncode == 1 and "FAIL pod" in done.stdout and "expected 1" in done.stdout, \
            done.stdout + done.stderr
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "network", "rm", net], capture_output=True, timeout=60)
