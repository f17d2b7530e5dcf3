"""The Plan: everything renderers and the engine need, frozen. Renderers see only this, never the spec.

`Plan.to_dict()` is the documented JSON form (`deploykit plan --format json`, plan.json); keys are stable. It is
derived from the dataclass fields alone (tuples become lists; fields marked `cpulist` are written in the Linux list
syntax), so every fact is in it once, and `Plan.from_dict` reads it back: the engine gets its replica's placement
as a typed object, whether from `deploykit serve` or from plan.json in a container. What is derived from the plan
(a container's environment, its cpuset) is computed where it is used (deploykit.render.container).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field

from . import cpulist
from .errors import PlanError

API_VERSION = "deploykit/v1"
_CPULIST = {"json": "cpulist"}  # written as "0-3,8", read back to a tuple of ints


@dataclass(frozen=True, slots=True)
class Replica:
    index: int
    name: str
    numa_nodes: tuple[int, ...]
    cpus: tuple[int, ...] = field(metadata=_CPULIST)  # inference CPUs, one OpenMP thread each (thread i: the ith)
    frontend_cpus: tuple[int, ...] = field(metadata=_CPULIST)  # HTTP/tokenizer process; () = shares `cpus`
    mems: tuple[int, ...] = field(metadata=_CPULIST)  # NUMA nodes memory is bound to
    omp_threads: int  # len(cpus): checked, never different
    port: int  # host port this replica is published on
    memory_bytes: int  # this replica's share of its nodes' memory
    weight_bytes: int
    kv_cache_bytes: int
    memory_limit_bytes: int  # weights + KV + headroom: the container memory limit
    cores: int = 0  # physical cores the replica uses (inference + front end): a Kubernetes pod requests them whole
    l3_groups: tuple[int, ...] = ()  # L3 (last-level cache) groups its CPUs lie in; () when the host does not say

    def __post_init__(self) -> None:
        if self.omp_threads != len(self.cpus) or list(self.cpus) != sorted(set(self.cpus)):
            raise PlanError(f"replica {self.index}: omp_threads must be the number of CPUs in cpus, each once",
                            path=f"replicas[{self.index}].omp_threads", value=self.omp_threads,
                            allowed=str(len(set(self.cpus))), hint="re-render the plan rather than edit it")

    @property
    def cpuset(self) -> tuple[int, ...]:
        """Every CPU the replica's container may use."""
        return tuple(sorted(set(self.cpus) | set(self.frontend_cpus)))

    def to_dict(self) -> dict:
        return _encode(self)


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
    sized_from: str  # safetensors | gguf | config.json | spec
    quantization: str = "none"  # model.quantization: float weights quantized on load (none | q8_0 | q4_0)
    # The block formats weights are held in (GGUF types kept quantized, or made on load); () = all in `dtype`.
    weight_formats: tuple[str, ...] = ()

    @property
    def is_file(self) -> bool:
        """The model is one .gguf file rather than a directory."""
        return self.sized_from == "gguf"


@dataclass(frozen=True, slots=True)
class ServingPlan:
    port: int  # what clients connect to (the load balancer when there are several replicas)
    publish_address: str
    max_num_seqs: int
    max_num_batched_tokens: int
    api_key_env: str | None
    api_key_secret: tuple[str, str] | None  # (secret name, key)
    load_balancer: bool
    prefix_caching: bool = True  # the engine reuses the KV cache of prompt prefixes it has seen


@dataclass(frozen=True, slots=True)
class ImagePlan:
    name: str
    tag: str
    base: str
    wheelhouse: str | None
    digest: str | None = None  # sha256:... of the pushed image: Kubernetes names it by content

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


@dataclass(frozen=True, slots=True)
class SecurityPlan:
    seccomp: str
    run_as_user: int
    read_only_root: bool
    sys_nice: bool = False  # CAP_SYS_NICE added to the engine containers (opt-in; nothing needs it by default)


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
    allowed_cpus: tuple[int, ...] = field(metadata=_CPULIST)
    quota_cpus: float | None


@dataclass(frozen=True, slots=True)
class BindingPolicy:
    """The spec's CPU policy, for an engine that binds to a cpuset chosen elsewhere (a Kubernetes pod's, by the
    kubelet): deploykit.placement applies it again at start-up to whatever CPUs the process got."""

    reserved_cpus: int | None = None  # physical cores for the front end; None = placement's default rule
    use_smt: bool = False
    threads: int | None = None  # OpenMP threads cap; None = one per core


@dataclass(frozen=True, slots=True)
class Layout:
    """How the machine was cut into replicas (the spec's placement strategy, as planned)."""

    strategy: str = "per-numa-node"  # per-numa-node | per-socket | per-l3 | single | explicit
    replicas_per_node: int = 1
    l3_groups_per_replica: int = 1
    # Replicas smaller than their NUMA node, each inside one L3 group or made of whole ones: Kubernetes nodes then
    # want the CPU manager's prefer-align-cpus-by-uncorecache, and pods request whole L3 groups.
    l3_aligned: bool = False


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
    policy: BindingPolicy = BindingPolicy()
    layout: Layout = Layout()

    def to_dict(self) -> dict:
        return {"apiVersion": API_VERSION, "kind": "Plan", **_encode(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """The inverse of to_dict (unknown keys are ignored); PlanError names the first key that does not fit."""
        if not isinstance(data, dict) or data.get("apiVersion") != API_VERSION or data.get("kind") != "Plan":
            got = {k: data.get(k) for k in ("apiVersion", "kind")} if isinstance(data, dict) else type(data).__name__
            raise PlanError("not a deploykit plan", value=got, allowed=f"apiVersion {API_VERSION}, kind Plan",
                            hint="use the plan.json written by `deploykit render` or `deploykit plan --format json`")
        return _decode(cls, data, "")

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            return cls.from_dict(json.loads(text))
        except ValueError as e:
            raise PlanError(f"not JSON: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def _encode(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kind = f.metadata.get("json")
        out[f.name] = cpulist.format(value) if kind == "cpulist" else _plain(value)
    return out


def _plain(value):
    if dataclasses.is_dataclass(value):
        return _encode(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _decode(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise PlanError("expected an object", path=where or "plan", value=data)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise PlanError("missing from the plan", path=path,
                            hint="re-render with this deploykit version: the plan format has this key")
        kind = f.metadata.get("json")
        try:
            if kind == "cpulist":
                kwargs[f.name] = cpulist.parse(data[f.name])
            else:
                kwargs[f.name] = _typed(hints[f.name], data[f.name], path)
        except (TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"does not fit {hints[f.name]}: {e}", path=path, value=data[f.name]) from None
    return cls(**kwargs)


def _typed(tp, value, path: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _typed(next(a for a in args if a is not type(None)), value, path)
    if dataclasses.is_dataclass(tp):
        return _decode(tp, value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise TypeError("expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        return tuple(_typed(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool, float):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise TypeError(f"expected {tp.__name__}")
        return value
    raise TypeError(f"unsupported type {tp}")
