"""Runtimes that run a plan: `docker` (the Docker Engine API through the docker SDK) and `local` (the replicas as
processes on this host). Both take the same Deployment (deployment.py) and offer the same verbs, used by
`deploykit up / down / status / logs` (lifecycle.py).

apply    start what is missing, replace what changed (config hash), keep the rest; records it in a Change. When the
         load balancer stays, replicas are replaced one at a time, each healthy before the next goes: the
         deployment keeps serving through an update
commit   after every member is healthy: drop what the change superseded
rollback after a failure or Ctrl-C: remove what the change started, and bring back what it superseded
observe  every member as the runtime sees it (state, id, the CPUs and memory nodes it confines it to)
fetch    GET a path of a member's HTTP server from this host (health, binding report, metrics)
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import RuntimeFailure

Say = Callable[[str], None]
Ready = Callable[[object], None]  # waits until one member (a deployment.Member) is healthy, or raises
RUNTIMES = ("auto", "docker", "local")


@dataclass(frozen=True, slots=True)
class Observed:
    name: str
    replica: int | None  # None: the load balancer
    id: str  # container id (12 hex) or pid
    state: str  # running | restarting | exited | created | paused | dead
    detail: str = ""  # exit code, restart count, why it is gone
    restarts: int = 0
    cpus: str | None = None  # what the runtime confines it to (container cpuset, process affinity)
    mems: str | None = None
    config_hash: str = ""


@dataclass(slots=True)
class Change:
    """What one `apply` did, by member name. Mutable on purpose: apply fills it as it goes, so a failure or Ctrl-C
    halfway still leaves an exact record for rollback."""

    created: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)  # superseded (replaced or no longer planned); see commit
    network_created: bool = False
    restarts: dict[str, int] = field(default_factory=dict)  # restart counts when apply finished
    image: str = ""  # docker: the image the containers run


class Runtime(Protocol):
    name: str
    where: str  # a few words on what answered, e.g. "Docker 20.10.24 at unix:///var/run/docker.sock"

    def apply(self, d, change: Change, say: Say, ready: Ready) -> None: ...
    def commit(self, d, change: Change, say: Say) -> None: ...
    def rollback(self, d, change: Change, say: Say) -> None: ...
    def observe(self, name: str) -> dict[str, Observed]: ...
    def fetch(self, plan, member, path: str, *, timeout: float, api_key: str | None = None): ...
    def tail(self, name: str, member: str, lines: int) -> str: ...
    def logs(self, name: str, members: list[str], follow: bool, tail: int | None) -> None: ...
    def down(self, name: str, volumes: bool, say: Say) -> list[str]: ...


@contextlib.contextmanager
def atomic() -> Iterator[None]:
    """One step Ctrl-C (or SIGTERM) cannot cut in half: a container created but not yet recorded, a process started
    but not in state.json. The interrupt is held and raised when the step is done, so rollback sees everything."""
    held: list[int] = []

    def hold(signum, frame) -> None:
        if not held:
            print("interrupted: finishing the current step, then undoing", file=sys.stderr, flush=True)
        held.append(signum)

    old = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if held:
            raise KeyboardInterrupt


def choose(requested: str, say: Say, state_dir=None) -> Runtime:
    """`auto`: Docker when its daemon answers, else local processes; which one (and why) is always said."""
    from .local import LocalRuntime
    if requested == "local":
        rt: Runtime = LocalRuntime(state_dir)
        say(f"runtime: local ({rt.where})")
        return rt
    from .docker import DockerRuntime
    if requested == "docker":
        rt = DockerRuntime.connect()
        say(f"runtime: docker ({rt.where})")
        return rt
    try:
        rt = DockerRuntime.connect()
    except RuntimeFailure as e:
        why = e.problems[0].message.splitlines()[0] if e.problems else str(e)
        rt = LocalRuntime(state_dir)
        say(f"runtime: local, because Docker is not available ({why}); --runtime docker insists on Docker")
        return rt
    say(f"runtime: docker ({rt.where}); --runtime local runs the replicas as processes instead")
    return rt
