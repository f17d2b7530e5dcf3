"""Per-request sampling parameters and logprob records: plain data, importable without torch (the HTTP front
end validates requests with them in a process that never loads torch)."""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy (as vLLM does): dividing logits by ~0 overflows.
GREEDY_TEMPERATURE = 1e-5


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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

    def __post_init__(self) -> None:
        # Accept a bare string or a list at the edge; store tuples so params stay hashable.
        if isinstance(self.stop, (str, list)):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        mt, n, lp, real = self.max_tokens, self.min_tokens, self.logprobs, _is_real
        checks = (
            ("max_tokens", mt is None or (_is_int(mt) and mt >= 1), "an integer >= 1 or None"),
            ("temperature", real(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_p", real(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= -1, "-1 or 0 (disabled) or an integer >= 1"),
            ("min_p", real(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", real(self.repetition_penalty) and self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", real(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("seed", self.seed is None or _is_int(self.seed), "an integer or None"),
            ("stop", isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
             "a list of non-empty strings"),
            ("stop_token_ids", isinstance(self.stop_token_ids, tuple)
             and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "a list of integers >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "a bool"),
            ("min_tokens", _is_int(n) and n >= 0 and (mt is None or n <= mt), "an integer >= 0 and <= max_tokens"),
            ("logprobs", lp is None or (_is_int(lp) and 0 <= lp <= MAX_LOGPROBS),
             f"an integer in [0, {MAX_LOGPROBS}] or None"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def is_truncated(self) -> bool:
        """Whether top-k or top-p restricts sampling to a (usually small) set of best tokens."""
        return self.top_k > 0 or self.top_p < 1


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities under the model's raw distribution: log_softmax of the logits before penalties,
    masks, temperature and filtering (vLLM's default), so they do not depend on the sampling settings."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first
