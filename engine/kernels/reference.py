"""PyTorch references of the native element-wise ops (engine/kernels/decode_ops.cpp in bf16, f32_ops.cpp in fp32):
what the tests hold the native ops to. fp32 inside, like the native ops."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fallback_add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference for add_rms_norm (fp32 inside, like the native op)."""
    if delta is not None:
        h += delta
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(h.dtype)


def fallback_head_rms_norm_(x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
    xf = x.float()
    x.copy_(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float())


def fallback_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def fallback_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    xf = x.float()
    x.copy_(xf * cos.float()[:, None] + xf.roll(x.shape[-1] // 2, -1) * sin.float()[:, None])
