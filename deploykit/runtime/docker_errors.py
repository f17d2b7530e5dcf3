"""The Docker daemon's failures in the user's terms: not running, not allowed, or refusing a container (a port in
use, CPUs or memory nodes this host does not have), each with the fix."""

from __future__ import annotations

import os

from ..errors import PlanError, RuntimeFailure
from .deployment import Deployment, Member

START_HINT = ("start it: sudo systemctl start docker (without systemd: sudo service docker start; Docker Desktop: "
              "open it), or run without Docker: --runtime local")


def daemon_is_local() -> bool:
    host = os.environ.get("DOCKER_HOST", "")
    if not host or host.startswith("unix://"):
        return True
    rest = host.split("://", 1)[-1]
    return rest.startswith(("localhost", "127.0.0.1", "[::1]")) and not host.startswith("ssh://")


def not_running(host: str, e: Exception) -> RuntimeFailure:
    text = str(e)
    if "Permission denied" in text or "PermissionError" in text:
        return RuntimeFailure(f"Docker refused this user at {host} (permission denied)", value=text[:200],
                              hint="add yourself to the docker group: sudo usermod -aG docker $USER (then log in "
                                   "again), or run as root; or run without Docker: --runtime local")
    if host.startswith("unix://") and not os.path.exists(host.removeprefix("unix://")):
        return RuntimeFailure(f"Docker is not running (no socket at {host.removeprefix('unix://')})",
                              value=text[:200], hint=START_HINT)
    if os.environ.get("DOCKER_HOST"):
        return RuntimeFailure(f"Docker is not answering at DOCKER_HOST={host}", value=text[:200],
                              hint="start the daemon there or unset DOCKER_HOST; or run without Docker: "
                                   "--runtime local")
    return RuntimeFailure(f"Docker is not answering at {host}", value=text[:200], hint=START_HINT)


def refused(d: Deployment, m: Member, e) -> RuntimeFailure:
    """The daemon's refusal in the spec's terms: ports and cpusets are the usual ones."""
    text = str(getattr(e, "explanation", None) or e)
    if "port is already allocated" in text or "address already in use" in text:
        return RuntimeFailure(f"{m.name}: port {m.port} is already in use", path="serving.port", value=m.port,
                              hint="stop what listens there, or change serving.port (replicas use the ports after "
                                   f"it); Docker said: {text}")
    if "cpuset" in text.lower() or "Requested CPUs" in text or "memory nodes" in text:
        return PlanError(f"{m.name}: Docker refused the planned CPUs or memory nodes: {text}", path="placement",
                         value=f"cpus {m.container.cpuset}, mems {m.container.mems}",
                         hint="plan for this host (hardware: auto) or change placement.cpus")
    return RuntimeFailure(f"{m.name}: Docker refused to create or start the container: {text}",
                          hint="see the message above; `deploykit logs` shows the container's output")
