"""The tensors of a GGUF file under Hugging Face names, dequantized one at a time as the model loads them.

Tensors of the types the int8 kernels run stay in their blocks (raw(): engine/quant.py packs them); the others, or
all of them on a CPU without the kernels, are dequantized here with llama.cpp's own Python package (`gguf`), on a
read-only memory map, so only one tensor's fp32 copy exists at a time. Nothing keeps the map once loading ends.
"""
from __future__ import annotations

import re

import numpy as np
import torch

from deploykit import gguf as header_reader
from deploykit.modelconfig import ModelConfig
from engine.errors import ModelLoadError

# ggml types that load: the float ones, the legacy block quants (files written by the tests with gguf's own
# quantizer) and the k-quants (checked against transformers' independent dequantizer).
SUPPORTED = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
NOT_WEIGHTS = ("rope_freqs.weight",)  # read into ModelConfig.rope_freq_factors instead


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp's tensor name -> the Hugging Face name; None for a tensor no supported model has."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    return None


class GGUFCheckpoint:
    """Same interface as loader.CheckpointReader: names(), `in`, get(name) -> fp32 tensor, close()."""

    def __init__(self, config: ModelConfig):
        try:
            header = header_reader.read(config.source)
        except Exception as e:  # deploykit's ModelError: re-raised in the engine's family
            raise ModelLoadError(str(e)) from None
        bad = sorted({t.type_name for t in header.tensors if t.name not in NOT_WEIGHTS} - set(SUPPORTED))
        if bad:
            raise ModelLoadError(f"{config.source}: tensors in {', '.join(bad)} cannot be loaded; supported GGUF "
                                 f"types: {', '.join(SUPPORTED)} (dequantized to bfloat16 or float32 at load time). "
                                 "Use a file quantized to one of them, or the Hugging Face checkpoint")
        self.config = config
        self._tensors: dict[str, header_reader.TensorInfo] = {}
        unknown = []
        for t in header.tensors:
            if t.name in NOT_WEIGHTS:
                continue
            name = hf_name(t.name)
            if name is None:
                unknown.append(t.name)
            else:
                self._tensors[name] = t
        if unknown:
            raise ModelLoadError(f"{config.source}: the file has tensors a {config.architecture} does not use (e.g. "
                                 f"{', '.join(unknown[:3])}); it is an unsupported variant")
        self._base = header.data_offset
        self._data = np.memmap(config.source, dtype=np.uint8, mode="r")
        # llama.cpp stores Llama-family q/k rows interleaved for its rotary layout; Qwen keeps HF's order.
        self._unpermute = config.model_type == "llama"

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(ggml type name, shape) of a tensor."""
        t = self._tensors[name]
        return t.type_name, t.shape

    def raw(self, name: str):
        """The tensor's blocks as the file holds them (engine.quant.Raw), copied out of the map, with Llama's q/k
        rows put back in Hugging Face's order as get() does; for the types the engine keeps quantized."""
        from engine.quant import Raw
        t = self._tensors[name]
        rows = t.numel // t.shape[-1]
        data = torch.from_numpy(np.array(self._data[self._base + t.offset:self._base + t.offset + t.nbytes]))
        data = data.view(rows, -1)
        if self._unpermute and (".q_proj." in name or ".k_proj." in name):
            c = self.config
            data = _unpermute(data, c.num_heads if ".q_proj." in name else c.num_kv_heads)
        return Raw(t.type_name, data)

    def get(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"tensor {name!r} not found in {self.config.source}")
        from gguf import GGMLQuantizationType, quants
        raw = self._data[self._base + t.offset:self._base + t.offset + t.nbytes]
        rows = t.numel // t.shape[-1]
        values = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType(t.ggml_type))  # [rows, cols] fp32
        if not values.flags.writeable:  # F32 comes back as a view of the read-only map: own the memory
            values = values.copy()
        w = torch.from_numpy(values).reshape(t.shape)
        if self._unpermute and (".q_proj." in name or ".k_proj." in name):
            c = self.config
            w = _unpermute(w, c.num_heads if ".q_proj." in name else c.num_kv_heads)
        return w

    def close(self) -> None:
        self._data = None


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf permute: per head, rows [D/2, 2] back to HF's rotate-half [2, D/2].
    w: [heads * D, ...] (a weight or a bias)."""
    shape = w.shape
    return w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape).contiguous()
