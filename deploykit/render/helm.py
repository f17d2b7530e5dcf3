"""The helm target: a values file for the deploykit chart made from the Plan, plus a copy of the chart and the
node-side companions, so a rendered directory installs (`helm install NAME helm/deploykit -f helm/values.yaml`)
or syncs (an Argo CD Application on helm/deploykit) on its own, pinned to the chart of this deploykit version.

The chart never sees host CPU ids: a slot is a number of whole physical cores and a memory size; each pod's engine
binds to the cpuset the kubelet gives it (binding auto), with the plan's policy.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from .. import __version__, isa
from ..plan import Plan, Replica
from . import node
from .output import File
from .templating import package_dir

CHART = "deploykit"
VALUES = "helm/values.yaml"
SECCOMP_TYPES = {"least-privilege": "Localhost", "runtime-default": "RuntimeDefault", "unconfined": "Unconfined"}
_SKIP = ("__pycache__", ".pyc", "__init__.py")


def chart_dir() -> Path:
    return package_dir("deploykit.chart", f"charts/{CHART}")


def chart_files(prefix: str = f"helm/{CHART}") -> list[File]:
    root = chart_dir()
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not any(s in rel for s in _SKIP):
            out.append(File(f"{prefix}/{rel}", p.read_bytes()))
    return out


def mebibytes(n: int) -> str:
    """A Kubernetes quantity no smaller than `n` bytes."""
    return f"{math.ceil(n / 2**20)}Mi"


def values(plan: Plan) -> dict:
    """The chart's values for this plan, in values.yaml's key order."""
    sec, sv, m = plan.security, plan.serving, plan.model
    secret = sv.api_key_secret or ((f"{plan.name}-api-key", "api-key") if sv.api_key_env else None)
    return {
        "fullnameOverride": plan.name,
        "image": {"repository": plan.image.name, "tag": plan.image.tag,
                  **({"digest": plan.image.digest} if plan.image.digest else {})},
        "model": {"source": "pvc", "pvc": {"claimName": f"{plan.name}-model"},
                  "file": m.path.rsplit("/", 1)[-1] if m.is_file and m.path else "",
                  "servedName": m.served_name, "dtype": m.dtype, "maxModelLen": m.max_model_len},
        "engine": {"port": sv.port, "maxNumSeqs": sv.max_num_seqs, "maxNumBatchedTokens": sv.max_num_batched_tokens,
                   # written only when off: the chart's default is on, and values files state what differs
                   **({} if sv.prefix_caching else {"prefixCaching": False}),
                   "apiKey": {"secretName": secret[0] if secret else "", "key": secret[1] if secret else "api-key"}},
        "binding": {"reservedCpus": plan.policy.reserved_cpus, "useSmt": plan.policy.use_smt,
                    "threads": plan.policy.threads},
        "placement": {
            "threadsPerCore": plan.hardware.threads_per_core,
            "coresLeftToKubelet": node.kubelet_cores(plan),
            "slots": [_slot(plan, r) for r in plan.replicas]},
        "nodeFeatures": list(isa.node_features(plan.hardware.isa_tier, m.dtype, bool(m.weight_formats))),
        "security": {"runAsUser": sec.run_as_user, "runAsGroup": sec.run_as_user,
                     "readOnlyRootFilesystem": sec.read_only_root, "sysNice": sec.sys_nice},
        "seccomp": {"type": SECCOMP_TYPES[sec.seccomp]},
    }


def _slot(plan: Plan, r: Replica) -> dict:
    slot = {"name": str(r.index), "cores": r.cores, "memory": mebibytes(r.memory_limit_bytes),
            "kvCache": str(r.kv_cache_bytes), "numaNode": r.numa_nodes[0], "replicas": 1}
    if len(plan.replicas) > len(node.kubelet_replicas(plan)):  # several slots per NUMA node
        # Only the node's kubelet replica leaves the kubelet its cores; the others request every core they were
        # planned with, so a per-L3 pod asks for whole L3 groups.
        if node.kubelet_cores(plan) and r not in node.kubelet_replicas(plan):
            slot["coresLeftToKubelet"] = 0
        if r.l3_groups:
            slot["l3Groups"] = len(r.l3_groups)
    return slot


def values_yaml(plan: Plan) -> str:
    head = [f"# Values for the deploykit chart, deployment \"{plan.name}\" (rendered by deploykit {__version__} from "
            "the plan; re-render rather than edit).",
            f"#   helm install {plan.name} helm/deploykit -f helm/values.yaml -n NAMESPACE",
            f"# Each slot is one replica of the plan: {plan.hardware.cpu_model}, {plan.hardware.numa_nodes} NUMA "
            f"node(s), {plan.hardware.threads_per_core} thread(s) per core. Pods request whole cores (cores minus "
            "placement.coresLeftToKubelet, times threadsPerCore) and memory = the plan's limit.",
            f"# The model comes from the PersistentVolumeClaim {plan.name}-model (create it, or switch model.source)."]
    if plan.serving.api_key_env and not plan.serving.api_key_secret:
        head.append(f"# The API key is read from the Secret {plan.name}-api-key (key api-key): create it first; pods "
                    "do not start without it.")
    return "\n".join(head) + "\n" + yaml.safe_dump(values(plan), sort_keys=False, default_flow_style=False, width=120)


def files(plan: Plan) -> list[File]:
    return [File(VALUES, values_yaml(plan).encode()), *chart_files(), *node.files(plan)]
