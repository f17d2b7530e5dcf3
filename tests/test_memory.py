"""Model sizing from local files only: safetensors headers, config.json, the HF cache, or spec numbers."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from deploykit import memory, modelfiles
from deploykit.errors import ModelError
from deploykit.spec import ModelSpec

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
          "max_position_embeddings": 512, "tie_word_embeddings": True}


def model_dir(tmp_path, sharded=False):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    a = {"embed.weight": np.zeros((100, 64), np.float32), "l0.q.weight": np.zeros((64, 64), np.float32)}
    b = {"l0.mlp.weight": np.zeros((128, 64), np.float32), "l0.q.bias": np.zeros((64,), np.float32)}
    if sharded:
        save_file(a, d / "model-00001-of-00002.safetensors")
        save_file(b, d / "model-00002-of-00002.safetensors")
        wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file(a | b, d / "model.safetensors")
    return d


@pytest.mark.parametrize("sharded", [False, True])
def test_counts_parameters_exactly_from_safetensors_headers(tmp_path, sharded):
    s = memory.shape(ModelSpec(source=str(model_dir(tmp_path, sharded))))
    assert s.num_parameters == 100 * 64 + 64 * 64 + 128 * 64 + 64 and s.counted_from == "safetensors"
    assert (s.num_hidden_layers, s.num_key_value_heads, s.head_dim, s.max_position_embeddings) == (2, 2, 16, 512)
    assert s.kv_bytes_per_token("bfloat16") == 2 * 2 * 2 * 16 * 2
    assert s.weight_bytes("float32") == 4 * s.num_parameters


def test_missing_shard_named_in_index_is_a_model_error(tmp_path):
    d = model_dir(tmp_path, sharded=True)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="missing"):
        memory.shape(ModelSpec(source=str(d)))


def test_config_only_counts_with_the_formula(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    s = memory.shape(ModelSpec(source=str(d)))
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert s.num_parameters == 2 * per_layer + 100 * 64 + 64 and s.counted_from == "config.json"


def test_hf_cache_snapshot_is_found_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--acme--tiny"
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(CONFIG))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert modelfiles.locate("acme/tiny") == snap
    assert modelfiles.locate("acme/tiny", revision="a" * 40) == snap
    assert modelfiles.locate("acme/tiny", revision="v2") is None
    assert memory.shape(ModelSpec(source="acme/tiny")).path == str(snap)


def test_absent_model_without_numbers_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelError) as e:
        memory.shape(ModelSpec(source="acme/absent"))
    msg = str(e.value)
    assert "never downloads" in msg and "model.architecture" in msg and "acme/absent" in msg


def test_broken_config_json(tmp_path):
    d = tmp_path / "b"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="config.json"):
        memory.shape(ModelSpec(source=str(d)))
    (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelError, match="num_hidden_layers"):
        memory.shape(ModelSpec(source=str(d)))
    good = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "vocab_size": 10}
    (d / "config.json").write_text(json.dumps({**good, "num_hidden_layers": 0}))
    with pytest.raises(ModelError, match="non-positive sizes"):
        memory.shape(ModelSpec(source=str(d)))
    (d / "config.json").write_text(json.dumps({**good, "intermediate_size": "big"}))
    with pytest.raises(ModelError, match="usable"):
        memory.shape(ModelSpec(source=str(d)))


def test_a_gguf_file_is_sized_from_its_header_by_the_bytes_the_engine_will_hold(tmp_path):
    """Q8_0 on disk, but the engine dequantizes: weight bytes are parameters x the plan's dtype size."""
    from deploykit import gguf
    from tests.render.cases import TINY_CONFIG, write_tiny_gguf
    path = write_tiny_gguf(tmp_path / "m.gguf")
    s = memory.shape(ModelSpec(source=str(path)))
    assert s.counted_from == "gguf" and s.path == str(path) and s.architecture == "Qwen2ForCausalLM"
    assert s.num_parameters == gguf.read(path).num_parameters
    c = TINY_CONFIG
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert s.num_parameters == 2 * per_layer + 2 * c["vocab_size"] * 64 + 64  # the config.json formula agrees
    assert s.weight_bytes("bfloat16") == 2 * s.num_parameters < path.stat().st_size * 2
    assert (s.num_hidden_layers, s.num_key_value_heads, s.head_dim, s.max_position_embeddings) == (2, 2, 16, 2048)
    assert modelfiles.served_name(str(path)) == "m"


def test_gguf_problems_are_model_errors_naming_the_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\x09\x00\x00\x00")
    with pytest.raises(ModelError, match="version 9"):
        memory.shape(ModelSpec(source=str(bad)))
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelError, match="cut short"):
        memory.shape(ModelSpec(source=str(bad)))


def test_an_automatic_kv_cache_holds_one_whole_sequence_in_blocks():
    """The engine pages the cache in 16-token blocks: a cache ending inside a block would make it lower
    max_model_len below what the plan promised."""
    assert memory.one_sequence_bytes(10, 1000) == 1008 * 10
    assert memory.auto_kv_cache_bytes(10, 1000, 1, available=10_000) == 1008 * 10  # the floor, in whole blocks
    assert memory.auto_kv_cache_bytes(10, 1000, 4, available=10**9) == 4000 * 10  # every slot, block multiple


def test_malformed_gguf_and_config_values_are_model_errors(tmp_path):
    import struct
    bad = tmp_path / "huge.gguf"  # one metadata array claiming 2**62 strings
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
                    + struct.pack("<IIQ", 9, 8, 2**62))
    with pytest.raises(ModelError, match="corrupt"):
        memory.shape(ModelSpec(source=str(bad)))
    d = tmp_path / "nan"
    d.mkdir()
    (d / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": NaN, '
                                   '"vocab_size": 10}')
    with pytest.raises(ModelError, match="usable 'hidden_size'"):
        memory.shape(ModelSpec(source=str(d)))


def test_served_names(tmp_path, monkeypatch):
    assert modelfiles.served_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert modelfiles.served_name("/models/qwen/") == "qwen" and modelfiles.served_name("/m/x.Q4_1.gguf") == "x.Q4_1"
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert modelfiles.served_name("models/qwen") == "qwen"  # a local directory, though it looks like a hub id


def bf16_model_dir(tmp_path):
    """A bf16 checkpoint (safetensors written by hand: numpy has no bf16), with one matrix whose rows are not whole
    16-row groups and one F16 matrix."""
    d = tmp_path / "bf16"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG | {"vocab_size": 96}))
    tensors = {"embed.weight": ("BF16", [96, 64]), "l0.q.weight": ("BF16", [64, 64]),
               "l0.odd.weight": ("BF16", [100, 64]), "l0.mlp.weight": ("F16", [128, 64]), "l0.q.bias": ("BF16", [64])}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    (d / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(offset))
    return d


def test_a_bf16_checkpoint_under_float32_keeps_its_matrices_in_bf16_where_the_native_kernels_run(tmp_path):
    """memory.held_dtype: the engine's bf16-weight GEMM widens them in registers (engine/kernels/bf16w_linear.cpp);
    1-D tensors, other float types and matrices not in whole 16-row groups are held in the model's dtype."""
    s = memory.shape(ModelSpec(source=str(bf16_model_dir(tmp_path))))
    kept = 96 * 64 + 64 * 64
    rest = 100 * 64 + 128 * 64 + 64
    assert s.weight_bytes("float32", native_fp32=True) == 2 * kept + 4 * rest
    assert s.weight_bytes("float32") == s.weight_bytes("float32", native_fp32=False) == 4 * (kept + rest)
    assert s.weight_bytes("bfloat16", native_fp32=True) == 2 * (kept + rest)
    assert memory.held_dtype("BF16", (96, 64), "float32", True) == "bfloat16"
    assert memory.held_dtype("BF16", (96, 63), "float32", True) == "float32"  # K pairs
    assert memory.held_dtype("Q8_0", (96, 64), "float32", True) == "float32"
