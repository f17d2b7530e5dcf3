"""The fixes doctor prints, as commands or spec changes, built from the facts' own homes: which capabilities the
least-privilege seccomp profile needs (deploykit.render.seccomp), how many threads on which CPUs
(deploykit.placement), so a fix never disagrees with what `deploykit render` writes."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from .. import cpulist, numa, placement
from ..errors import PlanError
from ..topology import Topology

SECCOMP_FILE = "seccomp.json"  # Docker form (conditions evaluated by dockerd)
SECCOMP_OCI_FILE = "seccomp-oci.json"  # flattened for containerd / CRI-O (Kubernetes Localhost profiles)
NUMA_CALLS = numa.PROBED  # the calls doctor probes are the ones a fix must let through


@cache
def profile_caps() -> tuple[str, ...]:
    """Capabilities (without CAP_) the least-privilege profile wants before it lets the NUMA calls through: the
    profile's own `includes.caps` on those rules, so this follows the profile if it changes."""
    from ..render import seccomp
    caps: set[str] = set()
    for rule in seccomp.profile()["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW" and set(rule["names"]) & set(NUMA_CALLS):
            caps.update((rule.get("includes") or {}).get("caps") or ())
    return tuple(sorted(c.removeprefix("CAP_") for c in caps))


def numa_calls(refused: tuple[str, ...]) -> tuple[str, ...]:
    """How to let a container bind its memory: deploykit's profile with capabilities dropped, per runtime."""
    caps = profile_caps()
    add = "".join(f" --cap-add {c}" for c in caps)
    compose_add = f", cap_add: [{', '.join(caps)}]" if caps else ""
    k8s_add = f", add: [{', '.join(caps)}]" if caps else ""
    weaker = []
    if {"migrate_pages", "move_pages"} & set(refused):
        weaker.append("Docker's default profile with --cap-add SYS_NICE allows get/set_mempolicy and mbind but still "
                      "refuses migrate_pages and move_pages")
    weaker.append("--security-opt seccomp=unconfined also works but turns the whole filter off")
    return (
        f"docker run --cap-drop ALL{add} --security-opt seccomp={SECCOMP_FILE} ...",
        f"compose: security_opt: [\"seccomp={SECCOMP_FILE}\"], cap_drop: [ALL]{compose_add}",
        "Kubernetes: securityContext: {seccompProfile: {type: Localhost, localhostProfile: "
        f"deploykit/{SECCOMP_OCI_FILE}}}, capabilities: {{drop: [ALL]{k8s_add}}}}} (the file goes into the kubelet's "
        "seccomp directory, /var/lib/kubelet/seccomp/deploykit/)",
        f"the profiles: `deploykit doctor --write-seccomp DIR` writes {SECCOMP_FILE} and {SECCOMP_OCI_FILE}; "
        "`deploykit render` writes them next to run.sh (spec: security.seccomp: least-privilege)",
        "weaker: " + "; ".join(weaker),
    )


def write_seccomp(directory: str | Path) -> list[str]:
    """The least-privilege profile in both forms, for containers deploykit did not render (vLLM, llama.cpp...)."""
    from ..errors import OutputError
    from ..render import seccomp
    d = Path(directory)
    prof = seccomp.profile()
    files = {SECCOMP_FILE: seccomp.dumps(prof),
             SECCOMP_OCI_FILE: seccomp.dumps(seccomp.flatten_for_oci(prof, arch=os.uname().machine,
                                                                     caps=frozenset(profile_caps())))}
    try:
        d.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (d / name).write_bytes(data)
    except (OSError, ValueError) as e:
        raise OutputError(f"cannot write the seccomp profiles: {e}", path=str(d)) from None
    return [str(d / name) for name in files]


def thread_choice(topo: Topology, cpus: tuple[int, ...] | None = None,
                  quota: float | None = None) -> placement.CpuChoice | None:
    """What deploykit would run on these CPUs: one OpenMP thread per physical core, quota-capped, with the front
    end on a core of its own (placement.choose, the policy the planner and the engine share)."""
    cand = cpus if cpus is not None else topo.allowed_cpus
    try:
        return placement.choose(topo, cand, quota=quota if quota is not None else topo.quota_cpus, label="here")
    except PlanError:  # no usable CPU: nothing to recommend
        return None


def thread_env(choice: placement.CpuChoice) -> str:
    """The environment for one inference process on `choice`, pinned by the inference process itself."""
    return f"OMP_NUM_THREADS={len(choice.cpus)} (one per physical core: CPUs {cpulist.format(choice.cpus)})"
