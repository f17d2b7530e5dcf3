"""The attention ops of the native library as the model calls them: which shapes the paged attention kernels take, and
the calls (decode_attention.cpp and f32_ops.cpp: one query per sequence; prefill_attention.cpp: a prompt chunk on AMX
tiles). engine/kernels/__init__.py binds them to its loaded library (`bind`, again whenever it is reloaded) and
re-exports them."""

from __future__ import annotations

import torch

from engine.kernels.loader import Native

_BF16, _F32 = torch.bfloat16, torch.float32
_amx, _bf16_ok, _f32_ok = False, False, False
_limits: dict[str, int] = {}
_decode_attention = _prefill_attention = _decode_attention_f32 = None


def bind(native: Native, ops, qops, limits: dict[str, int]) -> None:
    """The library these calls run: ops the AVX-512 one (bf16), qops any build (fp32); None where not loaded. The op
    handles are resolved once here: the OpOverloadPacket lookup costs microseconds per call."""
    global _amx, _bf16_ok, _f32_ok, _limits, _decode_attention, _prefill_attention, _decode_attention_f32
    _amx, _bf16_ok, _f32_ok, _limits = native.amx, ops is not None, qops is not None, limits
    if ops is not None:
        _decode_attention, _prefill_attention = ops.decode_attention.default, ops.prefill_attention.default
    if qops is not None:
        _decode_attention_f32 = qops.decode_attention_f32.default


# fp32 decode attention takes head sizes in whole AVX2 vectors (f32_ops.cpp).
F32_HEAD_DIM_MULTIPLE, F32_MAX_HEAD_DIM = 8, 256


def decode_attention_supported(q: torch.Tensor) -> bool:
    """q [B, Hq, D]: the native paged decode attention handles bf16 with D a multiple of 32 up to 256 (LIMITS), and
    fp32 with D a multiple of 8 up to 256."""
    d = q.shape[-1]
    if q.dtype == _F32:
        return _f32_ok and d % F32_HEAD_DIM_MULTIPLE == 0 and d <= F32_MAX_HEAD_DIM
    return _bf16_ok and q.dtype == _BF16 and d % _limits["head_dim_multiple"] == 0 and d <= _limits["max_head_dim"]


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                     scale: float, window: int = 0) -> torch.Tensor:
    """One query per sequence against its cached context, read in place from the paged cache.
    q [B, Hq, D], kv_layer [blocks, block_size, 2, Hkv, D] (q's dtype), tables int32 [B, W], lens int32 [B]
    -> [B, Hq, D]. window > 0: only the last `window` tokens of each context (sliding-window attention)."""
    return (_decode_attention_f32 if q.dtype == _F32 else _decode_attention)(q, kv_layer, tables, lens, scale, window)


def prefill_attention_supported(q: torch.Tensor) -> bool:
    """q [L, Hq, D]: the native prefill attention (kernels/prefill_attention.cpp) runs on AMX-BF16 tiles, bf16 with D a
    multiple of 64 up to 256; elsewhere layers.py's tiled SDPA runs."""
    return _amx and q.dtype == _BF16 and q.shape[-1] % 64 == 0 and q.shape[-1] <= 256


def prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, position: int, scale: float,
                      window: int = 0) -> torch.Tensor:
    """A prompt chunk's queries q [L, Hq, D] at positions [position, position + L), their K/V already in the cache,
    against every key before them, read in place from the paged cache: kv_layer [blocks, block_size, 2, Hkv, D],
    table int32 [W] the sequence's blocks. window > 0: only the last `window` keys (itself included) -> [L, Hq, D].
    A query's result depends on its position and the keys alone, not on how its prompt was chunked."""
    return _prefill_attention(q, kv_layer, table, position, scale, window)
