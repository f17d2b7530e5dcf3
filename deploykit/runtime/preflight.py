"""Checks `up` makes before it starts anything, so the common mistakes fail in a second with a fix instead of as a
container that dies or a port Docker cannot bind: the model (present, readable by the UID that runs the engine,
self-contained), the API key variable, free ports, and CPUs and memory nodes this host has.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from .. import cpulist
from ..errors import ModelError, PlanError, RuntimeFailure, SpecError
from ..plan import Plan
from .deployment import Deployment, Member

MAX_LISTED = 6


def model_path(plan: Plan) -> str:
    """The model on this host; `up` never downloads one."""
    if plan.model.path is None:
        raise ModelError("deploykit up needs the model on this host (nothing is downloaded)", path="model.source",
                         value=plan.model.source,
                         hint="point model.source at a local model directory or .gguf file, or put the model in the "
                              "local Hugging Face cache")
    if not os.path.exists(plan.model.path):
        raise ModelError("the model is not there", path="model.source", value=plan.model.path,
                         hint="check the path (relative paths are relative to the spec file)")
    return plan.model.path


def model_readable(path: str, uid: int | None) -> None:
    """Every file and directory of the model readable by `uid` (the container's user; its group is the same
    number), or by this process when uid is None. Symlinks leaving the model directory are refused for containers:
    only the directory is mounted, so a Hugging Face cache snapshot (links into ../../blobs) looks empty inside."""
    root = Path(path)
    entries = [root] + (sorted(root.rglob("*")) if root.is_dir() else [])
    unreadable, outside = [], []
    for p in entries:
        if uid is not None and p.is_symlink() and root.is_dir() and not _inside(p.resolve(), root.resolve()):
            outside.append(str(p.relative_to(root)))
            continue
        try:
            st = p.stat()
        except OSError as e:
            unreadable.append(f"{p} ({e.strerror})")
            continue
        need = 0o5 if stat.S_ISDIR(st.st_mode) else 0o4  # directories: list and traverse
        if not (_allows(st, need, uid) if uid is not None else
                os.access(p, os.R_OK | (os.X_OK if need == 0o5 else 0))):
            unreadable.append(f"{p} (mode {stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}:{st.st_gid})")
    if outside:
        raise ModelError("the model directory links to files outside it; the container sees only the directory, so "
                         "those links would be dangling inside", path="model.source", value=_some(outside),
                         hint=f"copy the model with the links resolved: cp -rL {path} /models/NAME, and point "
                              "model.source there")
    if unreadable:
        who = f"UID {uid}, the containers' user (security.run_as_user)" if uid is not None else "this user"
        fix = (f"chmod -R a+rX {path}   (or chown -R {uid}:{uid} it, or set security.run_as_user to its owner)"
               if uid is not None else f"chmod -R u+rX {path}, or run deploykit as a user who can read it")
        raise ModelError(f"model files are not readable by {who}", path="model.source", value=_some(unreadable),
                         hint=fix)


def api_key(plan: Plan) -> None:
    name = plan.serving.api_key_env
    if name and not os.environ.get(name):
        raise SpecError(f"the deployment requires an API key in ${name}, which is not set", path="serving.api_key",
                        value={"env": name},
                        hint=f"export {name}=... first (it is passed to the engines by name, never written down)")


def cpus_on_host(plan: Plan, cpus: Iterable[int], mems: Iterable[int], where: str) -> None:
    """Every replica's CPUs and memory nodes exist here (a plan made for another machine, or a changed host)."""
    cpus, mems = set(cpus), set(mems)
    for r in plan.replicas:
        missing = sorted(set(r.cpuset) - cpus)
        if missing:
            raise PlanError(f"replica {r.name} is planned on CPUs {where} does not have", path="placement",
                            value=cpulist.format(missing), allowed=cpulist.format(cpus),
                            hint="plan for this host (hardware: auto, or a snapshot of it) or change placement.cpus")
        missing = sorted(set(r.mems) - mems)
        if missing:
            raise PlanError(f"replica {r.name} binds memory to NUMA nodes {where} does not have", path="placement",
                            value=cpulist.format(missing), allowed=cpulist.format(mems),
                            hint="plan for this host (hardware: auto) or change placement.memory_nodes")


def ports_free(d: Deployment, members: Iterable[Member], ours: set[int],
               holder: Callable[[int], str] = lambda port: "") -> None:
    """Each member's host port can be bound, unless this deployment itself holds it (a member `up` keeps or
    replaces). `holder(port)` names who has it, where the runtime can tell."""
    address = d.plan.serving.publish_address.strip("[]")
    for m in members:
        if m.port in ours or can_bind(address, m.port):
            continue
        who = holder(m.port)
        raise RuntimeFailure(f"port {m.port} on {address} is already in use{f' by {who}' if who else ''} ({m.name} "
                             "needs it)", path="serving.port", value=m.port,
                             hint="stop what listens there (ss -ltnp 'sport = :PORT' shows it), or change "
                                  "serving.port (replicas use the ports after it)".replace("PORT", str(m.port)))


def can_bind(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is no conflict
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _allows(st: os.stat_result, need: int, uid: int) -> bool:
    if st.st_uid == uid:
        return (st.st_mode >> 6) & need == need
    if st.st_gid == uid:  # the container runs as uid:uid
        return (st.st_mode >> 3) & need == need
    return st.st_mode & need == need


def _inside(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def _some(items: list[str]) -> str:
    more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more
