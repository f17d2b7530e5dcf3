"""`python -m engine tiny-model` is deterministic and `python -m engine generate` serves what it wrote."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from engine.__main__ import main


def _digest(d):
    with open(os.path.join(d, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.slow
def test_tiny_model_is_deterministic_per_seed(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    assert main(["tiny-model", a, "--arch", "qwen3", "--seed", "7"]) == 0
    assert main(["tiny-model", b, "--arch", "qwen3", "--seed", "7"]) == 0
    assert main(["tiny-model", c, "--arch", "qwen3", "--seed", "8"]) == 0
    assert _digest(a) == _digest(b) != _digest(c)
    with open(os.path.join(a, "tokenizer.json")) as fa, open(os.path.join(b, "tokenizer.json")) as fb:
        assert fa.read() == fb.read()
    assert os.path.exists(os.path.join(a, "chat_template.jinja"))


@pytest.mark.slow
def test_generate_command_prints_completions(tiny_model):
    out = subprocess.run([sys.executable, "-m", "engine", "generate", tiny_model("llama"), "Hello", "Café",
                          "--max-tokens", "5", "--dtype", "float32"], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("'Hello' -> ") and "[length, 5 tokens]" in lines[0]


def test_a_bad_model_dir_exits_3_from_every_command(tmp_path, capsys):
    """One error family, one exit-code table: a model that cannot load is 3 for generate and serve alike."""
    assert main(["generate", str(tmp_path / "missing"), "hi"]) == 3
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing"), "--port", "0", "--host", "127.0.0.1"]) == 3
    assert main(["serve", str(tmp_path), "--max-num-seqs", "0"]) == 2  # a usage error stays 2
