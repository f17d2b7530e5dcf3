"""The rendered-output cases shared by the golden tests and the Docker tests: (sysroot fixture, spec sections)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.conftest import make_spec

# Small Qwen-shaped model for cases that read a local config.json instead of spec numbers.
TINY_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 1000, "max_position_embeddings": 2048, "tie_word_embeddings": False}

QWEN25_05B = {"source": "Qwen/Qwen2.5-0.5B-Instruct", "max_model_len": 4096,
              "architecture": {"num_parameters": 494_032_768, "num_hidden_layers": 24, "num_key_value_heads": 2,
                               "head_dim": 64, "max_position_embeddings": 32768}}

CASES: dict[str, tuple[str, dict]] = {
    "one-replica-two-cpu": ("two-cpu", {}),
    "two-replicas-2socket": ("epyc-2s-nps1", {"serving": {"api_key": {"env": "DEPLOYKIT_API_KEY"},
                                                          "publish_address": "127.0.0.1"}}),
    "use-smt": ("xeon-2s-snc2", {"placement": {"use_smt": True}}),
    "reserved-cpus-0": ("two-cpu", {"model": QWEN25_05B,
                                    "placement": {"strategy": "explicit", "cpus": ["0", "1"], "reserved_cpus": 0}}),
    "custom-base": ("two-cpu", {"image": {"name": "registry.example.com/llm/engine", "tag": "2025.1",
                                          "base": "deploykit-base:bookworm", "wheelhouse": "./wheelhouse"},
                                "security": {"seccomp": "runtime-default", "run_as_user": 20000,
                                             "read_only_root": False},
                                "serving": {"prefix_caching": False}}),
    "sys-nice": ("two-cpu", {"security": {"sys_nice": True}}),
    "local-model-unconfined": ("two-cpu", {"model": {"source": "./tiny-model", "max_model_len": 1024},
                                           "security": {"seccomp": "unconfined"}}),
    # a .gguf file: sized from its header, mounted as one file, MODEL_FILE instead of MODEL_DIR
    "gguf-file": ("two-cpu", {"model": {"source": "./tiny.Q8_0.gguf", "max_model_len": 1024}}),
}


def write_tiny_gguf(path: Path) -> Path:
    """A deterministic GGUF header for TINY_CONFIG's shapes (all-zero Q8_0 weights): what planning reads."""
    import gguf
    import numpy as np

    c = TINY_CONFIG
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("block_count", layers), ("context_length", c["max_position_embeddings"]),
                       ("embedding_length", h), ("feed_forward_length", i),
                       ("attention.head_count", c["num_attention_heads"]),
                       ("attention.head_count_kv", c["num_key_value_heads"])):
        w.add_uint32(f"qwen2.{key}", value)
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
    for n in range(layers):
        shapes |= {f"blk.{n}.attn_q.weight": (h, h), f"blk.{n}.attn_k.weight": (kv, h),
                   f"blk.{n}.attn_v.weight": (kv, h), f"blk.{n}.attn_output.weight": (h, h),
                   f"blk.{n}.ffn_gate.weight": (i, h), f"blk.{n}.ffn_up.weight": (i, h),
                   f"blk.{n}.ffn_down.weight": (h, i), f"blk.{n}.attn_norm.weight": (h,),
                   f"blk.{n}.ffn_norm.weight": (h,)}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, np.zeros(shape, np.float32))
        else:
            w.add_tensor(name, np.zeros((shape[0], shape[1] // 32 * 34), np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_spec(directory: Path, sections: dict, name: str = "spec.yaml") -> Path:
    """The spec file plus what its relative paths point at (a model's config.json or .gguf, a wheelhouse)."""
    (directory / "tiny-model").mkdir(parents=True, exist_ok=True)
    (directory / "tiny-model" / "config.json").write_text(json.dumps(TINY_CONFIG))
    if not (directory / "tiny.Q8_0.gguf").exists():
        write_tiny_gguf(directory / "tiny.Q8_0.gguf")
    (directory / "wheelhouse").mkdir(exist_ok=True)
    spec = directory / name
    spec.write_text(yaml.safe_dump(make_spec(**sections)))
    return spec
