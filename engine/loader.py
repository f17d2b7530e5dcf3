"""Reading a Hugging Face model directory: config.json -> ModelSpec, and named tensors from (sharded) safetensors."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The fields of a HF config.json that the engine needs, normalised across transformers versions."""
    path: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()     # layers that attend only to the last sliding_window tokens
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V cache one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def read_hf_config(model_dir: str) -> dict:
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model directory {model_dir!r} does not exist; pass a local Hugging Face model "
                             "directory (create a test one with `python -m engine tiny-model DIR`)")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path} not found: the model directory must contain a Hugging Face config.json "
                             "(save the model with save_pretrained)")
    return _load_json(path)


def _eos_ids(model_dir: str, cfg: dict) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg]
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        sources.append(_load_json(gen_path))
    for src in sources:
        eos = src.get("eos_token_id")
        for i in (eos if isinstance(eos, list) else [eos]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _require(cfg: dict, key: str, path: str):
    if cfg.get(key) is None:
        raise ModelLoadError(f"{path}: field {key!r} is missing; it is required to build the model")
    return cfg[key]


def load_spec(model_dir: str) -> ModelSpec:
    cfg = read_hf_config(model_dir)
    path = os.path.join(model_dir, "config.json")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}  # multimodal wrappers keep the language model's fields nested
    archs = cfg.get("architectures") or []
    hidden = int(_require(cfg, "hidden_size", path))
    heads = int(_require(cfg, "num_attention_heads", path))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{path}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}; this attention layout is unsupported")
    # transformers >= 5 nests rope settings in rope_parameters; older checkpoints use rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    layers = int(_require(cfg, "num_hidden_layers", path))
    window, sliding = _sliding(cfg, layers)
    return ModelSpec(
        path=model_dir,
        architecture=archs[0] if archs else "",
        model_type=str(cfg.get("model_type", "")),
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(cfg.get("intermediate_size") or cfg.get("ffn_dim") or 4 * hidden),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act") or cfg.get("activation_function") or "silu"),
        sliding_window=window,
        sliding_layers=sliding,
        eos_token_ids=_eos_ids(model_dir, cfg),
    )


def _sliding(cfg: dict, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers using it), with transformers' defaults: `layer_types` when the config lists them;
    else Qwen2-style `use_sliding_window` (absent = off) from layer `max_window_layers` on; else Mistral, whose
    every layer slides and whose window is 4096 when the key is absent (an explicit null turns it off)."""
    mistral = cfg.get("model_type") == "mistral"
    window = cfg.get("sliding_window", 4096 if mistral else None)
    if cfg.get("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        return None, ()
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif cfg.get("use_sliding_window"):
        sliding = tuple(range(int(cfg.get("max_window_layers") or 0), layers))
    else:
        sliding = tuple(range(layers)) if mistral else ()
    return (window, sliding) if sliding else (None, ())


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

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise ModelLoadError(f"tensor {name!r} not found in the checkpoint at "
                                 f"{os.path.dirname(next(iter(self._files.values()), ''))}")
        return self._open(self._files[name]).get_tensor(name)

    def close(self) -> None:
        self._handles.clear()
