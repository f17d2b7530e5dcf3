"""What a request may ask for, checked in one place: SamplingParams with its value ranges (RANGES, which the HTTP
request models reuse as pydantic bounds), and the prompt checks both the front end and the core run.

Plain data, importable without torch: the HTTP front end validates requests with it in a process that never
loads torch. Every failure is a RequestError carrying the parameter's name as data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import RequestError

MAX_LOGPROBS = 20
MAX_STOP = 32  # OpenAI allows 4; vLLM clients send more. Each is matched against every new token's text.
MAX_LOGIT_BIAS = 1024  # entries; OpenAI documents no limit, and each costs a scatter per step
LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
# Temperatures below this are treated as greedy (as vLLM does): dividing logits by ~0 overflows.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class Range:
    """Bounds of one numeric parameter; `bounds` is what pydantic's Field takes."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    integer: bool = False
    optional: bool = False  # None is allowed too

    @property
    def bounds(self) -> dict:
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None}

    def holds(self, v: object) -> bool:
        if v is None:
            return self.optional
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (self.integer and not isinstance(v, int)):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le))

    def describe(self) -> str:
        low = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else "(-inf"
        high = f"{self.le:g}]" if self.le is not None else "inf)"
        what = f"an integer in {low}, {high}" if self.integer else f"a number in {low}, {high}"
        return what + (" or null" if self.optional else "")


RANGES: dict[str, Range] = {
    "max_tokens": Range(ge=1, integer=True, optional=True),  # None = up to the end of the context window
    "temperature": Range(ge=0),
    "top_p": Range(gt=0, le=1),
    "top_k": Range(ge=-1, integer=True),  # 0 or -1 = off
    "min_p": Range(ge=0, le=1),
    "repetition_penalty": Range(gt=0),
    "presence_penalty": Range(ge=-2, le=2),
    "frequency_penalty": Range(ge=-2, le=2),
    "min_tokens": Range(ge=0, integer=True),
    "logprobs": Range(ge=0, le=MAX_LOGPROBS, integer=True, optional=True),
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None = up to the end of the context window
    temperature: float = 1.0  # below 1e-5 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # prompt + output tokens (HF/vLLM)
    presence_penalty: float = 0.0  # output tokens only (OpenAI/vLLM)
    frequency_penalty: float = 0.0  # output tokens only (OpenAI/vLLM)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # EOS is masked out for the whole generation
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives; 0 = only the chosen token
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), in [-100, 100]
    grammar: str | None = None  # an llguidance grammar (engine.grammar builds it) the output must follow

    def __post_init__(self) -> None:
        # Accept a bare string or a list at the edge; store tuples so params stay hashable.
        if isinstance(self.stop, (str, list)):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        for name, r in RANGES.items():
            if not r.holds(getattr(self, name)):
                raise RequestError(f"{name} must be {r.describe()}, got {getattr(self, name)!r}", param=name)
        others = (
            ("seed", self.seed is None or _is_int(self.seed), "an integer or null"),
            ("stop", isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOP
             and all(isinstance(s, str) and s for s in self.stop), f"at most {MAX_STOP} non-empty strings"),
            ("stop_token_ids", isinstance(self.stop_token_ids, tuple)
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "a list of integers >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "a bool"),
            ("logit_bias", isinstance(self.logit_bias, tuple) and len(self.logit_bias) <= MAX_LOGIT_BIAS
             and all(isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and e[0] >= 0
                     and Range(ge=-LOGIT_BIAS, le=LOGIT_BIAS).holds(e[1]) for e in self.logit_bias),
             f"at most {MAX_LOGIT_BIAS} token ids (>= 0) mapped to numbers in [-{LOGIT_BIAS:g}, {LOGIT_BIAS:g}]"),
            ("grammar", self.grammar is None or isinstance(self.grammar, str), "a grammar string or null"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens, "<= max_tokens"),
        )
        for name, ok, allowed in others:
            if not ok:
                raise RequestError(f"{name} must be {allowed}, got {getattr(self, name)!r}", param=name)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def is_truncated(self) -> bool:
        """Whether top-k or top-p restricts sampling to a (usually small) set of best tokens."""
        return self.top_k > 0 or self.top_p < 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities under the model's raw distribution: log_softmax of the logits before penalties,
    masks, temperature and filtering (vLLM's default), so they do not depend on the sampling settings."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


def check_prompt(ids: list[int], max_tokens: int | None, *, vocab_size: int, max_model_len: int,
                 param: str = "prompt") -> int:
    """The prompt fits the model: non-empty, every id in the vocabulary, prompt + completion within the context.
    Returns the completion budget (max_tokens, or what the context leaves when it is None)."""
    if not ids:
        raise RequestError("the prompt is empty; it must contain at least one token", param=param)
    bad = next((t for t in ids if not _is_int(t) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)
    n = len(ids)
    if max_tokens is None:
        if n >= max_model_len:
            raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                               f"has {n} tokens, leaving no room for the completion. Please reduce the prompt.",
                               param=param, code="context_length_exceeded")
        return max_model_len - n
    if n + max_tokens > max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                           f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
                           "Please reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
    return max_tokens


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request names (stop_token_ids, logit_bias) index the logits: each must be in the vocabulary."""
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise RequestError(f"{name} {bad[:8]} {'are' if len(bad) > 1 else 'is'} outside the vocabulary "
                               f"[0, {vocab_size})", param=name)
