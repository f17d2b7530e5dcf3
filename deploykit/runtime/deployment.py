"""What `up` hands a runtime: the plan, its rendered files, the model on this host, the API key, and per member
(each replica, and the load balancer) its runtime-neutral Container and the host port it answers on.

`config_hash` is how a second `up` knows what to replace: it covers everything a member runs with, including the
part of plan.json that member reads (a replica reads its own entry, the model and serving settings, never the other
replicas'), so a changed spec replaces exactly the members it changes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..plan import Plan
from ..render.container import Container, containers
from .state import StateDir


@dataclass(frozen=True, slots=True)
class Member:
    container: Container
    port: int  # the host port it is published on (replica) or listens on (load balancer)

    @property
    def name(self) -> str:
        return self.container.name

    @property
    def replica(self) -> int | None:
        return self.container.replica


@dataclass(frozen=True, slots=True)
class Deployment:
    plan: Plan
    state: StateDir
    model: str  # the model directory or .gguf file on this host
    spec: str
    salt: bytes
    runtime: str = "docker"

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def members(self) -> tuple[Member, ...]:
        return members(self.plan, self.runtime)

    @property
    def lb(self) -> Member | None:
        """The load balancer, when the plan has one."""
        return next((m for m in self.members if m.replica is None), None)

    def rendered(self, name: str) -> Path:
        return self.state.rendered / name

    def env(self, c: Container) -> dict[str, str]:
        """The container's environment with pass-through variables (the API key) taken from ours; preflight has
        checked they are set."""
        return {k: (os.environ.get(k, "") if v is None else v) for k, v in c.env}

    def hashed_env(self, c: Container) -> dict[str, str]:
        """`env(c)` as it enters a config hash: pass-through values (secrets) replaced by `secret()`."""
        return {k: (self.secret(os.environ.get(k, "")) if v is None else v) for k, v in c.env}

    def reads(self, member: Member) -> object:
        """What this member reads from the mounted files, for its config hash."""
        if member.replica is None:
            return self.rendered("nginx.conf").read_text() if self.plan.serving.load_balancer else None
        view = self.plan.to_dict()
        view["replicas"] = [r for r in view["replicas"] if r["index"] == member.replica]
        return view

    def secret(self, value: str) -> str:
        """A salted hash standing in for a secret inside a config hash."""
        return hashlib.sha256(self.salt + value.encode()).hexdigest()

    def config_hash(self, member: Member, settings: dict) -> str:
        """`settings`: everything the runtime creates the member with, secrets already replaced by `secret()`."""
        body = {"deploykit": __version__, "settings": settings, "reads": self.reads(member)}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def members(plan: Plan, runtime: str = "docker") -> tuple[Member, ...]:
    """Replicas in index order, then the load balancer: the order they start in. Containers always have the load
    balancer (the only published port; the engines' network has no route out); local processes need one only in
    front of several replicas."""
    ports = {r.name: r.port for r in plan.replicas}
    out = tuple(Member(c, ports.get(c.name, plan.serving.port)) for c in containers(plan))
    if runtime == "local" and not plan.serving.load_balancer:
        return tuple(m for m in out if m.replica is not None)
    return out


def probe_host(publish_address: str) -> str:
    """Where this host reaches a published port: loopback for a wildcard address."""
    addr = publish_address.strip("[]")
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(addr, addr)


def url(publish_address: str, port: int, path: str = "") -> str:
    host = probe_host(publish_address)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"
