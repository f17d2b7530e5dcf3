"""Every message between the HTTP front end and the engine-core process, as frozen dataclasses (torch-free).

They cross a private socketpair pickled, so the receiver gets the class itself: a field added or reordered can
never be misread the way a positional tuple would be. The core's own outputs (TokenOutput, EngineStats) are
defined here too, because they are what crosses.

  front end -> core   Init once, then Ops: a batch of AddRequest | AbortRequest | Call | Shutdown
  core -> front end   Ready | Fatal once, then StepResult at most once per engine step
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from engine.params import SamplingParams, TokenLogprobs


@dataclass(frozen=True, slots=True)
class TokenOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None  # one entry per new token when the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks referenced by requests (active), 0..1
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    kv_blocks_total: int = 0
    kv_blocks_active: int = 0  # referenced by running requests
    kv_blocks_cached: int = 0  # unreferenced, holding a prefix a later request may reuse (evicted when needed)
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens whose prefill was skipped


# ---- front end -> core ----

@dataclass(frozen=True, slots=True)
class Init:
    config: Any  # engine.config.EngineConfig
    binding: Any  # engine.binding.Binding


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class Call:
    """A question for the core process answered in a Reply (e.g. "binding": its binding report)."""
    call_id: int
    name: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Op = Union[AddRequest, AbortRequest, Call, Shutdown]


@dataclass(frozen=True, slots=True)
class Ops:
    """Everything the front end queued during one event-loop iteration."""
    ops: tuple[Op, ...]


# ---- core -> front end ----

@dataclass(frozen=True, slots=True)
class Ready:
    pid: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Fatal:
    message: str


@dataclass(frozen=True, slots=True)
class Rejected:
    """A request the core refused (status 400, with the parameter) or that failed in a step (status 500)."""
    request_id: str
    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    call_id: int
    result: Any


@dataclass(frozen=True, slots=True)
class StepResult:
    outputs: tuple[TokenOutput, ...] = ()
    rejected: tuple[Rejected, ...] = ()
    stats: EngineStats = field(default_factory=EngineStats)
    replies: tuple[Reply, ...] = ()
