"""Node-side companions of the Kubernetes targets: pinning is only real when the kubelet hands out whole cores on one
NUMA node, so next to the chart (and the plain manifests) go a KubeletConfiguration snippet, an optional NRI
balloons policy, the seccomp profile file for the node path, and a short doc on why each setting matters.
The numbers (reserved CPUs, reserved memory per NUMA node) come from the plan's machine.
"""

from __future__ import annotations

import yaml

from .. import __version__, cpulist
from ..plan import Plan, Replica
from . import seccomp
from .output import File
from .templating import template

DIR = "node"
PER_NODE_RESERVED_MIB = 1024  # memory kept from every NUMA node for the kubelet, the OS and eviction headroom
KUBE_RESERVED_MIB = 512
EVICTION_MIB = 100
SECCOMP_PATH = "deploykit/engine.json"  # relative to the kubelet's seccomp directory (the chart's default)


def kubelet_replicas(plan: Plan) -> tuple[Replica, ...]:
    """The replica of each NUMA node whose slot leaves the kubelet its cores: the last one planned on the node (the
    only one with one replica per node). The other replicas' pods request all their cores (whole L3 groups)."""
    last = {r.numa_nodes[0]: r for r in plan.replicas}
    return tuple(sorted(last.values(), key=lambda r: r.index))


def reserved_cpus(plan: Plan) -> tuple[int, ...]:
    """CPUs of each NUMA node for the kubelet and the shared pool: the whole cores the plan gave the front end of the
    node's kubelet replica (all siblings), the only core ids the plan can name. () when one of them has none."""
    owners = kubelet_replicas(plan)
    if any(not r.frontend_cpus for r in owners):
        return ()
    return tuple(sorted({c for r in owners for c in r.frontend_cpus}))


def kubelet_cores(plan: Plan) -> int:
    """Physical cores per NUMA node the pods leave to the kubelet (the chart's placement.coresLeftToKubelet): the
    cores reserved_cpus names, else 1 (kubeReserved cpu), or 0 when a replica has a single core to give."""
    cpus = reserved_cpus(plan)
    owners = kubelet_replicas(plan)
    if not cpus:
        return 1 if min(r.cores for r in owners) > 1 else 0
    return max(1, max(len(r.frontend_cpus) for r in owners) // plan.hardware.threads_per_core)


def _l3_cores(plan: Plan) -> int:
    """Physical cores of one L3 group, when every replica is exactly one whole group (per-l3); else 0."""
    if plan.layout.strategy == "per-l3" and plan.layout.l3_groups_per_replica == 1:
        return max(r.cores for r in plan.replicas)
    return 0


def numa_nodes(plan: Plan) -> tuple[int, ...]:
    return tuple(sorted({n for r in plan.replicas for n in r.numa_nodes}))


def kubelet_config(plan: Plan) -> dict:
    nodes = numa_nodes(plan)
    total = PER_NODE_RESERVED_MIB * len(nodes)
    cfg: dict = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cpuManagerPolicy": "static",
        "cpuManagerPolicyOptions": {"full-pcpus-only": "true", **({"prefer-align-cpus-by-uncorecache": "true"}
                                                                   if plan.layout.l3_aligned else {})},
        "topologyManagerPolicy": "single-numa-node",
        "topologyManagerScope": "pod",
        "memoryManagerPolicy": "Static",
    }
    cpus = reserved_cpus(plan)
    if cpus:
        cfg["reservedSystemCPUs"] = cpulist.format(cpus)
    else:
        cfg["kubeReserved"] = {"cpu": "1"}
    # The memory manager requires sum(reservedMemory) == kubeReserved + systemReserved + evictionHard (memory).
    cfg["kubeReserved"] = {**cfg.get("kubeReserved", {}), "memory": f"{KUBE_RESERVED_MIB}Mi"}
    cfg["systemReserved"] = {"memory": f"{total - KUBE_RESERVED_MIB - EVICTION_MIB}Mi"}
    cfg["evictionHard"] = {"memory.available": f"{EVICTION_MIB}Mi"}
    cfg["reservedMemory"] = [{"numaNode": n, "limits": {"memory": f"{PER_NODE_RESERVED_MIB}Mi"}} for n in nodes]
    return cfg


def balloons_policy(plan: Plan) -> dict:
    biggest = max(r.cores for r in plan.replicas) * plan.hardware.threads_per_core
    cpus = reserved_cpus(plan)
    return {
        "apiVersion": "config.nri/v1alpha1",
        "kind": "BalloonsPolicy",
        "metadata": {"name": "default", "namespace": "kube-system"},
        "spec": {
            "reservedResources": {"cpu": f"cpuset:{cpulist.format(cpus)}" if cpus else "1"},
            "pinCPU": True,
            "pinMemory": True,
            "balloonTypes": [{
                "name": "deploykit-engine",
                "namespaces": [plan.name],
                "minCPUs": 0,
                "maxCPUs": biggest,
                "preferNewBalloons": True,
                "hideHyperthreads": not plan.policy.use_smt,
            }],
        },
    }


def _yaml(head: str, obj: dict) -> bytes:
    return (head + yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=120)).encode()


def files(plan: Plan) -> list[File]:
    gen = f"# Rendered by deploykit {__version__} for deployment \"{plan.name}\"; see {DIR}/README.md.\n"
    profile = seccomp.dumps(seccomp.flatten_for_oci(seccomp.profile()))
    return [
        File(f"{DIR}/kubelet-config.yaml", _yaml(gen + "# Merge into every inference node's KubeletConfiguration "
                                                  "(drain the node first: changing the CPU manager policy needs a "
                                                  "fresh cpu_manager_state).\n", kubelet_config(plan))),
        File(f"{DIR}/nri-balloons.yaml", _yaml(gen + "# Optional, instead of the static CPU manager: an example "
                                                "for the nri-plugins balloons policy (not validated here: no "
                                                "schema ships for it).\n", balloons_policy(plan))),
        File(f"{DIR}/seccomp/{SECCOMP_PATH}", profile),
        File(f"{DIR}/README.md", template("node-README.md.j2", plan=plan, kubelet=kubelet_config(plan),
                                          seccomp_path=SECCOMP_PATH, nodes=numa_nodes(plan),
                                          reserved=cpulist.format(reserved_cpus(plan)),
                                          kubelet_cores=kubelet_cores(plan),
                                          slots_per_node=-(-len(plan.replicas) // len(kubelet_replicas(plan))),
                                          l3_cores=_l3_cores(plan)).encode()),
    ]
