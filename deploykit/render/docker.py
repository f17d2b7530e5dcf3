"""The Docker target: the engine image's build context plus run.sh, one `docker run` per container."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from ..plan import Plan
from .container import INTERNAL, INTERNAL_OPTIONS, Container, containers, model_mount, network_name
from .image import image_files
from .output import File
from .templating import dq, template

def files(plan: Plan) -> list[File]:
    return [*image_files(plan), File("run.sh", run_sh(plan).encode(), 0o755)]


def run_sh(plan: Plan) -> str:
    mm = model_mount(plan)
    model = plan.model.path
    model_env = ("${" + mm.variable + ":-" + dq(model) + "}" if model else
                 "${" + mm.variable + f":?set {mm.variable} to the model {mm.what} on this host (nothing is downloaded "
                 "at run time)}")
    cs = [_RunArgs(c, plan.name, mm.variable) for c in containers(plan)]
    internal = " ".join(["--internal", *(f"--opt {k}={v}" for k, v in INTERNAL_OPTIONS)])
    networks = [(network_name(plan.name, role), internal if role == INTERNAL else "")
                for role in sorted({r for c in cs for r in c.container.networks})]
    return template("run.sh.j2", plan=plan, lb=plan.serving.load_balancer, networks=networks, containers=cs,
                    model=mm, model_env=model_env, notes=_notes(plan))


def _notes(plan: Plan) -> list[str]:
    if plan.security.seccomp == "unconfined":
        return ["WARNING: security.seccomp is 'unconfined': these containers run without any syscall filter.",
                "The least-privilege profile (security.seccomp: least-privilege) allows NUMA binding and page",
                "migration and still blocks mount, ptrace, bpf, kexec and namespace creation."]
    if plan.security.seccomp == "runtime-default":
        return ["security.seccomp is 'runtime-default': Docker's profile refuses set_mempolicy/mbind without",
                "CAP_SYS_NICE and migrate_pages/move_pages always, so the engine cannot bind or move its memory",
                "itself (--cpuset-mems below still confines it). least-privilege allows them with no capability."]
    return []


@dataclass(frozen=True, slots=True)
class _RunArgs:
    """A Container as `docker run` arguments, one shell-quoted flag (with its value) per line."""

    container: Container
    deployment: str
    model_variable: str  # the host path of the "model" mount

    @property
    def name(self) -> str:
        return self.container.name

    @property
    def comment(self) -> str:
        return self.container.comment

    @property
    def connect(self) -> list[str]:
        """Networks joined after `docker create`, before it starts (docker run takes one network)."""
        return [network_name(self.deployment, role) for role in self.container.networks[1:]]

    @property
    def args(self) -> list[str]:
        c, q = self.container, shlex.quote
        a = [f"--name {q(c.name)}", *(f"--label {q(f'{k}={v}')}" for k, v in c.labels), "--restart unless-stopped"]
        if c.stop_seconds is not None:
            a.append(f"--stop-timeout {c.stop_seconds}")
        if c.stop_signal is not None:
            a.append(f"--stop-signal {c.stop_signal}")
        a.append(f"--network {q(network_name(self.deployment, c.networks[0]))}")
        if c.cpuset:
            a.append(f"--cpuset-cpus {q(c.cpuset)}")
        if c.mems:
            a.append(f"--cpuset-mems {q(c.mems)}")
        a += [f"--memory {c.memory}", f"--memory-swap {c.memory}"]  # equal: no swapping behind the engine's back
        if c.shm_size:
            a.append(f"--shm-size {c.shm_size}")
        a.append(f"--user {c.user}")
        if c.read_only:
            a.append("--read-only")
        a += [f"--tmpfs {q(c.tmpfs)}", "--cap-drop ALL", *(f"--cap-add {cap}" for cap in c.caps_add),
              "--security-opt no-new-privileges", *(f"--sysctl {q(f'{k}={v}')}" for k, v in c.sysctls)]
        if c.seccomp == "unconfined":
            a.append("--security-opt seccomp=unconfined")
        elif c.seccomp:
            a.append(f'--security-opt "seccomp=$HERE/{c.seccomp}"')
        for k, v in c.env:
            a.append(f"--env {k}" if v is None else f"--env {q(f'{k}={v}')}")
        for m in c.mounts:
            src = f"${self.model_variable}" if m.source == "model" else f"$HERE/{m.source}"
            a.append(f'--volume "{src}:{m.target}:ro"')
        if c.publish:
            a.append(f"--publish {q(c.publish)}")
        if c.entrypoint:
            a.append(f"--entrypoint {q(c.entrypoint[0])}")
        a.append(" ".join(['"$IMAGE"', *(q(x) for x in c.entrypoint[1:])]))
        return a

