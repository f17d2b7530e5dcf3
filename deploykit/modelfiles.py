"""Where a model is and what it is called, before anything is sized or loaded: what a local model path is (a
Hugging Face directory or one .gguf file, the only two the engine reads), what a servable one lacks, the local
Hugging Face cache (never downloaded from), the name it is served under, and its ModelConfig.

One rule for the planner, `up`, the engine's loader and tokenizer and the server's start-up check: a directory is a
Hugging Face checkpoint, a file named *.gguf is a GGUF model, any other single file is not a model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from . import gguf, modelconfig
from .errors import ModelError

HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DIRECTORY, GGUF, OTHER_FILE = "directory", "gguf", "file"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them makes a directory's tokenizer


def kind(path: str | os.PathLike) -> str | None:
    """What a local model path is: DIRECTORY (a Hugging Face checkpoint), GGUF (one .gguf file), OTHER_FILE (any
    other single file: not a model) or None (nothing there). Symlinks are followed."""
    p = Path(path)
    if p.is_dir():
        return DIRECTORY
    if p.is_file():
        return GGUF if p.suffix == ".gguf" else OTHER_FILE
    return None


def is_gguf(path: str | os.PathLike) -> bool:
    """The model is one .gguf file (its weights, configuration and tokenizer are all in it)."""
    return kind(path) == GGUF


def not_a_model(path: str | os.PathLike) -> str | None:
    """Why a path cannot be a model (nothing there, or a file that is not .gguf), or None."""
    what = kind(path)
    if what is None:
        return f"model {str(path)!r} does not exist; pass a local Hugging Face model directory or a .gguf file"
    if what == OTHER_FILE:
        return f"{path} is a file but not a .gguf file; pass a Hugging Face model directory or a .gguf file"
    return None


def missing(path: str | os.PathLike) -> str | None:
    """What a servable model lacks, or None: a .gguf file carries everything; a directory needs config.json,
    weights and a tokenizer."""
    problem = not_a_model(path)
    if problem or kind(path) == GGUF:
        return problem
    names = set(os.listdir(path))
    lacks = []
    if "config.json" not in names:
        lacks.append("config.json")
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        lacks.append("weights (*.safetensors)")
    if not names & set(TOKENIZER_FILES):
        lacks.append("a tokenizer (tokenizer.json)")
    return f"model directory {path} lacks {', '.join(lacks)}" if lacks else None


def read_config(path: str | os.PathLike) -> modelconfig.ModelConfig:
    """ModelConfig of a local model: a Hugging Face directory's config.json or a .gguf file's header."""
    problem = not_a_model(path)
    if problem:
        raise ModelError(problem)
    if is_gguf(path):
        return modelconfig.from_gguf(gguf.read(path))
    return modelconfig.read_dir(path)


def locate(source: str, revision: str | None = None) -> Path | None:
    """A local model directory or .gguf file, or the HF cache snapshot of a hub id; None if not on this machine.
    A local file that is not a .gguf is a ModelError (it names something, but not a model)."""
    p = Path(source).expanduser()
    what = kind(p)
    if what == OTHER_FILE:
        raise ModelError(not_a_model(p) or "", path="model.source", value=source)
    if what is not None:
        return p
    if p.is_absolute() or source.startswith((".", "~")) or not HF_ID.match(source):
        return None
    repo = hf_cache_dir() / ("models--" + source.replace("/", "--"))
    rev = revision or "main"
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else None
    if commit is None:
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except OSError:
            return None
    snap = repo / "snapshots" / commit
    return snap if (snap / "config.json").is_file() else None


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "huggingface" / "hub"


def served_name(source: str) -> str:
    """A hub id is served under its own name (as vLLM does); a local path (an existing "models/qwen" too) under its
    last component, without .gguf."""
    if source.startswith(("/", ".", "~")) or not HF_ID.match(source) or os.path.exists(source):
        name = source.rstrip("/").rsplit("/", 1)[-1] or source
        return name[:-5] if name.endswith(".gguf") and len(name) > 5 else name
    return source
