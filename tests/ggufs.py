"""Write a Hugging Face checkpoint as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does, so the GGUF tests
can load generated Llama/Qwen2/Qwen3 models in every supported quantization, and the llama.cpp benchmark has its
peer's model. Uses llama.cpp's own `gguf` package (writer, tensor names, quantizers); tests and benchmarks only.

llama.cpp conventions reproduced here: Llama q/k rows are permuted for its rotary layout (Qwen keeps HF's); 1-D
tensors (norms, biases) stay F32; a tied lm_head is not written (output.weight absent); llama3 rope scaling
becomes a `rope_freqs` tensor of per-frequency divisors.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from deploykit.modelconfig import ModelConfig, read_dir
from engine.loader import CheckpointReader

# Our tokenizers pre-tokenize with ByteLevel(use_regex=True): the GPT-2 split pattern, llama.cpp's "gpt-2".
PRE_TOKENIZER = "gpt-2"
ARCHS = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
QUANTS = ("F32", "BF16", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def _tokens(model_dir: str, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(token strings by id, gguf TokenType by id, "a b" merges) from tokenizer.json; ids the tokenizer does not
    use (embedding rows past its vocabulary) become UNUSED placeholders so the list matches the embedding."""
    import gguf

    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers are exported, got {model.get('type')!r}")
    tokens: list[str | None] = [None] * vocab_size
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for text, i in model["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = text, int(gguf.TokenType.NORMAL)
    for added in tok.get("added_tokens", []):
        i = added["id"]
        if i < vocab_size:
            tokens[i] = added["content"]
            types[i] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
    names = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return names, types, merges


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permute: per head, HF's rotate-half rows [2, D/2] become [D/2, 2]."""
    shape = w.shape
    return w.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def rope_freq_factors(cfg: ModelConfig) -> list[float] | None:
    """llama.cpp's rope_freqs for a llama3-scaled model: inv_freq / llama3-scaled inv_freq, per frequency."""
    rs = cfg.rope_scaling
    if not rs or rs.get("rope_type") != "llama3":
        return None
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old = float(rs["original_max_position_embeddings"])
    out = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * math.pi * cfg.rope_theta ** (i / cfg.head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _encoded(t: torch.Tensor, quant: str):
    """(numpy data, raw gguf type or None) for one tensor: matrices in `quant`, 1-D tensors F32."""
    from gguf import GGMLQuantizationType as T, quants

    if t.dim() < 2 or quant == "F32":
        return t.float().contiguous().numpy(), None
    if quant == "BF16" and t.dtype == torch.bfloat16:  # bit-exact copy of a bf16 checkpoint
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), T.BF16
    data = t.float().contiguous().numpy()
    if quant == "F16":
        return data.astype(np.float16), None
    qtype = getattr(T, quant)
    return quants.quantize(data, qtype), qtype


def export_gguf(model_dir: str, out_path: str, quant: str = "BF16") -> str:
    """Write model_dir (a Llama/Qwen2/Qwen3 HF directory with tokenizer.json) to out_path; returns out_path."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    cfg = read_dir(model_dir)
    if cfg.model_type not in ARCHS:
        raise ValueError(f"only {sorted(ARCHS)} checkpoints are exported, got {cfg.model_type!r}")
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("rope_type") != "llama3":
        raise ValueError(f"rope scaling {cfg.rope_scaling} is not exported")
    with open(os.path.join(model_dir, "config.json")) as f:
        raw_cfg = json.load(f)
    arch = getattr(gguf.MODEL_ARCH, ARCHS[cfg.model_type])
    tmp = out_path + ".tmp"
    w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(os.path.basename(os.path.normpath(model_dir)))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)

    tokens, types, merges = _tokens(model_dir, cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if isinstance(raw_cfg.get("bos_token_id"), int):
        w.add_bos_token_id(raw_cfg["bos_token_id"])
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    if isinstance(raw_cfg.get("pad_token_id"), int):
        w.add_pad_token_id(raw_cfg["pad_token_id"])
    w.add_add_bos_token(False)
    template = Path(model_dir, "chat_template.jinja")
    if template.is_file():
        w.add_chat_template(template.read_text())

    factors = rope_freq_factors(cfg)
    if factors is not None:
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", np.array(factors, np.float32))
    names = gguf.get_tensor_name_map(arch, cfg.num_layers)
    reader = CheckpointReader(model_dir)
    for hf_name in sorted(reader.names()):
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp reuses token_embd when output.weight is absent
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name!r}")
        t = reader.get(hf_name)
        if cfg.model_type == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            t = _permute(t, cfg.num_heads if ".q_proj." in hf_name else cfg.num_kv_heads)
        data, raw = _encoded(t, quant)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader.close()
    os.replace(tmp, out_path)  # a killed export never leaves a truncated file under the final name
    return out_path
