"""Model registry: the native decoder for supported architectures, transformers for everything else."""
from __future__ import annotations

import torch

from engine.loader import ModelConfig, open_checkpoint
from engine.models.hf_fallback import HFCausalLM
from engine.models.llama import ARCHITECTURES, LlamaModel

__all__ = ["build_model", "is_native", "LlamaModel", "HFCausalLM"]


def is_native(config: ModelConfig) -> bool:
    return config.architecture in ARCHITECTURES


def build_model(config: ModelConfig, dtype: torch.dtype, max_len: int,
                quantization: str = "none", compact: bool = True, huge_pages: bool = True) -> LlamaModel | HFCausalLM:
    if is_native(config):
        reader = open_checkpoint(config)
        try:
            return LlamaModel(config, reader, dtype, max_len, quantization, compact, huge_pages)
        finally:
            reader.close()
    return HFCausalLM(config, dtype)
