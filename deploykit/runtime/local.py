"""The local runtime: a deployment as processes on this host, for machines without Docker.

Each replica is `python -m engine serve MODEL --plan rendered/plan.json --replica N`, started in its own session
with its CPU affinity set to the replica's cpuset (what the container's cpuset would be) and the container's
environment; the engine binds its OpenMP threads, front end and memory from the plan itself, as in a container.
With several replicas the load balancer is nginx when the binary is installed, else the built-in proxy
(proxy.py); DEPLOYKIT_LOCAL_LB=builtin|nginx chooses.

What containers add and processes lack: a memory limit, the seccomp profile, a separate user and a read-only root;
local processes run as you. There is no restart policy either: a crashed replica stays down (`status` shows it)
until the next `up`.

State: state.json lists every process (pid + start time, so a pid reused after a crash or reboot is never
signalled); every process also carries DEPLOYKIT_LOCAL_STATE=<state dir> in its environment, so `down` finds the
deployment's processes even when state.json is gone.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from .. import cpulist, procfs, topology
from ..errors import RuntimeFailure
from ..render import nginx
from . import Change, Observed, Ready, Say, atomic, health, preflight
from .deployment import Deployment, Member, probe_host, url
from .state import Process, State, StateDir

MARKER = "DEPLOYKIT_LOCAL_STATE"
_BINDING_ENV = ("OMP_", "GOMP_", "KMP_")  # the engine sets these from the plan; inherited ones would pin wrongly
KILL_WAIT = 5.0


class LocalRuntime:
    name = "local"

    def __init__(self, root: Path):
        self.root = root
        self.where = f"processes on this host, state under {root}"
        self._children: dict[int, subprocess.Popen] = {}  # the processes this command started, by pid

    # --- up ----------------------------------------------------------------------------------------------------

    def apply(self, d: Deployment, change: Change, say: Say, ready: Ready) -> None:
        if importlib.util.find_spec("engine") is None or importlib.util.find_spec("torch") is None:
            raise RuntimeFailure("the local runtime runs the bundled engine, which is not installed here",
                                 hint="pip install 'deploykit[engine]' (and torch==2.13.0), or use Docker: "
                                      "--runtime docker")
        preflight.model_readable(d.model, None)
        host = topology.read("/")
        preflight.cpus_on_host(d.plan, os.sched_getaffinity(0), host.allowed_mems or (n.id for n in host.nodes),
                               "this process's cpuset")
        state = d.state.load() or State(d.name, self.name)
        live = {p.name: p for p in state.processes if self._alive(p)}
        for p in state.processes:
            if p.name not in live:
                say(f"{p.name}: pid {p.pid} is gone; cleaning up its stale state")
                state = state.without(p.name)
        preflight.ports_free(d, d.members, {p.port for p in live.values()})
        lb = _lb_kind() if d.plan.serving.load_balancer else None
        planned = {}
        for m in d.members:
            argv, cpus, conf = self._command(d, m, lb)
            env = self._env(d, m)
            planned[m.name] = (argv, cpus, env, d.config_hash(
                m, {"argv": argv, "cpus": cpus, "env": d.hashed_env(m.container), "nginx.conf": conf}))
        lb_name = d.lb.name if d.lb else None
        lb_stays = lb_name in live and live[lb_name].config_hash == planned[lb_name][3]
        for m in d.members:
            argv, cpus, env, digest = planned[m.name]
            old = live.pop(m.name, None)
            if old is not None and old.config_hash == digest:
                change.kept.append(m.name)
                say(f"{m.name}: unchanged (pid {old.pid})")
                continue
            if old is not None:
                say(f"{m.name}: stopping pid {old.pid}, its configuration changed")
                self._stop([old])
                state = state.without(old.name)
                d.state.save(state)
                change.retired.append(m.name)
            with atomic():
                change.created.append(m.name)
                p = self._start(d, m, argv, cpus, env, digest)
                state = state.with_process(p)
                d.state.save(state)  # at once: a crash of `up` from here on still leaves the process findable
            say(f"{m.name}: started pid {p.pid} on port {p.port} ({_placement(m, cpus)}); log {p.log}")
            if old is not None and lb_stays:  # a rolling update: the load balancer serves from the others
                say(f"{m.name}: waiting until it is healthy before replacing the next one")
                ready(m)
        for old in live.values():
            say(f"{old.name}: stopping pid {old.pid}, it is no longer in the plan")
        self._stop(list(live.values()))  # signal all, then wait once
        for old in live.values():
            state = state.without(old.name)
            change.retired.append(old.name)
        d.state.save(state)

    def commit(self, d: Deployment, change: Change, say: Say) -> None:
        pass  # replaced processes were stopped when their successors started: ports cannot be shared

    def rollback(self, d: Deployment, change: Change, say: Say) -> None:
        """Processes cannot be parked like stopped containers, so an `up` that started or stopped something and then
        failed stops the whole deployment (an `up` refused before that leaves a running deployment alone)."""
        for what in self.down(d.name, False, say):
            say(what)

    # --- down, status, logs ------------------------------------------------------------------------------------

    def down(self, name: str, volumes: bool, say: Say) -> list[str]:
        sd = StateDir(self.root, name)
        state = sd.load()
        procs = [p for p in (state.processes if state else ()) if self._alive(p)]
        self._stop(procs)
        stopped = [f"stopped {p.name} (pid {p.pid})" for p in procs]
        stray = _marked(sd.path)  # children, or processes whose state entry was lost
        for pid in stray:
            _kill(pid, signal.SIGKILL)
            stopped.append(f"killed stray process {pid} of this deployment")
        _gone(sd.path)
        if state is not None:
            sd.save(replace(state, processes=()))
        shutil.rmtree(sd.path / "nginx", ignore_errors=True)
        return stopped

    def observe(self, name: str) -> dict[str, Observed]:
        state = StateDir(self.root, name).load()
        out = {}
        for p in state.processes if state else ():
            alive = self._alive(p)
            child = self._children.get(p.pid)
            code = child.poll() if child is not None else None
            detail = (f"exit code {code}" if code is not None else
                      "" if alive else f"pid {p.pid} is gone; last log line: {_last_line(p.log)}")
            cpus = mems = None
            if alive:
                cpus, mems = _confinement(p.pid)
            out[p.name] = Observed(p.name, p.replica, str(p.pid), "running" if alive else "exited", detail, 0,
                                   cpus, mems, p.config_hash)
        return out

    def fetch(self, plan, member: Member, path: str, *, timeout: float, api_key: str | None = None) -> health.Answer:
        return health.get(url(plan.serving.publish_address, member.port, path), timeout=timeout, api_key=api_key)

    def tail(self, name: str, member: str, lines: int) -> str:
        path = StateDir(self.root, name).logs / f"{member}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def logs(self, name: str, members: list[str], follow: bool, tail: int | None) -> None:
        logs = StateDir(self.root, name).logs
        files = {m: logs / f"{m}.log" for m in members if (logs / f"{m}.log").exists()}
        prefix = len(files) > 1
        offsets = {}
        for m, path in files.items():
            data = path.read_bytes()  # follow from this byte offset: decoded text has other lengths (U+FFFD, \r\n)
            lines = data.decode(errors="replace").splitlines()
            for line in lines if tail is None else lines[-tail:] if tail else []:
                sys.stdout.write(f"{m} | {line}\n" if prefix else line + "\n")
            offsets[m] = len(data)
        sys.stdout.flush()
        while follow:
            time.sleep(0.25)
            for m, path in files.items():
                with open(path, "rb") as f:
                    f.seek(offsets[m])
                    data = f.read()
                if b"\n" in data:
                    data = data[:data.rindex(b"\n") + 1]
                    offsets[m] += len(data)
                    for line in data.decode(errors="replace").splitlines():
                        sys.stdout.write(f"{m} | {line}\n" if prefix else line + "\n")
                    sys.stdout.flush()

    # --- processes ----------------------------------------------------------------------------------------------

    def _command(self, d: Deployment, m: Member, lb: str | None) -> tuple[list[str], list[int], str | None]:
        """argv, CPU affinity, and for nginx the text of its configuration (which the argv only names)."""
        host = d.plan.serving.publish_address.strip("[]")
        cpus = list(cpulist.parse(m.container.cpuset)) if m.container.cpuset else []
        if m.replica is not None:
            return [sys.executable, "-m", "engine", "serve", d.model, "--plan", str(d.rendered("plan.json")),
                    "--replica", str(m.replica), "--host", host, "--port", str(m.port)], cpus, None
        backend = probe_host(d.plan.serving.publish_address)
        backends = [f"[{backend}]:{r.port}" if ":" in backend else f"{backend}:{r.port}" for r in d.plan.replicas]
        listen = f"[{host}]:{m.port}" if ":" in host else f"{host}:{m.port}"
        if lb == "nginx":
            conf = self._nginx_conf(d, backends, listen)
            return ([shutil.which("nginx") or "nginx", "-p", str(conf.parent), "-c", str(conf), "-e", "stderr"], cpus,
                    conf.read_text())
        return [sys.executable, "-m", "deploykit.runtime.proxy", "--listen", listen,
                *(a for b in backends for a in ("--backend", b))], cpus, None

    def _nginx_conf(self, d: Deployment, backends: list[str], listen: str) -> Path:
        where = d.state.path / "nginx"
        where.mkdir(exist_ok=True)
        # As root, nginx's workers would switch to `nobody`, who cannot write temp files under root's state dir.
        user = "root" if os.geteuid() == 0 else None
        conf = where / "nginx.conf"
        conf.write_text(nginx.text(d.plan, backends, listen, str(where), user=user))
        return conf

    def _env(self, d: Deployment, m: Member) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_BINDING_ENV)}
        return {**env, **d.env(m.container), MARKER: str(d.state.path)}

    def _start(self, d: Deployment, m: Member, argv: list[str], cpus: list[int], env: dict, digest: str) -> Process:
        log_path = d.state.logs / f"{m.name}.log"
        d.state.logs.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} deploykit up: {shlex.join(argv)}\n".encode())
            log.flush()
            # The child inherits this thread's affinity: set it around the fork instead of a preexec_fn.
            mask = os.sched_getaffinity(0)
            if cpus:
                os.sched_setaffinity(0, cpus)
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=d.state.path, env=env, start_new_session=True)
            finally:
                os.sched_setaffinity(0, mask)
        self._children[proc.pid] = proc
        return Process(m.name, proc.pid, _start_time(proc.pid), m.port, str(log_path), digest, m.replica)

    def _alive(self, p: Process) -> bool:
        child = self._children.get(p.pid)
        if child is not None:
            return child.poll() is None
        stat = _stat(p.pid)
        return stat is not None and stat.state != "Z" and stat.start_time == p.start_time

    def _stop(self, procs: list[Process]) -> None:
        """Each process gets its stop signal (the engine drains, nginx finishes open streams) and its grace period,
        all at once; whatever is left of its process group after that is killed."""
        from ..render.container import ENGINE_STOP_SECONDS
        for p in procs:
            _kill(p.pid, signal.SIGQUIT if p.replica is None else signal.SIGTERM)
        deadline = time.monotonic() + ENGINE_STOP_SECONDS
        while any(self._alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in procs:
            if self._alive(p):
                _kill(p.pid, signal.SIGKILL)
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the engine-core child, if its front end left it behind
            except OSError:
                pass
            child = self._children.pop(p.pid, None)
            if child is not None:
                try:
                    child.wait(timeout=KILL_WAIT)
                except subprocess.TimeoutExpired:
                    pass


def _lb_kind() -> str:
    chosen = os.environ.get("DEPLOYKIT_LOCAL_LB", "")
    if chosen in ("builtin", "nginx"):
        if chosen == "nginx" and shutil.which("nginx") is None:
            raise RuntimeFailure("DEPLOYKIT_LOCAL_LB=nginx but no nginx binary is on PATH", value=chosen,
                                 hint="install nginx, or unset DEPLOYKIT_LOCAL_LB to use the built-in proxy")
        return chosen
    return "nginx" if shutil.which("nginx") else "builtin"


def _placement(m: Member, cpus: list[int]) -> str:
    return f"CPUs {cpulist.format(cpus)}" if cpus else "any CPU"


def _stat(pid: int) -> procfs.Stat | None:
    try:
        return procfs.read_stat(pid)
    except (OSError, ValueError):  # gone, or not a process
        return None


def _start_time(pid: int) -> int:
    stat = _stat(pid)
    return stat.start_time if stat else 0


def _confinement(pid: int) -> tuple[str | None, str | None]:
    try:
        return cpulist.format(os.sched_getaffinity(pid)), procfs.read_status(pid).get("Mems_allowed_list")
    except OSError:
        return None, None


def _marked(state_path: Path) -> list[int]:
    """Live processes whose environment names this deployment's state directory."""
    marker = f"{MARKER}={state_path}".encode()
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if marker in env.split(b"\0") and int(d.name) != os.getpid():
            stat = _stat(int(d.name))
            if stat is not None and stat.state != "Z":
                found.append(int(d.name))
    return found


def _gone(state_path: Path) -> None:
    """Returns once no process of the deployment is left (KILL_WAIT at most), so that `down`, and an `up` that rolls
    back, leave nothing behind when they return: a killed process takes a moment to exit (an engine core freeing its
    memory), and a child forked while its parent was being stopped appears only now; each is killed as it is found."""
    deadline = time.monotonic() + KILL_WAIT
    while (left := _marked(state_path)) and time.monotonic() < deadline:
        for pid in left:
            _kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _last_line(path: str) -> str:
    try:
        lines = [line for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return lines[-1][:200] if lines else "(empty log)"
