"""The Plan: everything renderers and the engine need, frozen. Renderers see only this, never the spec.

`Plan.to_dict()` is the documented JSON form (`deploykit plan --format json`); keys are stable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import cpulist


@dataclass(frozen=True, slots=True)
class Replica:
    index: int
    name: str
    numa_nodes: tuple[int, ...]
    cpus: tuple[int, ...]  # inference CPUs, one OpenMP thread each, in thread order
    frontend_cpus: tuple[int, ...]  # HTTP/tokenizer process; () = shares `cpus`
    mems: tuple[int, ...]  # NUMA nodes memory is bound to
    omp_threads: int
    port: int  # host port this replica is published on
    memory_bytes: int  # this replica's share of its nodes' memory
    weight_bytes: int
    kv_cache_bytes: int
    memory_limit_bytes: int  # weights + KV + headroom: the container memory limit
    env: tuple[tuple[str, str], ...]  # sorted (name, value)

    @property
    def cpuset(self) -> tuple[int, ...]:
        """Every CPU the replica's container may use."""
        return tuple(sorted(set(self.cpus) | set(self.frontend_cpus)))

    def to_dict(self) -> dict:
        return {
            "index": self.index, "name": self.name, "numa_nodes": list(self.numa_nodes), "cpus": list(self.cpus),
            "cpus_list": cpulist.format(self.cpus), "frontend_cpus": list(self.frontend_cpus),
            "frontend_cpus_list": cpulist.format(self.frontend_cpus), "cpuset": cpulist.format(self.cpuset),
            "mems": list(self.mems), "mems_list": cpulist.format(self.mems), "omp_threads": self.omp_threads,
            "port": self.port, "memory_bytes": self.memory_bytes, "weight_bytes": self.weight_bytes,
            "kv_cache_bytes": self.kv_cache_bytes, "memory_limit_bytes": self.memory_limit_bytes,
            "env": dict(self.env),
        }


@dataclass(frozen=True, slots=True)
class ModelPlan:
    source: str
    path: str | None  # local directory, None when sized from the spec's architecture numbers
    architecture: str
    dtype: str  # resolved: bfloat16 | float32
    max_model_len: int
    num_parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    served_name: str
    sized_from: str  # safetensors | config.json | spec


@dataclass(frozen=True, slots=True)
class ServingPlan:
    port: int  # what clients connect to (the load balancer when there are several replicas)
    publish_address: str
    max_num_seqs: int
    max_num_batched_tokens: int
    api_key_env: str | None
    api_key_secret: tuple[str, str] | None  # (secret name, key)
    load_balancer: bool


@dataclass(frozen=True, slots=True)
class ImagePlan:
    name: str
    tag: str
    base: str
    wheelhouse: str | None

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


@dataclass(frozen=True, slots=True)
class SecurityPlan:
    seccomp: str
    run_as_user: int
    read_only_root: bool


@dataclass(frozen=True, slots=True)
class HardwareSummary:
    source: str  # auto | sysroot | inline
    cpu_model: str
    isa_tier: str
    isa: tuple[str, ...]
    sockets: int
    numa_nodes: int
    threads_per_core: int
    online_cpus: int
    allowed_cpus: tuple[int, ...]
    quota_cpus: float | None


@dataclass(frozen=True, slots=True)
class Plan:
    name: str
    model: ModelPlan
    replicas: tuple[Replica, ...]
    serving: ServingPlan
    image: ImagePlan
    security: SecurityPlan
    targets: tuple[str, ...]
    hardware: HardwareSummary
    warnings: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        m, s, h = self.model, self.serving, self.hardware
        return {
            "apiVersion": "deploykit/v1", "kind": "Plan", "name": self.name,
            "model": {"source": m.source, "path": m.path, "architecture": m.architecture, "dtype": m.dtype,
                      "max_model_len": m.max_model_len, "num_parameters": m.num_parameters,
                      "weight_bytes": m.weight_bytes, "kv_bytes_per_token": m.kv_bytes_per_token,
                      "served_name": m.served_name, "sized_from": m.sized_from},
            "replicas": [r.to_dict() for r in self.replicas],
            "serving": {"port": s.port, "publish_address": s.publish_address, "max_num_seqs": s.max_num_seqs,
                        "max_num_batched_tokens": s.max_num_batched_tokens, "api_key_env": s.api_key_env,
                        "api_key_secret": list(s.api_key_secret) if s.api_key_secret else None,
                        "load_balancer": s.load_balancer},
            "image": {"name": self.image.name, "tag": self.image.tag, "base": self.image.base,
                      "wheelhouse": self.image.wheelhouse},
            "security": {"seccomp": self.security.seccomp, "run_as_user": self.security.run_as_user,
                         "read_only_root": self.security.read_only_root},
            "targets": list(self.targets),
            "hardware": {"source": h.source, "cpu_model": h.cpu_model, "isa_tier": h.isa_tier, "isa": list(h.isa),
                         "sockets": h.sockets, "numa_nodes": h.numa_nodes, "threads_per_core": h.threads_per_core,
                         "online_cpus": h.online_cpus, "allowed_cpus": cpulist.format(h.allowed_cpus),
                         "quota_cpus": h.quota_cpus},
            "warnings": list(self.warnings),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
