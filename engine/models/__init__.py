"""Model registry: the native decoder for supported architectures, transformers for everything else."""
from __future__ import annotations

import torch

from engine.loader import CheckpointReader, ModelSpec
from engine.models.hf_fallback import HFCausalLM
from engine.models.llama import ARCHITECTURES, LlamaModel

__all__ = ["build_model", "is_native", "LlamaModel", "HFCausalLM"]


def is_native(spec: ModelSpec) -> bool:
    return spec.architecture in ARCHITECTURES


def build_model(spec: ModelSpec, dtype: torch.dtype, max_len: int) -> LlamaModel | HFCausalLM:
    if is_native(spec):
        reader = CheckpointReader(spec.path)
        try:
            return LlamaModel(spec, reader, dtype, max_len)
        finally:
            reader.close()
    return HFCausalLM(spec, dtype)
