"""Reading a model for the engine: its ModelConfig (deploykit.modelconfig, shared with the planner) and its named
tensors, from (sharded) safetensors or, dequantized, from a GGUF file (engine/gguf_weights.py)."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from deploykit import modelfiles
from deploykit.errors import DeploykitError
from deploykit.modelconfig import ModelConfig
from engine.errors import ModelLoadError

__all__ = ["CheckpointReader", "ModelConfig", "load_config", "open_checkpoint"]


def load_config(model: str) -> ModelConfig:
    """The model's configuration: config.json of a Hugging Face directory, or a .gguf file's header."""
    try:
        return modelfiles.read_config(model)
    except DeploykitError as e:  # the shared reader's error, re-raised in the engine's family
        raise ModelLoadError(str(e)) from None


def open_checkpoint(config: ModelConfig):
    """Named tensors (Hugging Face names) of the model `config` was read from."""
    if modelfiles.is_gguf(config.source):
        from engine.gguf_weights import GGUFCheckpoint
        return GGUFCheckpoint(config)
    return CheckpointReader(config.source)


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


_FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # safetensors dtype -> deploykit.quant's type names


class CheckpointReader:
    """Tensors by HF name from model.safetensors or the shards listed in model.safetensors.index.json."""

    def __init__(self, model_dir: str):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.isfile(index):
            weight_map = _load_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: missing 'weight_map'; re-save the model with save_pretrained")
            files = {name: os.path.join(model_dir, f) for name, f in weight_map.items()}
        elif os.path.isfile(single):
            files = None
        else:
            raise ModelLoadError(f"no weights in {model_dir}: expected model.safetensors or "
                                 "model.safetensors.index.json (+ shards); convert .bin checkpoints with "
                                 "save_pretrained(..., safe_serialization=True)")
        self._handles: dict[str, object] = {}
        if files is None:
            handle = self._open(single)
            files = {name: single for name in handle.keys()}
        for f in set(files.values()):
            if not os.path.isfile(f):
                raise ModelLoadError(f"weight shard {f} listed in model.safetensors.index.json is missing")
        self._files = files

    def _open(self, f: str):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(f, framework="pt")
            except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
                raise ModelLoadError(f"cannot read weight file {f}: {e}") from e
        return self._handles[f]

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(F32 / F16 / BF16, shape) of a tensor, from the file's header."""
        sl = self._open(self._files[name]).get_slice(name)
        return _FLOAT_TYPES.get(sl.get_dtype(), "F32"), tuple(sl.get_shape())

    def raw(self, name: str):
        raise ModelLoadError(f"{name} is a float tensor: it has no quantized blocks")

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise ModelLoadError(f"tensor {name!r} not found in the checkpoint at "
                                 f"{os.path.dirname(next(iter(self._files.values()), ''))}")
        # A copy the model owns: safetensors hands out tensors backed by its map of the file, and one kept (a norm
        # weight) would keep the whole checkpoint mapped, its pages counted in RSS and the container's memory.
        return self._open(self._files[name]).get_tensor(name).clone()

    def close(self) -> None:
        self._handles.clear()
