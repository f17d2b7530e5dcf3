"""Model sizing without loading the model: parameter count, weight bytes and KV bytes per token.

Reads config.json and the safetensors headers from a local directory or the local Hugging Face cache (never
downloads); falls back to the spec's explicit architecture numbers.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError
from .spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True, slots=True)
class ModelShape:
    source: str
    path: str | None  # local directory holding config.json, None when sized from explicit numbers
    architecture: str
    num_parameters: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int | None
    counted_from: str  # "safetensors", "config.json" or "spec"

    def weight_bytes(self, dtype: str) -> int:
        return self.num_parameters * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        # K and V, every layer: [layers, 2, kv_heads, head_dim] elements per token.
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[dtype]


def locate(source: str, revision: str | None = None) -> Path | None:
    """A local directory with config.json, or the HF cache snapshot of a hub id; None if not on this machine."""
    p = Path(source).expanduser()
    if p.is_dir():
        return p
    if p.is_absolute() or source.startswith((".", "~")) or not _HF_ID.match(source):
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


def shape(spec: ModelSpec) -> ModelShape:
    path = locate(spec.source, spec.revision)
    if path is not None:
        return _from_dir(spec.source, path)
    if spec.architecture is not None:
        a = spec.architecture
        head_dim = a.head_dim or a.hidden_size // a.num_attention_heads  # type: ignore[operator]
        params = a.num_parameters or _count(a.hidden_size, a.intermediate_size, a.vocab_size, a.num_hidden_layers,
                                            a.num_attention_heads or a.hidden_size // head_dim,
                                            a.num_key_value_heads, head_dim, a.tie_word_embeddings)
        return ModelShape(spec.source, None, "explicit", params, a.num_hidden_layers, a.num_key_value_heads,
                          head_dim, a.max_position_embeddings, "spec")
    where = f"the local Hugging Face cache ({hf_cache_dir()})" if _HF_ID.match(spec.source) else "this machine"
    raise ModelError(f"model not found in {where}; deploykit never downloads", path="model.source",
                     value=spec.source,
                     hint="point model.source at a local directory with config.json, download it beforehand "
                          "(e.g. `hf download " + spec.source + "`), or give model.architecture numbers "
                          "(num_hidden_layers, num_key_value_heads, head_dim, num_parameters)")


def _from_dir(source: str, path: Path) -> ModelShape:
    cfg_file = path / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ModelError("config.json missing in the model directory", path=str(path),
                         hint="a Hugging Face model directory has config.json next to its *.safetensors") from None
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read config.json: {e}", path=str(cfg_file)) from None
    if not isinstance(cfg, dict):
        raise ModelError("config.json is not a JSON object", path=str(cfg_file))
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        kv = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        inter = int(text.get("intermediate_size") or text.get("ffn_dim") or 4 * hidden)
        experts = int(text.get("num_local_experts") or text.get("num_experts") or 1)
        vocab = int(text.get("vocab_size") or 32000)
        max_pos = text.get("max_position_embeddings") or text.get("n_positions") or text.get("seq_length")
        max_pos = int(max_pos) if max_pos else None
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelError(f"config.json lacks a usable {e} (need integer num_hidden_layers, num_attention_heads, "
                         "hidden_size)", path=str(cfg_file)) from None
    bad = {k: v for k, v in {"num_hidden_layers": layers, "num_attention_heads": heads, "hidden_size": hidden,
                             "num_key_value_heads": kv, "head_dim": head_dim, "intermediate_size": inter,
                             "vocab_size": vocab, "max_position_embeddings": max_pos or 1}.items() if v < 1}
    if bad:
        raise ModelError(f"config.json has non-positive sizes: {bad}", path=str(cfg_file),
                         hint="a causal LM needs at least one layer, head and hidden unit")
    arch = (cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]
    params = _count_safetensors(path)
    counted = "safetensors"
    if params is None:
        counted = "config.json"
        params = _count(hidden, inter * experts, vocab, layers, heads, kv, head_dim,
                        bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
    return ModelShape(source, str(path), str(arch), params, layers, kv, head_dim, max_pos, counted)


def _count(hidden, inter, vocab, layers, heads, kv, head_dim, tied) -> int:
    attn = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


def _count_safetensors(path: Path) -> int | None:
    """Exact parameter count from safetensors headers (8-byte length + JSON); None if there are none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ModelError(f"cannot read the safetensors index: {e}", path=str(index)) from None
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for name in files:
        f = path / name
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > 100_000_000:
                    raise ValueError("header length is implausible")
                header = json.loads(fh.read(n))
        except FileNotFoundError:
            raise ModelError("a weight file named in the index is missing", path=str(f),
                             hint="re-download or re-save the model; all shards must be present") from None
        except (OSError, ValueError, struct.error) as e:
            raise ModelError(f"not a readable safetensors file: {e}", path=str(f)) from None
        for key, t in header.items():
            if key == "__metadata__" or not isinstance(t, dict):
                continue
            numel = 1
            for d in t.get("shape", []):
                numel *= int(d)
            total += numel
    return total
