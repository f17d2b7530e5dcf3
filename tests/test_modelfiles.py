"""What a model path is (deploykit.modelfiles.kind): one rule, and what every caller then does with a directory of
safetensors, a .gguf file, a single file that is not a .gguf, a directory named *.gguf, and nothing at all."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from deploykit import memory, modelfiles
from deploykit.errors import ModelError
from deploykit.spec import ModelSpec
from tests.render.cases import write_tiny_gguf
from tests.test_memory import CONFIG

# The spec's architecture numbers: with them, a model that is not on this machine is sized from the spec.
ARCH = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16, "num_parameters": 1000}


def hf_dir(path, tokenizer=True):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file({"embed.weight": np.zeros((100, 64), np.float32)}, path / "model.safetensors")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def test_a_directory_is_a_hugging_face_checkpoint_everywhere(tmp_path):
    d = hf_dir(tmp_path / "qwen")
    assert modelfiles.kind(d) == modelfiles.DIRECTORY and not modelfiles.is_gguf(d)
    assert modelfiles.missing(d) is None  # servable: config.json, weights and a tokenizer
    assert modelfiles.read_config(d).source == str(d)
    s = memory.shape(ModelSpec(source=str(d)))
    assert (s.path, s.counted_from, s.num_parameters) == (str(d), "safetensors", 100 * 64)
    assert modelfiles.served_name(str(d)) == "qwen"
    (d / "tokenizer.json").unlink()
    assert modelfiles.missing(d) == f"model directory {d} lacks a tokenizer (tokenizer.json)"


def test_a_directory_named_like_a_gguf_file_is_still_a_directory(tmp_path):
    """The name alone never makes a GGUF: the planner once read such a directory as a GGUF header."""
    d = hf_dir(tmp_path / "model.gguf")
    assert modelfiles.kind(d) == modelfiles.DIRECTORY and not modelfiles.is_gguf(d)
    assert modelfiles.read_config(d).architecture == "Qwen2ForCausalLM"
    assert memory.shape(ModelSpec(source=str(d))).counted_from == "safetensors"


def test_a_gguf_file_carries_everything(tmp_path):
    f = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf")
    assert modelfiles.kind(f) == modelfiles.GGUF and modelfiles.is_gguf(f)
    assert modelfiles.missing(f) is None  # weights, configuration and tokenizer are all in the file
    assert modelfiles.read_config(f).model_type == "qwen2"
    s = memory.shape(ModelSpec(source=str(f)))
    assert (s.path, s.counted_from) == (str(f), "gguf")
    assert modelfiles.served_name(str(f)) == "tiny.Q8_0"


@pytest.mark.parametrize("architecture", [None, ARCH])
def test_a_single_file_that_is_not_a_gguf_is_refused_by_every_caller(tmp_path, architecture):
    f = tmp_path / "model.safetensors"
    save_file({"w": np.zeros((2, 2), np.float32)}, f)
    said = f"{f} is a file but not a .gguf file; pass a Hugging Face model directory or a .gguf file"
    assert modelfiles.kind(f) == modelfiles.OTHER_FILE and not modelfiles.is_gguf(f)
    assert modelfiles.missing(f) == said  # the server's start-up check
    with pytest.raises(ModelError) as e:  # the engine's loader (re-raised as its ModelLoadError)
        modelfiles.read_config(f)
    assert str(e.value) == said
    with pytest.raises(ModelError) as e:  # the planner, even when the spec gives numbers to size from
        memory.shape(ModelSpec(source=str(f), architecture=architecture))
    assert e.value.problems[0].path == "model.source" and "not a .gguf file" in str(e.value)


def test_nothing_there(tmp_path):
    gone = tmp_path / "gone"
    assert modelfiles.kind(gone) is None and not modelfiles.is_gguf(gone)
    assert "does not exist" in modelfiles.missing(gone)
    with pytest.raises(ModelError, match="does not exist"):
        modelfiles.read_config(gone)
    with pytest.raises(ModelError, match="never downloads"):
        memory.shape(ModelSpec(source=str(gone)))
    assert memory.shape(ModelSpec(source=str(gone), architecture=ARCH)).counted_from == "spec"
