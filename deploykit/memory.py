"""How big a model gets, without loading it: its parameter count, weight and KV bytes, the dtype it runs in, and
how large an automatic KV cache is. Shared by the planner and the engine.

Counts from the model deploykit.modelfiles finds (safetensors headers, config.json, a .gguf file's header); falls
back to the spec's explicit architecture numbers.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from . import gguf, modelconfig, modelfiles, quant
from .errors import ModelError
from .spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What users may write for a dtype (CLI flags, the spec) -> its canonical name.
DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
KV_BLOCK_TOKENS = 16  # tokens per KV cache block: the engine's paging unit; auto-sized caches are whole blocks


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the planner needs to know about a model."""

    source: str
    path: str | None  # local directory or .gguf file; None when sized from the spec's numbers
    architecture: str
    num_parameters: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int | None
    counted_from: str  # "safetensors", "gguf", "config.json" or "spec"
    # (type, shape) of every weight where the files were read: the ggml type name of a GGUF tensor, or F32 / F16 /
    # BF16 of a safetensors one. Empty when sized from config.json or the spec's numbers.
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def weight_bytes(self, dtype: str, quantization: str = "none", native_quant: bool = False,
                     native_fp32: bool = False) -> int:
        """Bytes of weights the engine holds: each matrix quantized where deploykit.quant says it stays (or becomes)
        quantized, the rest in held_dtype. native_quant: the CPU runs the int8 kernels (isa.quantized_kernels);
        native_fp32: it runs a native kernel build at all (isa.fp32_kernels)."""
        if not self.tensors:  # the checkpoint's dtypes are unknown: every weight in `dtype`
            if native_quant and quantization in ("q8_0", "q4_0"):
                return math.ceil(self.num_parameters * quant.KEPT[quantization.upper()].bits_per_weight / 8)
            return self.num_parameters * DTYPE_BYTES[dtype]
        total = 0
        for type_name, dims in self.tensors:
            fmt = quant.held_as(type_name, dims, quantization, native_quant)
            total += quant.KEPT[fmt].bytes(*dims) if fmt else \
                math.prod(dims) * DTYPE_BYTES[held_dtype(type_name, dims, dtype, native_fp32)]
        return total

    def held_formats(self, quantization: str = "none", native_quant: bool = False) -> tuple[str, ...]:
        """The quantized formats the engine holds weights in (empty: all in the model's dtype)."""
        return tuple(sorted({f for t, d in self.tensors if (f := quant.held_as(t, d, quantization, native_quant))}))

    def kv_bytes_per_token(self, dtype: str) -> int:
        elements = modelconfig.kv_elements_per_token(self.num_hidden_layers, self.num_key_value_heads, self.head_dim)
        return kv_bytes_per_token(elements, dtype)


def kv_bytes_per_token(kv_elements_per_token: int, dtype: str) -> int:
    """Bytes of K+V cache one token takes across all layers (ModelConfig.kv_elements_per_token elements)."""
    return kv_elements_per_token * DTYPE_BYTES[dtype]


def canonical_dtype(name: str) -> str:
    try:
        return DTYPE_NAMES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}") from None


def resolve_dtype(requested: str, has_bf16: bool) -> tuple[str, tuple[str, ...]]:
    """The dtype weights and KV run in, and notes on why. auto: bfloat16 where the CPU computes it natively
    (AVX512-BF16 or AMX), else float32; float16 runs as bfloat16 (same size, wider range; the kernels are bf16)."""
    name = canonical_dtype(requested)
    if name == "float16":
        return "bfloat16", ("model.dtype float16 runs as bfloat16 (same size, wider range; CPU kernels are bf16)",)
    if name == "auto":
        return ("bfloat16" if has_bf16 else "float32"), ()
    return name, ()


# The packed layout the bf16-weight GEMM reads holds 16 output rows a line (engine/kernels/bf16w_linear.cpp COLS).
WIDEN_ROWS = 16


def held_dtype(type_name: str, shape: tuple[int, ...], dtype: str, native: bool) -> str:
    """The dtype the engine holds a float weight in: `dtype`, except a bf16 checkpoint's matrices when the model runs
    in float32 on a CPU with a native kernel build (native: isa.fp32_kernels). Those stay in bf16, the same values,
    widened to fp32 in registers by the GEMM (engine/kernels/bf16w_linear.cpp): half the bytes of holding them
    widened, to hold and to read per token. type_name: F32 / F16 / BF16 (or a GGUF tensor's ggml type)."""
    if (native and dtype == "float32" and type_name == "BF16" and len(shape) == 2 and shape[0] % WIDEN_ROWS == 0
            and shape[1] % 2 == 0):
        return "bfloat16"
    return dtype


def auto_kv_cache_bytes(per_token: int, max_model_len: int, max_num_seqs: int, available: int, *,
                        at_least_one_sequence: bool = True) -> int:
    """An automatic KV cache: room for every sequence slot at full length, capped by `available` bytes and
    rounded down to whole blocks; never below one max_model_len sequence (the planner has checked it fits) or,
    without that guarantee, one block."""
    block = per_token * KV_BLOCK_TOKENS
    kv = min(per_token * max_model_len * max_num_seqs, available) // block * block
    return max(one_sequence_bytes(per_token, max_model_len) if at_least_one_sequence else block, kv)


def one_sequence_bytes(per_token: int, max_model_len: int) -> int:
    """KV bytes of one max_model_len sequence in whole blocks (the engine pages the cache in blocks: a cache that
    ends inside a block would make it lower max_model_len)."""
    return -(-max_model_len // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS * per_token


def shape(spec: ModelSpec) -> ModelShape:
    path = modelfiles.locate(spec.source, spec.revision)
    if path is not None:
        return _from_local(spec.source, path)
    if spec.architecture is not None:
        a = spec.architecture
        head_dim = a.head_dim or a.hidden_size // a.num_attention_heads  # type: ignore[operator]
        params = a.num_parameters
        if params is None:
            params = modelconfig.ModelConfig(
                source=spec.source, architecture="explicit", model_type="", vocab_size=a.vocab_size,
                hidden_size=a.hidden_size, num_layers=a.num_hidden_layers,
                num_heads=a.num_attention_heads or a.hidden_size // head_dim, num_kv_heads=a.num_key_value_heads,
                head_dim=head_dim, intermediate_size=a.intermediate_size, max_position_embeddings=None,
                tie_word_embeddings=a.tie_word_embeddings).count_parameters()
        return ModelShape(spec.source, None, "explicit", params, a.num_hidden_layers, a.num_key_value_heads,
                          head_dim, a.max_position_embeddings, "spec")
    where = (f"the local Hugging Face cache ({modelfiles.hf_cache_dir()})" if modelfiles.HF_ID.match(spec.source)
             else "this machine")
    raise ModelError(f"model not found in {where}; deploykit never downloads", path="model.source",
                     value=spec.source,
                     hint="point model.source at a local directory with config.json or a .gguf file, download it "
                          "beforehand (e.g. `hf download " + spec.source + "`), or give model.architecture numbers "
                          "(num_hidden_layers, num_key_value_heads, head_dim, num_parameters)")


def _from_local(source: str, path: Path) -> ModelShape:
    cfg = modelfiles.read_config(path)
    if modelfiles.is_gguf(path):
        header = gguf.read(path)
        params, counted = modelconfig.parameters_in(header), "gguf"
        tensors = tuple((t.type_name, t.shape) for t in header.tensors if t.name != "rope_freqs.weight")
    else:
        tensors = _safetensors_tensors(path)
        params, counted = (sum(math.prod(d) for _, d in tensors), "safetensors") if tensors is not None else (None, "")
        if params is None:
            params, counted, tensors = cfg.count_parameters(), "config.json", ()
    return ModelShape(source, str(path), cfg.architecture, params, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                      cfg.max_position_embeddings, counted, tensors)


# safetensors dtype names -> the float type names deploykit.quant uses (others count as F32-sized weights).
_SAFETENSORS_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


def _safetensors_tensors(path: Path) -> tuple[tuple[str, tuple[int, ...]], ...] | None:
    """(type, shape) of every tensor in the safetensors headers (8-byte length + JSON); None if there are none."""
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
    out = []
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
            out.append((_SAFETENSORS_TYPES.get(str(t.get("dtype")), "F32"), tuple(int(d) for d in t.get("shape", []))))
    return tuple(out)
