"""Building blocks shared by the native decoder models: RMSNorm, rotary embedding, paged attention, embedding rows."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from deploykit import memory
from engine.errors import ModelLoadError

from engine import kernels


def embed_rows(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Embedding lookup [N] -> [N, H] in `dtype` from a plain [V, H] matrix, a kernel-packed one [V/16, H/2, 16, 2] or
    a compact one (tied embeddings keep only the lm_head's copy), or a quantized one (rows dequantized to `dtype`)."""
    if kernels.is_quantized(weight):
        return kernels.quant_rows(weight, ids, dtype)
    if kernels.is_compact(weight):
        return kernels.compact_rows(weight, ids)
    if weight.dim() == 2:
        rows = F.embedding(ids, weight)
    else:
        b = kernels.PACK_COLS
        rows = weight[ids // b, :, ids % b, :].flatten(1)
    return rows if rows.dtype == dtype else rows.to(dtype)  # a bf16 table under fp32 compute (prepare_bf16w)


def rms_norm(x: torch.Tensor, weight2: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight]. F.rms_norm is a chain of ~8 small kernels on CPU; layer_norm is
    one fused kernel, and on [x, -x] (mean 0, variance mean(x^2)) it computes the RMS norm (fp32 inside).
    weight2 is the weight repeated twice, [2H]."""
    h = x.shape[-1]
    return F.layer_norm(torch.cat((x, x.neg()), -1), (2 * h,), weight2, None, eps)[..., :h]


class RMSNorm:
    __slots__ = ("weight", "weight2", "eps")

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight.contiguous()               # [H]
        self.weight2 = torch.cat([weight, weight])      # [2H]
        self.eps = eps

    def __call__(self, x: torch.Tensor, residual_delta: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H] -> normed [N, H]; with residual_delta, x += residual_delta in place first (one fused op)."""
        if kernels.fused(x):
            return kernels.add_rms_norm(x, residual_delta, self.weight, self.eps)
        if residual_delta is not None:
            x += residual_delta
        return rms_norm(x, self.weight2, self.eps)


def head_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Per-head RMS norm in place (Qwen3's q/k norm): x [N, heads, D], weight [heads, D]."""
    if kernels.fused(x):
        kernels.head_rms_norm_(x, weight, eps)
    else:
        torch.mul(rms_norm(x, None, eps), weight, out=x)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> silu(gate) * up [N, I]."""
    if kernels.fused(gate_up):
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, including the 'linear' and 'llama3' context extensions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"config.json: rope type {kind!r} is not supported by the native engine "
                         "(supported: default, linear, llama3)")


class Rotary:
    """Full-width tables [max_len, head_dim] precomputed once, for HF's rotate-half layout:
    out = x * [cos, cos] + roll(x, D/2) * [-sin, sin]."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_len: int, dtype: torch.dtype,
                 freq_factors: tuple[float, ...] | None = None):
        inv_freq = rope_inv_freq(head_dim, theta, scaling)                       # [D/2]
        if freq_factors is not None:  # a GGUF's rope_freqs: llama3-style scaling baked into per-frequency divisors
            if len(freq_factors) != head_dim // 2:
                raise ModelLoadError(f"rope_freqs has {len(freq_factors)} factors, head_dim {head_dim} needs "
                                     f"{head_dim // 2}")
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        self.cos = torch.cat([cos, cos], -1)
        self.sin = torch.cat([-sin, sin], -1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step lookup shared by all layers: cos, signed sin [N, 1, head_dim]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on x [N, H, D], cos/sin [N, 1, D] (native: one kernel; else 3 instead of
    rotate_half's 7)."""
    if kernels.fused(x):
        kernels.rotary_(x, cos[:, 0], sin[:, 0])
    else:
        torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin, out=x)


Blocks = torch.Tensor | slice   # block ids to gather, or a contiguous run of blocks (a view, no copy)


# Prefill attention runs in tiles of this many query positions, aligned to absolute positions, each over the keys up
# to the tile's end. SDPA's CPU kernel picks its blocking from the call's shapes, so one query's result would depend
# on how its prompt was split (chunked prefill, tokens taken from the prefix cache); tiled, it depends on its position
# alone, and a prompt computes bitwise the same K/V however much of it was cached. Costs ~T/2 masked keys per query.
PREFILL_TILE = 64


@dataclass(slots=True)
class PrefillChunk:
    start: int                          # first row of this chunk in the flattened batch
    length: int                         # query tokens in the chunk
    position: int                       # position of its first token; the tokens before it are in the cache
    blocks: Blocks                      # the sequence's blocks covering [0, end rounded up to PREFILL_TILE), padded
    masks: dict = field(default_factory=dict)  # window -> the tiles' additive mask, built by the first layer
    table: torch.Tensor | None = None   # int32 block ids for the native kernel, made by the first layer

    @property
    def tiles(self) -> tuple[int, int]:
        """First and last + 1 tile the chunk's positions fall in."""
        return self.position // PREFILL_TILE, -(-(self.position + self.length) // PREFILL_TILE)


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """The decode rows' tables as the PyTorch attention path reads them (the native kernel reads the tables)."""
    blocks: Blocks                      # [B * max_blocks] row-major tables, or a slice for one contiguous sequence
    mask: torch.Tensor | None           # [B, 1, 1, max_blocks * block_size] additive; None for one sequence
    window_mask: torch.Tensor | None    # the same, hiding keys behind the sliding window too
    context_len: int                    # exact context length when there is one sequence


@dataclass(eq=False)
class AttentionMetadata:
    """Per-step attention layout, built once by the model runner and shared by every layer."""
    slot_mapping: torch.Tensor          # [N] flat cache slot of each token's K/V
    num_decode: int                     # rows [0, num_decode) are single-token decodes, one per sequence
    decode_tables: torch.Tensor | None  # int32 [num_decode, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None    # int32 [num_decode] context lengths incl. the new token
    prefills: list[PrefillChunk]
    block_size: int = memory.KV_BLOCK_TOKENS
    window: int = 0                     # the model's sliding window (0: none)
    mask_dtype: torch.dtype = torch.float32
    _layout: DecodeLayout | None = field(default=None, repr=False)

    def decode_layout(self) -> DecodeLayout:
        """Derived from decode_tables/decode_lens on first use in a step (only the PyTorch path needs it)."""
        if self._layout is None:
            self._layout = self._derive()
        return self._layout

    def _derive(self) -> DecodeLayout:
        bs, lens = self.block_size, self.decode_lens.tolist()
        if self.num_decode == 1:
            table = self.decode_tables[0, :-(-lens[0] // bs)].tolist()
            return DecodeLayout(contiguous_blocks(table), None, None, lens[0])
        keys = torch.arange(self.decode_tables.shape[1] * bs)[None, :]
        ctx = self.decode_lens.long()[:, None]
        visible = keys < ctx                                                            # [B, T]
        window = additive(visible & (keys >= ctx - self.window), self.mask_dtype)[:, None, None] \
            if self.window else None
        return DecodeLayout(self.decode_tables.flatten().long(), additive(visible, self.mask_dtype)[:, None, None],
                            window, 0)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask -> 0 / -inf in the model dtype (SDPA would convert a bool mask per layer)."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))


def contiguous_blocks(table: list[int]) -> Blocks:
    """A contiguous run of blocks is passed as a slice, so attention reads it in place instead of gathering."""
    first = table[0]
    if table[-1] - first == len(table) - 1 and all(b == first + i for i, b in enumerate(table)):
        return slice(first, first + len(table))
    return torch.tensor(table)


def _context(kv_layer: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """kv_layer [NB, bs, 2, Hkv, D] -> the listed blocks' tokens [T, 2, Hkv, D] (one memcpy per block)."""
    if isinstance(blocks, slice):
        return kv_layer[blocks].flatten(0, 1)
    nb, bs, two, n_kv, d = kv_layer.shape
    return torch.index_select(kv_layer.view(nb, -1), 0, blocks).view(-1, 2, n_kv, d)


def _tile_mask(end: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, end] additive: row r sees key k iff k <= end - T + r (and k > end - T + r - window). Tile j of a prompt
    (queries jT + r over keys [0, (j + 1) T)) takes its last (j + 1) T columns: then k <= jT + r, causal."""
    t = PREFILL_TILE
    q, k = torch.arange(end - t, end)[:, None], torch.arange(end)[None, :]
    allowed = (k <= q) & (k > q - window) if window else k <= q
    return additive(allowed, dtype)


def _prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, c: PrefillChunk, scale: float, window: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """q [L, Hq, D] at positions [c.position, c.position + L), their K/V already in the cache -> [L, Hq, D].
    On AMX CPUs the native kernel reads the cache in place (kernels/prefill_attention.cpp: 1.5-2.2x the tiled SDPA
    below at 512-4,096 tokens); either way a query's result depends on its position alone."""
    if kernels.prefill_attention_supported(q):
        if c.table is None:
            b = c.blocks
            c.table = (torch.arange(b.start, b.stop) if isinstance(b, slice) else b).to(torch.int32)
        return kernels.prefill_attention(q, kv_layer, c.table, c.position, scale, window)
    t = PREFILL_TILE
    j0, j1 = c.tiles
    end = j1 * t
    ctx = _context(kv_layer, c.blocks)[:end].permute(1, 2, 0, 3).unsqueeze(1)   # [2, 1, Hkv, end, D]
    first = c.position - j0 * t
    qp = q.new_zeros((j1 - j0) * t, q.shape[1], q.shape[2])                     # whole tiles; the rest is padding
    qp[first:first + c.length] = q
    qp = qp.transpose(0, 1).unsqueeze(0)                                         # [1, Hq, tiles * T, D]
    mask = c.masks.get(window)
    if mask is None:
        mask = c.masks[window] = _tile_mask(end, window, dtype)                  # [T, end]
    outs = []
    for j in range(j0, j1):
        keys = (j + 1) * t
        outs.append(F.scaled_dot_product_attention(qp[:, :, (j - j0) * t:(j - j0 + 1) * t], ctx[0, :, :, :keys],
                                                   ctx[1, :, :, :keys], attn_mask=mask[:, end - keys:], scale=scale,
                                                   enable_gqa=True))              # [1, Hq, T, D]
    return torch.cat(outs, 2)[0, :, first:first + c.length].transpose(0, 1)     # [L, Hq, D]


def paged_attention(q: torch.Tensor, kv_new: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int = 0) -> torch.Tensor:
    """q [N, Hq, D], kv_new [N, 2, Hkv, D] (this step's K and V), kv_layer [NB, bs, 2, Hkv, D] -> [N, Hq, D].
    window > 0: a sliding-window layer, each query sees only the last `window` keys (itself included)."""
    n_tok, n_heads, head_dim = q.shape
    n_kv = kv_new.shape[2]
    kv_layer.view(-1, 2, n_kv, head_dim).index_copy_(0, meta.slot_mapping, kv_new)
    nd = meta.num_decode
    out = None
    if nd:
        # One query per sequence: fold the query heads sharing a KV head into the query-length axis (GQA).
        if meta.decode_tables is not None and kernels.decode_attention_supported(q):
            o = kernels.decode_attention(q[:nd], kv_layer, meta.decode_tables, meta.decode_lens, scale, window)
        else:
            lay = meta.decode_layout()
            qd = q[:nd].view(nd, n_kv, n_heads // n_kv, head_dim)               # [B, Hkv, G, D]
            ctx = _context(kv_layer, lay.blocks)                                 # [B * T, 2, Hkv, D]
            mask = lay.window_mask if window and lay.mask is not None else lay.mask
            if lay.mask is None:
                t = lay.context_len
                ctx = ctx[max(0, t - window) if window else 0:t]
            ctx = ctx.view(nd, -1, 2, n_kv, head_dim).permute(2, 0, 3, 1, 4)    # [2, B, Hkv, T, D]
            o = F.scaled_dot_product_attention(qd, ctx[0], ctx[1], attn_mask=mask, scale=scale)
        o = o.view(nd, n_heads, head_dim)
        if not meta.prefills:
            return o
        out = q.new_empty(q.shape)
        out[:nd] = o
    if out is None and len(meta.prefills) > 1:
        out = q.new_empty(q.shape)
    for c in meta.prefills:
        o = _prefill_attention(q[c.start:c.start + c.length], kv_layer, c, scale, window, meta.mask_dtype)
        if out is None:
            return o
        out[c.start:c.start + c.length] = o
    return out
