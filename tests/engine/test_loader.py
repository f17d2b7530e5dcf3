"""Model directory problems surface as ModelLoadError naming the file/field and the fix; dtype resolution."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from deploykit import isa
from engine.config import EngineConfig, resolve_dtype
from engine.core import EngineCore
from engine.errors import ModelLoadError, OptionsError


def _copy(src, dst):
    return str(shutil.copytree(src, dst))


def _edit_config(model_dir, **changes):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        EngineCore(EngineConfig(str(tmp_path / "nope")))
    with pytest.raises(ModelLoadError, match="config.json"):
        EngineCore(EngineConfig(str(tmp_path)))


def test_the_engine_treats_a_directory_a_gguf_and_another_file_as_deploykit_does(tiny_model, tmp_path, caplog):
    """deploykit.modelfiles.kind decides for the loader, the tokenizer and the server's start-up check alike."""
    from engine import tokenizer
    from engine.loader import CheckpointReader, load_config, open_checkpoint
    from engine.server.launch import serve
    from engine.server.options import ServeOptions
    from tests.render.cases import write_tiny_gguf

    d = tiny_model("llama")
    reader = open_checkpoint(load_config(d))  # a directory: safetensors, its own tokenizer files
    assert isinstance(reader, CheckpointReader)
    reader.close()
    assert tokenizer.load(d).vocab_size > 0
    gguf_file = str(write_tiny_gguf(tmp_path / "tiny.gguf"))  # a .gguf: its header
    assert load_config(gguf_file).model_type == "qwen2"
    other = tmp_path / "model.safetensors"  # a single file that is not a .gguf: refused before anything starts
    shutil.copy(os.path.join(d, "model.safetensors"), other)
    with pytest.raises(ModelLoadError, match="is a file but not a .gguf file"):
        load_config(str(other))
    with caplog.at_level(logging.ERROR, logger="engine.server"):
        assert serve(ServeOptions(str(other), port=0)) == 3
    assert "is a file but not a .gguf file" in caplog.text


def test_missing_weights(tiny_model, tmp_path):
    d = _copy(tiny_model("llama"), tmp_path / "m")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        EngineCore(EngineConfig(d))


def test_missing_shard(tiny_model, tmp_path):
    d = _copy(tiny_model("qwen2", tie_word_embeddings=True, max_shard_size="100KB"), tmp_path / "m")
    shard = sorted(f for f in os.listdir(d) if f.startswith("model-"))[-1]
    os.remove(os.path.join(d, shard))
    with pytest.raises(ModelLoadError, match=shard):
        EngineCore(EngineConfig(d))


def test_config_that_does_not_match_the_weights(tiny_model, tmp_path):
    d = _copy(tiny_model("llama"), tmp_path / "m")
    _edit_config(d, intermediate_size=96)
    with pytest.raises(ModelLoadError, match="gate_proj.*config"):
        EngineCore(EngineConfig(d))


def test_unsupported_rope_and_missing_fields(tiny_model, tmp_path):
    d = _copy(tiny_model("llama"), tmp_path / "m")
    _edit_config(d, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match="longrope"):
        EngineCore(EngineConfig(d))
    _edit_config(d, hidden_size=None)
    with pytest.raises(ModelLoadError, match="hidden_size"):
        EngineCore(EngineConfig(d))


def test_context_and_kv_limits(tiny_model):
    d = tiny_model("llama")
    with pytest.raises(ModelLoadError, match="max_position_embeddings=2048"):
        EngineCore(EngineConfig(d, max_model_len=4096))
    with pytest.raises(ModelLoadError, match="too small"):
        EngineCore(EngineConfig(d, dtype="float32", kv_cache_bytes=100))


def test_dtype_resolution(caplog):
    assert resolve_dtype("auto") == (torch.bfloat16 if isa.has_bf16(isa.cpu_flags()) else torch.float32)
    assert resolve_dtype("float32") == torch.float32
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert resolve_dtype("float16") == torch.bfloat16
    assert "bfloat16" in caplog.text
    with pytest.raises(OptionsError, match="dtype"):
        EngineConfig("m", dtype="int8")


def test_checkpoint_with_tensors_the_model_would_ignore_is_refused(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file
    d = _copy(tiny_model("llama"), tmp_path / "m")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.extra_gate.weight"] = torch.zeros(4)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="extra_gate"):
        EngineCore(EngineConfig(d))


def test_sliding_window_defaults_follow_transformers():
    from deploykit.modelconfig import sliding_layers as _sliding
    assert _sliding({"model_type": "mistral"}, 4) == (4096, (0, 1, 2, 3))  # MistralConfig's default window
    assert _sliding({"model_type": "mistral", "sliding_window": None}, 4) == (None, ())  # v0.2+: off
    assert _sliding({"model_type": "qwen2", "sliding_window": 4096}, 4) == (None, ())  # use_sliding_window absent
    assert _sliding({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                     "max_window_layers": 2}, 4) == (64, (2, 3))
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert _sliding({"model_type": "qwen3", "sliding_window": 32, "layer_types": types}, 4) == (32, (1, 3))
    assert _sliding({"model_type": "llama"}, 4) == (None, ())


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_no_checkpoint_stays_mapped_after_load(tiny_model, smollm2, source):
    """Once loaded, the model holds its own copies: a mapped checkpoint's pages would count twice in RSS and against
    a container's memory limit (safetensors hands out tensors backed by its map)."""
    import gc
    path = tiny_model("qwen2", dtype="bfloat16") if source == "safetensors" else smollm2
    core = EngineCore(EngineConfig(path, dtype="bfloat16", max_model_len=128))
    gc.collect()
    with open("/proc/self/maps") as f:
        mapped = [line.split()[-1] for line in f if path in line]
    assert mapped == [], mapped
    assert core.model is not None
