"""The docker runtime: a deployment as containers, through the Docker Engine API (the docker SDK, never the CLI).

Each container is created from render/container.py's `Container`, the model run.sh and compose.yaml spell, so every
setting matches theirs: cpuset CPUs and memory nodes, memory limit = swap limit, `cap_drop ALL` plus the Container's
capabilities, the seccomp profile (its JSON text, as the API takes it), no-new-privileges, a read-only root with a
tmpfs, the model and plan.json mounted read-only, labels, restart policy, stop signal and stop grace. A
`deploykit.config-hash` label records what a container was created with; `up` replaces exactly the containers whose
hash changed. A replaced container is stopped and renamed `NAME.replaced` until the new one is healthy, so a failed
`up` can bring the previous one back.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import topology
from ..errors import RuntimeFailure
from ..render.container import INTERNAL, INTERNAL_OPTIONS, network_name
from . import Change, Observed, Ready, Say, atomic, build, health, preflight
from .docker_errors import daemon_is_local, not_running, refused
from .deployment import Deployment, Member, url

LABEL = "deploykit.deployment"
REPLICA_LABEL = "deploykit.replica"
HASH_LABEL = "deploykit.config-hash"
RETIRED = ".replaced"
API_TIMEOUT = 300  # seconds; a stop waits for the container's own grace period (50 s for engines)
RELOAD_WAIT = 15.0  # seconds for nginx to swap its workers after SIGHUP
# GET inside a container: the engines' network has no way in from the host. http.client, no site: a quick start.
PROBE = ("import http.client, os, sys\n"
         "c = http.client.HTTPConnection('127.0.0.1', int(sys.argv[1]), timeout=float(sys.argv[3]))\n"
         "key = os.environ.get('DEPLOYKIT_PROBE_KEY')\n"
         "c.request('GET', sys.argv[2], headers={'Authorization': 'Bearer ' + key} if key else {})\n"
         "r = c.getresponse()\n"
         "sys.stdout.buffer.write(b'%d\\n' % r.status + r.read())\n")


class DockerRuntime:
    name = "docker"

    def __init__(self, client, where: str):
        self.client, self.where = client, where

    @classmethod
    def connect(cls) -> DockerRuntime:
        try:
            import docker
        except ImportError:
            raise RuntimeFailure("the docker runtime needs the docker SDK, which is not installed",
                                 hint="pip install 'deploykit[docker]', or run without Docker: --runtime local"
                                 ) from None
        host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        try:
            client = docker.from_env(timeout=API_TIMEOUT)
            version = client.version().get("Version", "?")
        except docker.errors.DockerException as e:
            raise not_running(host, e) from None
        return cls(client, f"Docker {version} at {host}")

    # --- up ----------------------------------------------------------------------------------------------------

    def apply(self, d: Deployment, change: Change, say: Say, ready: Ready) -> None:
        """Fills `change` as it goes, so a failure or Ctrl-C midway can still be rolled back."""
        import docker.errors
        try:
            self._apply(d, change, say, ready)
        except docker.errors.DockerException as e:  # the daemon refused something we did not foresee
            raise RuntimeFailure(f"Docker refused: {getattr(e, 'explanation', None) or e}",
                                 hint=f"see the message; deploykit logs {d.name} shows the containers' output"
                                 ) from None

    def _apply(self, d: Deployment, change: Change, say: Say, ready: Ready) -> None:
        self._preflight(d)
        existing = self._containers(d.name)
        for name in [n for n in existing if n.endswith(RETIRED)]:  # left by an `up` that crashed: superseded
            existing.pop(name).remove(force=True)
        ours = {int(b["HostPort"]) for ctr in existing.values() for b in _bindings(ctr)}
        preflight.ports_free(d, [m for m in d.members if m.container.publish], ours, holder=self._holder)
        image = change.image = build.ensure(self.client, d.plan, d.state.rendered, say)
        self._networks(d, change, say)
        settings = {m.name: self._settings(d, m, image) for m in d.members}
        digests = {m.name: _config_hash(d, m, settings[m.name]) for m in d.members}
        lb = d.lb
        lb_stays = lb is not None and lb.name in existing and existing[lb.name].labels.get(HASH_LABEL) == digests[
            lb.name] and existing[lb.name].status == "running"
        for m in d.members:
            digest = digests[m.name]
            old = existing.pop(m.name, None)
            if old is not None and old.labels.get(HASH_LABEL) == digest:
                change.kept.append(m.name)
                if old.status != "running":  # stopped by hand, say: same container, started again
                    old.start()
                    say(f"{m.name}: unchanged ({old.short_id[:12]}), was {old.status}: started")
                else:
                    say(f"{m.name}: unchanged ({old.short_id[:12]})")
                continue
            if old is not None:
                self._retire(old, change, say, "its configuration changed")
            with atomic():
                change.created.append(m.name)
                cid = self._create(d, m, settings[m.name], digest)
            say(f"{m.name}: started {cid[:12]} ({_placement(m)})")
            if old is not None and lb_stays:  # a rolling update: nginx serves from the others meanwhile
                say(f"{m.name}: waiting until it is healthy before replacing the next one (nginx keeps serving)")
                ready(m)
                self._reload(lb.name, say)
        for old in existing.values():  # no longer planned (fewer replicas, no load balancer)
            self._retire(old, change, say, "it is no longer in the plan")
        if lb is not None and lb.name in change.kept and any(n != lb.name for n in change.created) and not lb_stays:
            self._reload(lb.name, say)
        change.restarts = {n: o.restarts for n, o in self.observe(d.name).items()}

    def commit(self, d: Deployment, change: Change, say: Say) -> None:
        for name in change.retired:
            ctr = self._get(name + RETIRED)
            if ctr is not None:
                ctr.remove(force=True)
        if change.created:
            build.prune(self.client, d.plan, change.image, say)

    def rollback(self, d: Deployment, change: Change, say: Say) -> None:
        created = [c for c in (self._get(n) for n in change.created) if c is not None]
        if not change.kept and not change.retired:  # a first `up`: nothing of this deployment may stay
            created = self.client.containers.list(all=True, filters={"label": f"{LABEL}={d.name}"})
        _parallel(lambda c: c.remove(force=True), created)
        for ctr in created:
            say(f"{ctr.name}: removed")
        for name in change.retired:
            old = self._get(name + RETIRED)
            if old is not None:
                old.rename(name)
                old.start()
                say(f"{name}: the previous container is back ({old.short_id[:12]}); it is starting")
        lb = d.lb.name if d.lb else None
        if lb in change.kept and (created or change.retired):
            self._reload(lb, say)  # back to the previous replicas' addresses
        if change.network_created and not change.kept and not change.retired:
            for net in self.client.networks.list(filters={"label": f"{LABEL}={d.name}"}):
                net.remove()
                say(f"network {net.name}: removed")

    # --- down, status, logs ------------------------------------------------------------------------------------

    def down(self, name: str, volumes: bool, say: Say) -> list[str]:
        import docker.errors
        ctrs = self.client.containers.list(all=True, filters={"label": f"{LABEL}={name}"})
        # all at once, each with its own stop signal and grace: engines drain, nginx finishes open streams
        _parallel(lambda c: c.stop(), [c for c in ctrs if c.status in ("running", "restarting", "paused")])
        _parallel(lambda c: c.remove(force=True, v=volumes), ctrs)
        removed = [f"removed container {c.name}" for c in ctrs]
        for net in self.client.networks.list(filters={"label": f"{LABEL}={name}"}):
            try:
                net.remove()
                removed.append(f"removed network {net.name}")
            except docker.errors.APIError as e:  # a container of someone else's joined it
                say(f"network {net.name}: kept, {getattr(e, 'explanation', None) or e}; docker network inspect "
                    f"{net.name} shows who uses it")
        if volumes:
            for vol in self.client.volumes.list(filters={"label": f"{LABEL}={name}"}):
                vol.remove(force=True)
                removed.append(f"removed volume {vol.name}")
        return removed

    def observe(self, name: str) -> dict[str, Observed]:
        out = {}
        for ctr in self.client.containers.list(all=True, filters={"label": f"{LABEL}={name}"}):
            if ctr.name.endswith(RETIRED):
                continue
            a, replica = ctr.attrs, ctr.labels.get(REPLICA_LABEL, "lb")
            st = a["State"]
            detail = [f"exit code {st.get('ExitCode')}"] if st["Status"] in ("exited", "dead") else []
            if st.get("Health") and st["Health"]["Status"] != "healthy":
                detail.append(f"Docker's health check: {st['Health']['Status']}")
            if a.get("RestartCount"):
                detail.append(f"{a['RestartCount']} restarts")
            out[ctr.name] = Observed(ctr.name, int(replica) if replica.isdigit() else None, ctr.id[:12], st["Status"],
                                     ", ".join(detail), a.get("RestartCount", 0),
                                     a["HostConfig"].get("CpusetCpus") or None,
                                     a["HostConfig"].get("CpusetMems") or None, ctr.labels.get(HASH_LABEL, ""))
        return out

    def fetch(self, plan, member: Member, path: str, *, timeout: float, api_key: str | None = None) -> health.Answer:
        """The load balancer through its published port; an engine from inside its container."""
        if member.container.publish:
            return health.get(url(plan.serving.publish_address, member.port, path), timeout=timeout, api_key=api_key)
        import docker.errors
        ctr = self._get(member.name)
        if ctr is None or ctr.status != "running":
            return health.Answer(0, b"", "not running")
        try:
            done = ctr.exec_run(["python", "-S", "-c", PROBE, str(plan.serving.port), path, str(timeout)],
                                environment={"DEPLOYKIT_PROBE_KEY": api_key} if api_key else None)
        except docker.errors.APIError as e:
            return health.Answer(0, b"", str(getattr(e, "explanation", None) or e))
        if done.exit_code != 0:
            return health.Answer(0, b"", done.output.decode(errors="replace").strip().splitlines()[-1:][0]
                                 if done.output.strip() else f"exit {done.exit_code}")
        status, _, body = done.output.partition(b"\n")
        return health.Answer(int(status), body)

    def tail(self, name: str, member: str, lines: int) -> str:
        ctr = self._get(member)
        return ctr.logs(tail=lines).decode(errors="replace") if ctr is not None else ""

    def logs(self, name: str, members: list[str], follow: bool, tail: int | None) -> None:
        ctrs = [c for c in (self._get(m) for m in members) if c is not None]
        lock = threading.Lock()

        def pump(ctr) -> None:
            prefix = f"{ctr.name} | " if len(ctrs) > 1 else ""
            pending = b""
            for chunk in ctr.logs(stream=True, follow=follow, tail="all" if tail is None else tail):
                pending += chunk
                *done, pending = pending.split(b"\n")
                with lock:
                    for line in done:
                        sys.stdout.write(prefix + line.decode(errors="replace") + "\n")
                    sys.stdout.flush()
            if pending:
                with lock:
                    sys.stdout.write(prefix + pending.decode(errors="replace") + "\n")

        if not follow:
            for c in ctrs:
                pump(c)
            return
        threads = [threading.Thread(target=pump, args=(c,), daemon=True) for c in ctrs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # --- helpers ------------------------------------------------------------------------------------------------

    def _preflight(self, d: Deployment) -> None:
        if not daemon_is_local():
            raise RuntimeFailure("the Docker daemon is not on this host; deploykit up mounts the model and plan from "
                                 "this host's files", path="DOCKER_HOST", value=os.environ.get("DOCKER_HOST"),
                                 hint="run deploykit up on the Docker host itself (render there with --sysroot if "
                                      "needed), or unset DOCKER_HOST")
        preflight.model_readable(d.model, d.plan.security.run_as_user)
        host = topology.read("/")
        preflight.cpus_on_host(d.plan, (c.id for c in host.cpus), (n.id for n in host.nodes), "this host")
        for m in d.members:
            ctr = self._get(m.name)
            if ctr is not None and ctr.labels.get(LABEL) != d.name:
                raise RuntimeFailure(f"a container named {m.name} exists and does not belong to deployment {d.name}",
                                     value=f"{m.name} ({ctr.labels.get(LABEL) or 'not deploykit'})",
                                     hint="remove or rename that container, or change the deployment's name")

    def _containers(self, name: str) -> dict:
        return {c.name: c for c in self.client.containers.list(all=True, filters={"label": f"{LABEL}={name}"})}

    def _get(self, name: str):
        import docker.errors
        try:
            return self.client.containers.get(name)
        except docker.errors.NotFound:
            return None

    def _networks(self, d: Deployment, change: Change, say: Say) -> None:
        """The deployment's two bridge networks, where members find each other by container name: internal (the
        engines; no route out, no address on the host) and edge (the load balancer's published port)."""
        import docker.errors
        for role in sorted({r for m in d.members for r in m.container.networks}):
            name = network_name(d.name, role)
            try:
                net = self.client.networks.get(name)
            except docker.errors.NotFound:
                internal = role == INTERNAL
                with atomic():
                    self.client.networks.create(name, driver="bridge", labels={LABEL: d.name}, internal=internal,
                                                options=dict(INTERNAL_OPTIONS) if internal else None)
                    change.network_created = True
                say(f"network {name}: created" + (" (internal: no route out)" if internal else ""))
                continue
            if (net.attrs.get("Labels") or {}).get(LABEL) != d.name:
                raise RuntimeFailure(f"a Docker network named {name} exists and does not belong to this deployment",
                                     value=name, hint="remove that network, or change the deployment's name")

    def _settings(self, d: Deployment, m: Member, image: str) -> dict:
        """The container's create arguments."""
        c = m.container
        env = d.env(c)
        security = ["no-new-privileges"]
        if c.seccomp == "unconfined":
            security.append("seccomp=unconfined")
        elif c.seccomp:
            security.append("seccomp=" + d.rendered(c.seccomp).read_text())
        mount_path, tmp_opts = c.tmpfs.split(":", 1)
        binds = {str(Path(d.model if mt.source == "model" else d.rendered(mt.source)).resolve()):
                 {"bind": mt.target, "mode": "ro"} for mt in c.mounts}
        ports, bindings = [], None
        if c.publish:
            addr, host_port, port = c.publish.rsplit(":", 2)
            ports, bindings = [int(port)], {int(port): (addr.strip("[]"), int(host_port))}
        return {
            "image": image, "name": c.name, "user": c.user, "environment": env, "labels": dict(c.labels),
            "entrypoint": list(c.entrypoint[:1]) or None, "command": list(c.entrypoint[1:]) or None,
            "stop_signal": c.stop_signal, "stop_timeout": c.stop_seconds, "ports": ports,
            "networks": [network_name(d.name, role) for role in c.networks],
            "host_config": {
                "binds": binds, "port_bindings": bindings, "cpuset_cpus": c.cpuset, "cpuset_mems": c.mems,
                "mem_limit": c.memory, "memswap_limit": c.memory, "shm_size": c.shm_size, "read_only": c.read_only,
                "tmpfs": {mount_path: tmp_opts}, "cap_drop": ["ALL"], "cap_add": list(c.caps_add) or None,
                "security_opt": security, "sysctls": dict(c.sysctls) or None,
                "restart_policy": {"Name": "unless-stopped"},
            },
        }

    def _create(self, d: Deployment, m: Member, s: dict, digest: str) -> str:
        import docker.errors
        api = self.client.api
        try:
            host_config = api.create_host_config(**s["host_config"])
            first, *more = s["networks"]
            networking = api.create_networking_config({first: api.create_endpoint_config(aliases=[m.name])})
            made = api.create_container(
                s["image"], name=s["name"], command=s["command"], entrypoint=s["entrypoint"], user=s["user"],
                environment=s["environment"], labels={**s["labels"], HASH_LABEL: digest}, ports=s["ports"] or None,
                host_config=host_config, networking_config=networking, stop_signal=s["stop_signal"],
                stop_timeout=s["stop_timeout"], detach=True)
            for net in more:  # before it starts: nginx resolves the replicas' names once, at start-up
                api.connect_container_to_network(made["Id"], net, aliases=[m.name])
            api.start(made["Id"])
        except docker.errors.APIError as e:
            raise refused(d, m, e) from None
        return made["Id"]

    def _reload(self, lb: str, say: Say) -> None:
        """nginx resolved the replicas' names when it started; a new container may have a new address. SIGHUP
        re-reads the configuration with fresh workers, which forget which replicas failed; the old workers finish
        their requests and close their connections. Returns once the new workers serve: until then an old worker
        still routes by the old addresses, and stopping the next replica would leave it none alive (502)."""
        ctr = self.client.containers.get(lb)
        before = _nginx_workers(ctr)
        ctr.kill(signal="SIGHUP")
        deadline = time.monotonic() + RELOAD_WAIT
        while time.monotonic() < deadline:
            now = _nginx_workers(ctr)
            if set(now) - set(before) and not any(pid in now and "shutting down" not in now[pid] for pid in before):
                say(f"{lb}: reloaded (a replica was replaced)")
                return
            time.sleep(0.1)
        say(f"{lb}: reload signalled, but nginx did not start new workers within {RELOAD_WAIT:.0f}s")

    def _retire(self, old, change: Change, say: Say, why: str) -> None:
        name = old.name
        say(f"{name}: stopping {old.short_id[:12]}, {why}")
        with atomic():
            old.stop()
            old.rename(name + RETIRED)
            change.retired.append(name)

    def _holder(self, port: int) -> str:
        for ctr in self.client.containers.list():
            if any(int(b["HostPort"]) == port for b in _bindings(ctr)):
                owner = ctr.labels.get(LABEL)
                return f"container {ctr.name}" + (f" of deployment {owner}" if owner else "")
        return ""


def _config_hash(d: Deployment, m: Member, settings: dict) -> str:
    """What the container is created with, secrets replaced by salted hashes."""
    return d.config_hash(m, {**settings, "environment": d.hashed_env(m.container)})


def _nginx_workers(ctr) -> dict[str, str]:
    """{pid: command} of the nginx worker processes in the container (the Docker API's `top`)."""
    top = ctr.top()
    pid, cmd = top["Titles"].index("PID"), len(top["Titles"]) - 1
    return {p[pid]: p[cmd] for p in top["Processes"] if "worker process" in p[cmd]}


def _bindings(ctr) -> list[dict]:
    ports = (ctr.attrs.get("HostConfig") or {}).get("PortBindings") or {}
    return [b for bs in ports.values() for b in (bs or []) if b.get("HostPort")]


def _placement(m: Member) -> str:
    c = m.container
    return f"CPUs {c.cpuset}, memory nodes {c.mems}" if c.mems else f"CPUs {c.cpuset or 'any'}"


def _parallel(fn, items) -> None:
    items = list(items)
    if items:
        with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
            list(pool.map(fn, items))
