"""Frozen engine configuration and the resolution of its "auto" dtype (importing it does not import torch)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache

log = logging.getLogger("engine")

_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None        # None -> the model's max_position_embeddings
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None       # None -> enough for max_num_seqs x max_model_len, capped
    block_size: int = 16
    seed: int = 0
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or os.path.basename(os.path.normpath(self.model))


@lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX); otherwise bf16 is emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def resolve_dtype(name: str):
    """'auto' -> bfloat16 where the CPU computes it natively, else float32; returns a torch.dtype."""
    import torch
    if name == "auto":
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    dtype = getattr(torch, _DTYPES[name])
    if dtype is torch.float16:
        # fp16 matmuls on CPU are emulated and slower than bf16, and bf16 has fp16's memory footprint.
        log.warning("dtype float16 is not supported on CPU; using bfloat16 instead")
        return torch.bfloat16
    return dtype


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
