"""The compose target: compose.yaml with one service per replica (plus nginx), the same settings as run.sh."""

from __future__ import annotations

import yaml

from ..plan import Plan
from .container import INTERNAL, INTERNAL_OPTIONS, Container, containers, healthcheck, model_mount
from .image import image_files
from .output import File
from .templating import template


def files(plan: Plan) -> list[File]:
    return [*image_files(plan), File("compose.yaml", compose_yaml(plan).encode())]


def compose_yaml(plan: Plan) -> str:
    model, mm = plan.model.path, model_mount(plan)
    model_src = ("${" + mm.variable + ":-" + model.replace("$", "$$") + "}" if model else
                 "${" + mm.variable + f":?set {mm.variable} to the model {mm.what} on this host (nothing is downloaded "
                 "at run time)}")
    cs = containers(plan)
    services = {c.name: _service(plan, c, model_src) for c in cs}
    # The engines' network is internal and has no address on the host: no route out, not even to the host.
    networks = {role: {"internal": True, "driver_opts": dict(INTERNAL_OPTIONS)} if role == INTERNAL else {}
                for role in sorted({r for c in cs for r in c.networks})}
    body = yaml.safe_dump({"networks": networks, "services": services}, sort_keys=True, default_flow_style=False,
                          width=120)
    return template("compose-header.j2", plan=plan, lb=plan.serving.load_balancer, model=mm) + body


def _service(plan: Plan, c: Container, model_src: str) -> dict:
    s: dict = {
        "image": plan.image.ref,
        "labels": dict(c.labels),
        "restart": "unless-stopped",
        "mem_limit": c.memory,
        "memswap_limit": c.memory,
        "user": c.user,
        "read_only": c.read_only,
        "tmpfs": [c.tmpfs],
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "networks": list(c.networks),
        "volumes": [f"{model_src if m.source == 'model' else './' + m.source}:{m.target}:ro" for m in c.mounts],
        "healthcheck": {"test": ["CMD", *healthcheck(plan.serving.port)], "interval": "10s",
                        "timeout": "5s", "retries": 3, "start_period": "600s"},
    }
    if c.publish:
        s["ports"] = [c.publish]
    if c.sysctls:
        s["sysctls"] = dict(c.sysctls)
    if c.cpuset:
        s["cpuset"] = c.cpuset
    if c.caps_add:
        s["cap_add"] = list(c.caps_add)
    if c.seccomp:
        s["security_opt"].append(f"seccomp={'unconfined' if c.seccomp == 'unconfined' else './' + c.seccomp}")
    if c.shm_size:
        s["shm_size"] = c.shm_size
    if c.env:
        # None marks the API key: compose takes it from the caller's environment by name, and refuses to start
        # the deployment when it is unset (an engine without its key would serve unauthenticated).
        s["environment"] = {k: v if v is not None else f"${{{k}:?export {k}: the deployment requires an API key}}"
                            for k, v in c.env}
    if c.entrypoint:
        s["entrypoint"] = list(c.entrypoint)
    if c.stop_seconds is not None:
        s["stop_grace_period"] = f"{c.stop_seconds}s"
    if c.stop_signal is not None:
        s["stop_signal"] = c.stop_signal
    if c.depends_on:
        s["depends_on"] = {name: {"condition": "service_started"} for name in c.depends_on}
    return s
