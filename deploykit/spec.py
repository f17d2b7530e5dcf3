"""The deployment spec (apiVersion deploykit/v1, kind Deployment) as pydantic models: the only schema of user input.

Loading YAML and turning validation failures into user-facing errors lives in specfile.py.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag,
                      field_validator, model_validator)

from . import cpulist
from .isa import OF_INTEREST as ISA_FLAGS
from .quant import ON_LOAD
from .units import parse_size

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PosInt = Annotated[StrictInt, Field(gt=0)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False, hide_input_in_errors=False)


def _size(value: object) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(str(e)) from None


def _cpus(value: object) -> tuple[int, ...]:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError("expected a CPU list string such as '0-31,64-95'")
    ids = cpulist.parse(str(value))
    if not ids:
        raise ValueError("CPU list is empty")
    if ids[-1] > 65535:
        raise ValueError(f"CPU id {ids[-1]} is out of range (max 65535)")
    return ids


def _matches(rx: re.Pattern, what: str, example: str):
    def check(v: str) -> str:
        if not isinstance(v, str) or not rx.match(v):
            raise ValueError(f"not a valid {what}; for example {example}")
        return v
    return check


class Architecture(_Model):
    """Model shape numbers (Hugging Face config.json names) for planning when no config.json is at hand."""

    num_parameters: PosInt | None = None
    num_hidden_layers: PosInt
    num_key_value_heads: PosInt
    head_dim: PosInt | None = None
    hidden_size: PosInt | None = None
    num_attention_heads: PosInt | None = None
    intermediate_size: PosInt | None = None
    vocab_size: PosInt | None = None
    tie_word_embeddings: StrictBool = False
    max_position_embeddings: PosInt | None = None

    @model_validator(mode="after")
    def _enough(self) -> Architecture:
        if self.head_dim is None and not (self.hidden_size and self.num_attention_heads):
            raise ValueError("give head_dim, or hidden_size and num_attention_heads to derive it")
        if self.head_dim is None and self.hidden_size < self.num_attention_heads:  # type: ignore[operator]
            raise ValueError(f"hidden_size {self.hidden_size} / num_attention_heads {self.num_attention_heads} "
                             "gives a head_dim of 0; give head_dim explicitly")
        if self.num_parameters is None and not (self.hidden_size and self.intermediate_size and self.vocab_size):
            raise ValueError("give num_parameters, or hidden_size, intermediate_size and vocab_size to count them")
        return self


class ModelSpec(_Model):
    source: Annotated[str, Field(min_length=1)]
    revision: str | None = None
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    # none: a .gguf's quantized tensors stay in their blocks (run by the int8 kernels), float weights in `dtype`;
    # q8_0 / q4_0: float weights (safetensors, or F32/F16/BF16 tensors of a .gguf) are also quantized on load;
    # dequantize: every weight is held in `dtype` (deploykit/quant.py has the rule).
    quantization: Literal[ON_LOAD] = "none"  # type: ignore[valid-type]
    max_model_len: PosInt | None = None
    architecture: Architecture | None = None


class NumaNodeSpec(_Model):
    id: NonNegInt
    socket: NonNegInt | None = None
    cpus: tuple[int, ...] = ()
    memory: int

    _cpus = field_validator("cpus", mode="before")(lambda v: () if v in ("", None) else _cpus(v))
    _mem = field_validator("memory", mode="before")(_size)


class InlineHardware(_Model):
    """A machine described by hand: NUMA nodes with CPU lists and memory, SMT layout, ISA flags."""

    numa_nodes: Annotated[tuple[NumaNodeSpec, ...], Field(min_length=1)]
    threads_per_core: Literal[1, 2, 4] = 1
    # offset: CPU i and i + (logical CPUs / threads_per_core) share a core (the usual Linux numbering);
    # adjacent: CPUs 2k and 2k+1 share a core.
    sibling_numbering: Literal["offset", "adjacent"] = "offset"
    isa: tuple[Literal[ISA_FLAGS], ...] = ()  # /proc/cpuinfo flag names

    @model_validator(mode="after")
    def _consistent(self) -> InlineHardware:
        ids = [n.id for n in self.numa_nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"numa_nodes ids must be unique, got {ids}")
        seen: dict[int, int] = {}
        for n in self.numa_nodes:
            for c in n.cpus:
                if c in seen:
                    raise ValueError(f"CPU {c} is listed in node {seen[c]} and node {n.id}")
                seen[c] = n.id
        if not seen:
            raise ValueError("no NUMA node has CPUs")
        if self.threads_per_core > 1 and len(seen) % self.threads_per_core:
            raise ValueError(f"{len(seen)} CPUs cannot form cores of {self.threads_per_core} threads")
        return self


class SysrootHardware(_Model):
    sysroot: Annotated[str, Field(min_length=1)]


def _meant(keys: object, tag: str, other_fields: object) -> bool:
    """A mapping meant as the `tag` form: it has the key, or a misspelling of it and no key of the other form
    (so `{sysroott: DIR}` is told "did you mean `sysroot`", not "add numa_nodes")."""
    names = [k for k in keys if isinstance(k, str)]  # type: ignore[union-attr]
    if tag in names:
        return True
    return not any(k in other_fields for k in names) and bool(difflib.get_close_matches(tag, names, n=1, cutoff=0.75))


def _hardware_form(v: object) -> str | None:
    if isinstance(v, (SysrootHardware, InlineHardware)):
        return "sysroot" if isinstance(v, SysrootHardware) else "inline"
    if isinstance(v, dict):
        return "sysroot" if _meant(v, "sysroot", InlineHardware.model_fields) else "inline"
    return "auto" if v == "auto" else None


# Tagged by shape so an error talks about the one form the user meant, not all three.
Hardware = Annotated[
    Union[Annotated[Literal["auto"], Tag("auto")], Annotated[SysrootHardware, Tag("sysroot")],
          Annotated[InlineHardware, Tag("inline")]],
    Discriminator(_hardware_form, custom_error_type="hardware_form",
                  custom_error_message="hardware is 'auto' (this host), {sysroot: DIR} (a snapshot) or an "
                                       "inline description with numa_nodes"),
]


STRATEGIES = ("per-numa-node", "per-socket", "per-l3", "single", "explicit")


class PlacementSpec(_Model):
    strategy: Literal[STRATEGIES] = "per-numa-node"
    numa_nodes: tuple[NonNegInt, ...] | None = None
    replicas_per_node: PosInt = 1  # per-numa-node: split each node's physical cores into this many replicas
    l3_groups_per_replica: PosInt = 1  # per-l3: adjacent L3 groups of one NUMA node per replica
    cpus: tuple[tuple[int, ...], ...] | None = None  # explicit: one CPU list per replica
    memory_nodes: tuple[NonNegInt, ...] = ()  # extra memory-only (e.g. CXL) nodes added to every replica's mems
    reserved_cpus: NonNegInt = 1
    use_smt: StrictBool = False
    threads: Literal["auto"] | PosInt = "auto"

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, v: object) -> object:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError("threads is 'auto' (one per physical core) or a positive integer")

    @field_validator("cpus", mode="before")
    @classmethod
    def _parse_cpus(cls, v: object) -> object:
        if v is None:
            return None
        if isinstance(v, (str, int)):
            raise ValueError("expected a list with one CPU list per replica, e.g. ['0-31', '32-63']")
        return tuple(_cpus(x) for x in v) if isinstance(v, (list, tuple)) else v

    @model_validator(mode="after")
    def _explicit(self) -> PlacementSpec:
        if self.strategy == "explicit" and not self.cpus:
            raise ValueError("strategy 'explicit' needs cpus: one CPU list per replica, e.g. ['0-31', '32-63']")
        if self.cpus and self.strategy != "explicit":
            raise ValueError("cpus is only used with strategy: explicit; set it or remove cpus")
        if self.replicas_per_node != 1 and self.strategy != "per-numa-node":
            raise ValueError(f"replicas_per_node is only used with strategy: per-numa-node (got {self.strategy}); "
                             "for one replica per L3 group use strategy: per-l3")
        if self.l3_groups_per_replica != 1 and self.strategy != "per-l3":
            raise ValueError(f"l3_groups_per_replica is only used with strategy: per-l3 (got {self.strategy})")
        if self.cpus and self.numa_nodes is not None:
            raise ValueError("numa_nodes does not apply to strategy: explicit (the CPU lists decide the nodes)")
        if self.cpus:
            seen: set[int] = set()
            for i, group in enumerate(self.cpus):
                if seen & set(group):
                    raise ValueError(f"replica {i} shares CPUs {cpulist.format(seen & set(group))} with another")
                seen |= set(group)
        return self


class ApiKeyFromEnv(_Model):
    env: str

    _env = field_validator("env")(_matches(ENV_NAME, "environment variable name", "DEPLOYKIT_API_KEY"))


class ApiKeyFromSecret(_Model):
    secret: Annotated[str, Field(pattern=DNS_LABEL.pattern)]
    key: Annotated[str, Field(min_length=1)] = "api-key"


class ServingSpec(_Model):
    port: Annotated[StrictInt, Field(ge=1, le=65535)] = 8000
    publish_address: str = "0.0.0.0"  # IPv4, or IPv6 in brackets as Docker writes it: [::]
    max_num_seqs: PosInt = 16
    max_num_batched_tokens: PosInt = 2048
    kv_cache: Literal["auto"] | int = "auto"
    prefix_caching: StrictBool = True  # reuse the KV cache of prompt prefixes seen before (shared system prompts)
    api_key: Annotated[
        Union[Annotated[ApiKeyFromEnv, Tag("env")], Annotated[ApiKeyFromSecret, Tag("secret")]],
        Discriminator(lambda v: "secret" if (isinstance(v, dict) and "env" not in v
                                             and _meant(v, "secret", ApiKeyFromEnv.model_fields))
                      or isinstance(v, ApiKeyFromSecret) else "env"),
    ] | None = None
    served_model_name: str | None = None

    @field_validator("publish_address")
    @classmethod
    def _address(cls, v: str) -> str:
        try:
            ip = ipaddress.ip_address(v[1:-1] if v.startswith("[") and v.endswith("]") else v)
        except ValueError:
            raise ValueError("not an IP address; use e.g. 0.0.0.0 (all interfaces), 127.0.0.1, or [::]") from None
        if ip.version == 6 and not v.startswith("["):
            raise ValueError(f"write IPv6 addresses in brackets, as Docker does: [{v}]")
        return v

    @field_validator("kv_cache", mode="before")
    @classmethod
    def _kv(cls, v: object) -> object:
        return v if v == "auto" else _size(v)

    @field_validator("api_key", mode="before")
    @classmethod
    def _no_inline_key(cls, v: object) -> object:
        if isinstance(v, str):
            raise ValueError("API keys are never written into the spec; use {env: VAR_NAME} or "
                             "{secret: secret-name, key: api-key}")
        return v


_IMAGE_NAME = re.compile(r"^[a-z0-9]+([._/-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
_IMAGE_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_IMAGE_REF = re.compile(r"^[a-z0-9]+([._/:-][a-z0-9]+)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class ImageSpec(_Model):
    name: str = "deploykit-engine"
    tag: str = "0.1.0"
    base: str = "python:3.11-slim-bookworm"  # NAME:TAG@sha256:DIGEST pins the Dockerfile's FROM lines by content
    wheelhouse: str | None = None  # a local directory of wheels: the image builds with pip --no-index
    digest: str | None = None  # the pushed image's sha256:...: Kubernetes objects then name it by content

    _name = field_validator("name")(_matches(_IMAGE_NAME, "image name", "registry.example.com/llm/engine"))
    _tag = field_validator("tag")(_matches(_IMAGE_TAG, "image tag", "0.1.0 or 2026-11-22"))
    _base = field_validator("base")(_matches(_IMAGE_REF, "base image reference", "python:3.11-slim-bookworm"))

    @field_validator("digest")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not _DIGEST.match(v):
            raise ValueError("not an image digest; sha256: and 64 hex digits, as the registry (or `docker inspect "
                             "--format '{{.RepoDigests}}'`) shows it for the pushed image")
        return v


class SecuritySpec(_Model):
    seccomp: Literal["least-privilege", "runtime-default", "unconfined"] = "least-privilege"
    run_as_user: Annotated[StrictInt, Field(ge=10000, le=2**31 - 1)] = 10001
    read_only_root: StrictBool = True
    # Adds CAP_SYS_NICE to the engine containers. Not needed for NUMA binding (the least-privilege seccomp profile
    # allows it with no capability); it fails the Pod Security Standard baseline. Only for runtime-default seccomp
    # profiles, which gate set_mempolicy/mbind on it.
    sys_nice: StrictBool = False


Target = Literal["docker", "compose", "helm", "manifests"]


class Spec(_Model):
    apiVersion: Literal["deploykit/v1"]
    kind: Literal["Deployment"]
    name: str
    model: ModelSpec
    hardware: Hardware = "auto"
    placement: PlacementSpec = PlacementSpec()
    serving: ServingSpec = ServingSpec()
    image: ImageSpec = ImageSpec()
    security: SecuritySpec = SecuritySpec()
    targets: tuple[Target, ...] = ("docker", "compose")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not DNS_LABEL.match(v):
            raise ValueError("name must be a DNS label: lowercase letters, digits and '-', 1-40 characters, "
                             "starting and ending with a letter or digit")
        return v

