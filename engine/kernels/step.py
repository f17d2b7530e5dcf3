"""The fused decode step as the model calls it: which models and matrices it takes, how many sequences at once, and
the call (decode_step.cpp: bf16 activations, AVX-512 builds; decode_step_f32.cpp: fp32 activations, every build).
engine/kernels/__init__.py binds it to its loaded library (`bind`, again whenever it is reloaded) and re-exports it."""

from __future__ import annotations

import torch

from deploykit.memory import WIDEN_ROWS
from engine.kernels.attention import decode_attention_supported
from engine.kernels.quant_ops import is_quantized

_BF16, _F32 = torch.bfloat16, torch.float32
_step = _step_f32 = None
_block_n = WIDEN_ROWS
# Sequences per call, 0 where the step does not run: MAX_ROWS for the bf16 step (the GEMV loads each weight line once
# for all of them, so the step stays one weight-streaming pass), MAX_TILE_ROWS where every matrix is quantized or on
# AMX tiles; F32_MAX_ROWS for the fp32 step, whatever its matrices hold. Stated once in C++ (decode_step.cpp
# `limits`, decode_step_f32.cpp `decode_step_f32_max_rows`) and read from the library.
MAX_ROWS = MAX_TILE_ROWS = F32_MAX_ROWS = 0


def bind(ops, qops, limits: dict[str, int]) -> None:
    """The library the step runs in: ops the AVX-512 one (bf16), qops any build (fp32); None where not loaded. The op
    handles are resolved once here: the OpOverloadPacket lookup costs microseconds per call."""
    global _step, _step_f32, _block_n, MAX_ROWS, MAX_TILE_ROWS, F32_MAX_ROWS
    _step = ops.decode_step_.default if ops is not None else None
    _step_f32 = qops.decode_step_f32_.default if qops is not None else None
    _block_n = limits.get("block_n", WIDEN_ROWS)
    MAX_ROWS = limits.get("step_max_rows", 0)
    MAX_TILE_ROWS = limits.get("step_max_tile_rows", MAX_ROWS)
    F32_MAX_ROWS = int(qops.decode_step_f32_max_rows()) if qops is not None else 0


def decode_step_supported(q: torch.Tensor, intermediate_size: int) -> bool:
    """Whether decode_step_ takes a model with heads like q [B, Hq, D] and this MLP width (gate and up blocks of the
    packed gate_up weight must not straddle the two halves): bf16 on the AVX-512 builds, fp32 on any build (its
    matrices quantized or bf16 held packed, `step_f32_weight`)."""
    if q.dtype == _F32:
        return F32_MAX_ROWS > 0 and decode_attention_supported(q) and intermediate_size % WIDEN_ROWS == 0
    return q.dtype == _BF16 and decode_attention_supported(q) and intermediate_size % _block_n == 0


def step_f32_weight(w: torch.Tensor) -> bool:
    """Whether the fp32 step reads this matrix: block-quantized, or bf16 packed for widening (prepare_bf16w)."""
    return is_quantized(w) or (w.dtype == _BF16 and w.dim() == 4 and w.shape[2] == WIDEN_ROWS and w.shape[3] == 2)


def decode_step_(h: torch.Tensor, weights: list, kv: list[torch.Tensor], windows: list[int], cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 slots: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float, scale: float,
                 norm: torch.Tensor | None = None, lm_head: torch.Tensor | None = None,
                 logits: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                 embed: torch.Tensor | None = None, greedy: torch.Tensor | None = None, steps: int = 1,
                 stops: torch.Tensor | None = None) -> int:
    """The whole forward pass of a decode step in one call: h [B, H], the embedding rows, becomes the last residual
    stream; each layer's K/V are written at `slots`. bf16 h (decode_step.cpp): B <= MAX_ROWS, MAX_TILE_ROWS where
    every matrix is quantized or on AMX tiles. fp32 h (decode_step_f32.cpp): B <= F32_MAX_ROWS; fp32 norms, biases,
    rotary tables and KV cache.
    positions, slots int64 [B]; tables int32 [B, W], lens int32 [B] as decode_attention takes them.
    weights: 11 per layer (ln1, qkv, qkv_bias, qk_norm, o, o_bias, ln2, gate_up, gate_up_bias, down, down_bias),
    packed and prepared as engine.kernels.linear takes them, None where absent. Bitwise the same as the per-op native
    path.
    logits fp32 [B, V] (norm [H] in h's dtype, lm_head [V, H] a matrix as above, under bf16 past MAX_ROWS quantized
    or on AMX tiles): also written in the same call, the bits of logits(rms_norm(h) * norm, lm_head); and greedy int64
    [B], each row's argmax of them as kernels.argmax gives it.
    ids int64 [B] and embed, a token table as layers.embed_rows takes it: h's rows are looked up there in the same
    call, not read (h still gets the last residual stream).
    steps > 1 (with ids, embed, logits and greedy int64 [steps, B]): a run of decode steps in the one call, each
    step's greedy tokens the next one's ids at the next position (its K/V in the slot `tables` gives it; tables and
    the rotary tables must reach the last step), until a step picks a token in stops (int64 [S]) for some row or all
    ran. Returns the steps run; logits and h are the last one's, greedy's first rows each step's tokens."""
    return int((_step_f32 if h.dtype == _F32 else _step)(h, weights, kv, windows, cos, sin, positions, tables, lens,
                                                         slots, num_heads, num_kv_heads, eps, scale, norm, lm_head,
                                                         logits, ids, embed, greedy, steps, stops))
