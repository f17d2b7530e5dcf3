"""Sampling parameters, per-request sampling state, and the batched token sampler."""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from engine import kernels
from engine.errors import RequestError
from engine.params import GREEDY_TEMPERATURE, MAX_LOGPROBS, SamplingParams, TokenLogprobs, check_token_ids

if TYPE_CHECKING:
    from engine.grammar import Grammars

__all__ = ["GREEDY_TEMPERATURE", "MAX_LOGPROBS", "SamplerOutput", "Sampler", "SamplingParams", "SamplingState",
           "TokenLogprobs", "apply_bans", "apply_grammars", "apply_logit_bias", "apply_penalties"]

# Two-level argmax/top-k: one vectorised amax over [R, V/BLOCK, BLOCK] picks candidate blocks, so the slow
# index-tracking kernels (argmax, topk) only run on a few thousand elements. Large k uses narrower blocks.
BLOCK, NARROW_BLOCK = 128, 32
# A top-p row without top-k looks for its nucleus among the 256 best tokens, then 32x more, and sorts the
# whole vocabulary only if even those hold less than top_p of the probability mass.
TOP_P_CANDIDATES, TOP_P_GROWTH = 256, 32
FINITE = 3.0e38  # just below float32's max


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class SamplingState:
    """Per-request mutable sampling state; the engine calls `append` for every accepted token."""

    __slots__ = ("params", "vocab_size", "eos_token_ids", "num_output_tokens", "generator", "has_penalties",
                 "matcher", "_bias", "_min_tokens_ban", "_always_ban", "_slot", "_ids", "_counts")

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], eos_token_ids: Sequence[int],
                 vocab_size: int, grammars: Grammars | None = None):
        check_token_ids(params, vocab_size)  # they index the logits
        self.params = params
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.num_output_tokens = 0
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed % 2**64)
        self._min_tokens_ban = tuple(dict.fromkeys(self.eos_token_ids + params.stop_token_ids))
        self._always_ban = self.eos_token_ids if params.ignore_eos else ()
        self.has_penalties = (params.repetition_penalty != 1 or params.presence_penalty != 0
                              or params.frequency_penalty != 0)
        self._bias = None if not params.logit_bias else (  # (token ids [N] int64, biases [N] float32)
            torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64),
            torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32))
        if params.grammar is not None and grammars is None:
            raise RequestError("this engine was built without grammar support", param="response_format")
        self.matcher = grammars.matcher(params.grammar) if params.grammar is not None else None
        # Sparse penalty bookkeeping, one slot per distinct token seen: a step costs O(distinct tokens),
        # not O(V). _counts counts output occurrences only (prompt tokens sit at 0 for the repetition penalty).
        self._slot: dict[int, int] = {}
        self._ids = array("q")
        self._counts = array("f")
        if params.repetition_penalty != 1:
            for tid in dict.fromkeys(prompt_token_ids):
                self._slot[tid] = len(self._ids)
                self._ids.append(tid)
                self._counts.append(0.0)

    def append(self, token_id: int) -> None:
        self.num_output_tokens += 1
        if self.matcher is not None:
            self.matcher.accept(token_id)  # a refused token leaves the matcher failed: `complete` ends the request
        if not self.has_penalties:
            return
        slot = self._slot.get(token_id)
        if slot is None:
            self._slot[token_id] = len(self._ids)
            self._ids.append(token_id)
            self._counts.append(1.0)
        else:
            self._counts[slot] += 1.0

    @property
    def complete(self) -> bool:
        """The grammar admits nothing more: the output is a whole document (or, never expected, broke it)."""
        return self.matcher is not None and self.matcher.done

    @property
    def edits_beyond_bans(self) -> bool:
        """Whether anything but bans (EOS under ignore_eos or min_tokens), temperature and truncation does."""
        return self.has_penalties or self._bias is not None or self.matcher is not None

    @property
    def plain_greedy(self) -> bool:
        """Greedy, without logprobs, nothing but bans editing the logits: the token is the raw logits' argmax unless
        a ban hits it (the sampler's fast path; a run of decode steps feeds that argmax on)."""
        return self.params.is_greedy and self.params.logprobs is None and not self.edits_beyond_bans

    @property
    def ending_ids(self) -> tuple[int, ...]:
        """Every token id that can end this request or be banned at some step: EOS and the stop tokens."""
        return self._min_tokens_ban

    def banned_token_ids(self) -> tuple[int, ...]:
        """Token ids whose logits are forced to -inf at this step."""
        return self._min_tokens_ban if self.num_output_tokens < self.params.min_tokens else self._always_ban

    def penalty_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [N] int64, output counts [N] float32) for every token seen so far."""
        if not self._ids:
            return torch.empty(0, dtype=torch.int64), torch.empty(0)
        # clone: the arrays must stay resizable after this call
        return (torch.frombuffer(self._ids, dtype=torch.int64).clone(),
                torch.frombuffer(self._counts, dtype=torch.float32).clone())


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """In place on [B, V]: repetition penalty (l/r if l > 0 else l*r) over prompt + output tokens, then
    l -= frequency * count + presence * (count > 0) over output tokens. Touches only seen tokens."""
    rows = [i for i, s in enumerate(states) if s.has_penalties]
    slots = [states[i].penalty_slots() for i in rows]
    lengths = torch.tensor([len(ids) for ids, _ in slots], dtype=torch.int64)
    if not rows or int(lengths.sum()) == 0:
        return
    ids = torch.cat([ids for ids, _ in slots])  # [N] over all penalised rows
    counts = torch.cat([c for _, c in slots])  # [N]

    def per_entry(values: list) -> torch.Tensor:
        return torch.tensor(values).repeat_interleave(lengths)  # [N]

    r = per_entry(rows)
    # float32 holds neither 1e306 nor 1e-40 (valid as float64 params): 0 * inf would be NaN
    rep = per_entry([min(max(states[i].params.repetition_penalty, 1e-30), 1e30) for i in rows])
    v = logits[r, ids]
    v = torch.where(v > 0, v / rep, v * rep)
    v -= per_entry([states[i].params.frequency_penalty for i in rows]) * counts
    v -= per_entry([states[i].params.presence_penalty for i in rows]) * (counts > 0)
    # a tiny repetition_penalty divides a positive logit into +inf, and inf - inf later is NaN: stay finite
    logits[r, ids] = v.clamp_(-FINITE, FINITE)


def apply_bans(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """In place on [B, V]: -inf for EOS and stop tokens before min_tokens, and for EOS under ignore_eos."""
    bans = [(i, ids) for i, s in enumerate(states) if (ids := s.banned_token_ids())]
    if bans:
        r = torch.tensor([i for i, ids in bans for _ in ids], dtype=torch.int64)
        c = torch.tensor([t for _, ids in bans for t in ids], dtype=torch.int64)
        logits[r, c] = -math.inf


def apply_logit_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """In place on [B, V]: each request's logit_bias added to its tokens' logits (OpenAI's semantics)."""
    for i, s in enumerate(states):
        if s._bias is not None:
            ids, bias = s._bias
            logits[i].index_add_(0, ids, bias)


_ALLOWED_TO_ADD = torch.tensor([-math.inf, 0.0])  # a token's bit (0: not allowed, 1: allowed) -> added to its logit


def apply_grammars(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """In place on [B, V]: -inf for every token the row's grammar does not allow next. The matcher's bitmask
    (one bit per token, little-endian) is unpacked by numpy into a [R, V] 0/1 array, looked up as 0/-inf and
    added into the rows: a gather and an add, branch-free (masked_fill_ with the scattered mask of a JSON string
    state costs several times more on CPU; benchmarks/grammar.py). A row the grammar would leave empty
    (everything it allows was banned) keeps its end tokens so the request can end."""
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return
    v = logits.shape[1]
    masks = np.stack([np.frombuffer(states[i].matcher.bitmask(), dtype=np.uint8) for i in rows])  # [R, W*4]
    allowed = torch.from_numpy(np.unpackbits(masks, axis=1, count=v, bitorder="little"))  # [R, V] uint8
    add = _ALLOWED_TO_ADD.index_select(0, allowed.view(-1).int()).view(len(rows), v)  # [R, V] 0 / -inf
    logits.index_add_(0, torch.tensor(rows), add)
    empty = logits.amax(-1) == -math.inf  # [B]
    for r in rows:
        if empty[r]:
            logits[r, list(states[r].eos_token_ids)] = 0.0


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [R, V] (first index on ties): the native one-pass kernel where it is loaded, else two
    levels of PyTorch ops, several times faster than Tensor.argmax on CPU."""
    native = kernels.argmax(x)
    if native is not None:
        return native
    return _argmax_torch(x)


def _argmax_torch(x: torch.Tensor) -> torch.Tensor:
    rows, v = x.shape
    nb = v // BLOCK
    if nb < 8:
        return x.argmax(-1)
    bmax = x[:, : nb * BLOCK].reshape(rows, nb, BLOCK).amax(-1)  # [R, nb]
    if nb * BLOCK < v:
        bmax = torch.cat([bmax, x[:, nb * BLOCK:].amax(-1, keepdim=True)], 1)
    best = bmax.argmax(-1, keepdim=True)  # [R, 1]
    # The tail block may be short: clamping repeats column V-1, which never precedes the true first max.
    cols = (best * BLOCK + torch.arange(BLOCK)).clamp_max_(v - 1)  # [R, BLOCK]
    return cols.gather(1, x.gather(1, cols).argmax(-1, keepdim=True)).squeeze(1)


def _greedy_with_bans(x: torch.Tensor, states: Sequence[SamplingState], argmax: torch.Tensor | None) -> list[int]:
    """Greedy tokens of [R, V] where bans are the only edit (ignore_eos, min_tokens): the argmax of the raw logits
    (argmax where the step computed it) stands unless it is banned, since banning only lowers logits and the first
    maximum stays first. Only rows whose argmax is banned pay for the mask (benchmarks run ignore_eos: ~30 us a step
    saved on a 1k vocab)."""
    tokens = (_argmax(x) if argmax is None else argmax).tolist()
    redo = [i for i, s in enumerate(states) if tokens[i] in s.banned_token_ids()]
    if redo:
        sub = x[redo]
        apply_bans(sub, [states[i] for i in redo])
        for i, t in zip(redo, _argmax(sub).tolist()):
            tokens[i] = t
    return tokens


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted top-k of [R, V]. Every top-k element lies in one of the k blocks with the largest maxima, so
    torch.topk only runs on those blocks (plus the ragged tail)."""
    rows, v = x.shape
    block = BLOCK if k <= 64 else NARROW_BLOCK
    nb = v // block
    if k * 4 > nb:
        return x.topk(min(k, v), -1)
    bmax = x[:, : nb * block].reshape(rows, nb, block).amax(-1)  # [R, nb]
    blocks = bmax.topk(k, -1, sorted=False).indices  # [R, k]
    cols = (blocks.unsqueeze(-1) * block + torch.arange(block)).reshape(rows, k * block)
    if nb * block < v:
        cols = torch.cat([cols, torch.arange(nb * block, v).expand(rows, -1)], 1)
    vals, pos = x.gather(1, cols).topk(k, -1)
    return vals, cols.gather(1, pos)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Inverse-CDF draw from unnormalised non-negative weights [R, N] (overwritten) -> indices [R]. Uses one
    uniform per row whatever N is, and no O(N) random numbers (generating those costs more than the rest)."""
    cdf = weights.cumsum_(-1)
    total = cdf[:, -1:]
    u = torch.rand(cdf.shape[0], 1, generator=generator) * total
    # u == total after rounding would select past the last token with non-zero weight.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    # A row that still went NaN must not index past the candidates (that would crash the next step).
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max_(cdf.shape[1] - 1)


def _column(params: Sequence[SamplingParams], value: Callable[[SamplingParams], float]) -> torch.Tensor:
    return torch.tensor([value(p) for p in params]).unsqueeze(1)  # [R, 1]


def _log_min_p(params: Sequence[SamplingParams]) -> torch.Tensor:
    return _column(params, lambda p: math.log(p.min_p) if p.min_p > 0 else -math.inf)  # [R, 1]


def _truncate(vals: torch.Tensor, params: Sequence[SamplingParams], lse_full: torch.Tensor | None,
              complete: bool) -> torch.Tensor | None:
    """Apply top-k, top-p, min-p in place to scaled logits sorted descending [R, K]. Unless the K candidates
    are the whole vocabulary, returns a [R] mask of rows whose nucleus extends past them (to be redone)."""
    width = vals.shape[1]
    if any(p.top_k > 0 for p in params):
        # min(): a top_k past the vocabulary (even 2**63, which no int64 holds) keeps every candidate
        keep = _column(params, lambda p: min(p.top_k, width) if p.top_k > 0 else width)  # [R, 1]
        vals.masked_fill_(torch.arange(width) >= keep, -math.inf)
    short = None
    if any(p.top_p < 1 for p in params):
        has_k = torch.tensor([p.top_k > 0 for p in params])
        # Top-k rows renormalise over their k survivors (HF order); the others need the full softmax.
        lse = torch.logsumexp(vals, -1)  # [R]
        if lse_full is not None:
            lse = torch.where(has_k, lse, lse_full)
        probs = (vals - lse.unsqueeze(1)).exp_()  # [R, K]
        cum = probs.cumsum(-1)
        top_p = _column(params, lambda p: p.top_p if p.top_p < 1 else math.inf)
        # keep a token while the mass of strictly better tokens is below top_p; the best token always stays
        # (a top_p below float32's range becomes 0 and would otherwise mask the whole row)
        drop = (cum - probs) >= top_p
        drop[:, 0] = False
        vals.masked_fill_(drop, -math.inf)
        if not complete:
            short = ~has_k & (cum[:, -1] < top_p.squeeze(1))
    if any(p.min_p > 0 for p in params):
        vals.masked_fill_(vals < vals[:, :1] + _log_min_p(params), -math.inf)
    return short


def _sample_truncated(x: torch.Tensor, params: Sequence[SamplingParams], generator: torch.Generator | None,
                      lse_full: torch.Tensor | None, width: int) -> list[int]:
    """Sample among the `width` best tokens of each row of scaled logits [R, V]; rows whose top-p nucleus
    turns out wider are redone with TOP_P_GROWTH times more candidates."""
    v = x.shape[1]
    vals, idx = x.sort(-1, descending=True) if width >= v else _topk(x, width)  # [R, K]
    short = _truncate(vals, params, lse_full, complete=width >= v)
    tokens = idx.gather(1, _draw((vals - vals[:, :1]).exp_(), generator).unsqueeze(1)).squeeze(1).tolist()
    if short is not None and bool(short.any()):
        redo = short.nonzero().squeeze(1).tolist()
        wider = _sample_truncated(x[redo], [params[i] for i in redo], generator, lse_full[redo],
                                  min(width * TOP_P_GROWTH, v))
        for i, t in zip(redo, wider):
            tokens[i] = t
    return tokens


def _sample_rows(x: torch.Tensor, params: Sequence[SamplingParams], generator: torch.Generator | None) -> list[int]:
    """One token per row of logits [R, V] (overwritten). Rows must be all truncated (top-k/top-p) or none."""
    if any(p.temperature != 1 for p in params):
        # a temperature beyond float32's range would become inf, and -inf / inf is NaN
        x.div_(_column(params, lambda p: min(p.temperature, FINITE))).clamp_(-FINITE, FINITE)
    if not params[0].is_truncated:
        m = x.amax(-1, keepdim=True)  # [R, 1]
        if any(p.min_p > 0 for p in params):
            x.masked_fill_(x < m + _log_min_p(params), -math.inf)
        return _draw(x.sub_(m).exp_(), generator).tolist()
    width = min(max(p.top_k if p.top_k > 0 else TOP_P_CANDIDATES for p in params), x.shape[1])
    lse_full = torch.logsumexp(x, -1) if any(p.top_k <= 0 for p in params) else None  # [R]
    return _sample_truncated(x, params, generator, lse_full, width)


def _logprobs(raw: torch.Tensor, chosen: list[int], ns: list[int]) -> list[TokenLogprobs]:
    lse = torch.logsumexp(raw, -1, keepdim=True)  # [L, 1]
    chosen_lp = (raw.gather(1, torch.tensor(chosen).unsqueeze(1)) - lse).squeeze(1).tolist()
    n = min(max(ns), raw.shape[1])
    top_v, top_i = _topk(raw, n) if n else (raw[:, :0], raw[:, :0].long())
    top_v, top_i = (top_v - lse).tolist(), top_i.tolist()
    return [TokenLogprobs(t, lp, tuple(zip(top_i[j][:k], top_v[j][:k])))
            for j, (t, lp, k) in enumerate(zip(chosen, chosen_lp, ns))]


class Sampler:
    """Turns last-position logits into next tokens. Processing order follows HF/vLLM: penalties -> logit_bias ->
    min_tokens/ignore_eos masks -> grammar mask -> temperature -> top-k -> top-p -> min-p -> draw. The grammar
    mask comes before temperature and truncation, so those act on the allowed tokens only.
    The logits tensor is overwritten; callers must not reuse it."""

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState],
                 argmax: torch.Tensor | None = None) -> SamplerOutput:
        """argmax: each row's argmax of logits (int64 [B]) where the fused decode step computed it with them."""
        rows = logits.shape[0]
        if rows != len(states):
            raise ValueError(f"got {rows} logit rows for {len(states)} sampling states")
        x = logits.float()  # [B, V], no copy when already float32
        if all(s.plain_greedy for s in states):
            return SamplerOutput(_greedy_with_bans(x, states, argmax), [None] * rows)
        params = [s.params for s in states]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]

        raw = x[want_lp] if want_lp else None  # [L, V] copy kept for logprobs
        apply_penalties(x, states)
        apply_logit_bias(x, states)
        apply_bans(x, states)
        apply_grammars(x, states)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        # Seeded rows are sampled one by one with their own generator, so their stream never depends on
        # what else is in the batch; unseeded rows in one batch with and one without top-k/top-p.
        groups = [([i], s.generator) for i, s in enumerate(states)
                  if s.generator is not None and not params[i].is_greedy]
        for truncated in (False, True):
            groups.append(([i for i, p in enumerate(params) if states[i].generator is None and not p.is_greedy
                            and p.is_truncated == truncated], None))
        tokens = [0] * rows
        if greedy:
            for i, t in zip(greedy, _argmax(x if len(greedy) == rows else x[greedy]).tolist()):
                tokens[i] = t
        for g, gen in groups:
            if g:
                sub = x if len(g) == rows else (x[g[0]: g[0] + 1] if len(g) == 1 else x[g])
                for i, t in zip(g, _sample_rows(sub, [params[i] for i in g], gen)):
                    tokens[i] = t

        logprobs: list[TokenLogprobs | None] = [None] * rows
        if raw is not None:
            chosen = _logprobs(raw, [tokens[i] for i in want_lp], [params[i].logprobs for i in want_lp])
            for i, lp in zip(want_lp, chosen):
                logprobs[i] = lp
        return SamplerOutput(tokens, logprobs)
