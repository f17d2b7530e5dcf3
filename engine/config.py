"""Frozen engine configuration and the torch dtype it runs in (importing it does not import torch).

The dtype rule and the CPU facts behind it live in deploykit (memory.resolve_dtype, isa), shared with the planner.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from deploykit import isa, memory, modelfiles, quant
from engine.errors import OptionsError

log = logging.getLogger("engine")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str  # a Hugging Face model directory or a .gguf file
    dtype: str = "auto"
    max_model_len: int | None = None        # None -> the model's max_position_embeddings
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_bytes: int | None = None       # None -> enough for max_num_seqs x max_model_len, capped
    block_size: int = memory.KV_BLOCK_TOKENS
    prefix_caching: bool = True             # reuse cached KV blocks of identical prompt prefixes
    seed: int = 0
    served_model_name: str | None = None
    quantization: str = "none"              # float weights quantized on load (deploykit.quant.ON_LOAD)
    compact_weights: bool = True            # bf16 matrices in 12 bits a weight, losslessly (kernels/compact_bf16.h)
    huge_pages: bool = True                 # weights in one arena that asks for 2 MiB pages (engine/hugepages.py)
    decode_steps: int = 8                   # at most this many greedy decode steps in one call (EngineCore._run_steps)

    def __post_init__(self) -> None:
        try:
            memory.canonical_dtype(self.dtype)
        except ValueError as e:
            raise OptionsError(str(e)) from None
        if self.quantization not in quant.ON_LOAD:
            raise OptionsError(f"quantization must be one of {', '.join(quant.ON_LOAD)}, got {self.quantization!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "decode_steps"):
            if getattr(self, name) < 1:
                raise OptionsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise OptionsError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise OptionsError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or modelfiles.served_name(self.model)


def dtype_name(requested: str) -> str:
    """The dtype weights and KV cache use on this CPU ("bfloat16" or "float32"), logging why when it differs."""
    name, notes = memory.resolve_dtype(requested, isa.has_bf16(isa.cpu_flags()))
    for note in notes:
        log.warning("%s", note)
    return name


def resolve_dtype(requested: str):
    """dtype_name as a torch.dtype."""
    import torch
    return getattr(torch, dtype_name(requested))


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
