"""The header of a GGUF file (llama.cpp's format): metadata and where each tensor lies, read without numpy or torch.

The planner sizes a GGUF model from this alone; the engine maps the same tensor table to Hugging Face names and
dequantizes the data (engine/gguf_weights.py). Layout (GGUF v2/v3, little endian): magic "GGUF", version u32,
tensor count u64, metadata count u64, the metadata key/values, one info per tensor (name, dims in ggml order,
ggml type, offset), padding to `general.alignment`, then the tensor data.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Arrays longer than this (token lists, merges) are not decoded: the header keeps their type and length only.
# Tokenizer conversion reads them with transformers, which has its own reader.
MAX_ARRAY = 4096

# ggml type id -> (name, elements per block, bytes per block). Only the types a weight can have.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}

# Metadata value types: fixed-size ones by struct format; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class LongArray:
    """An array in the metadata too long to decode here (e.g. tokenizer.ggml.tokens)."""

    value_type: int
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (rows first): the reverse of GGUF's ggml dims
    ggml_type: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type {self.ggml_type}",))[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        _, block, size = GGML_TYPES[self.ggml_type]
        return self.numel // block * size


@dataclass(frozen=True, slots=True)
class Header:
    path: str
    version: int
    metadata: dict  # key -> int | float | bool | str | list | LongArray
    tensors: tuple[TensorInfo, ...]
    data_offset: int  # file offset of the tensor data section

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: object = None) -> object:
        """`{architecture}.{key}`, e.g. arch_value("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> TensorInfo | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None

    @property
    def num_parameters(self) -> int:
        return sum(t.numel for t in self.tensors)

    def read_f32(self, info: TensorInfo) -> tuple[float, ...]:
        """The values of a small F32 tensor (e.g. rope_freqs), read straight from the file."""
        if info.ggml_type != 0:
            raise ModelError(f"tensor {info.name} is {info.type_name}, expected F32", path=self.path)
        with open(self.path, "rb") as f:
            f.seek(self.data_offset + info.offset)
            data = f.read(4 * info.numel)
        if len(data) != 4 * info.numel:
            raise ModelError(f"the file ends inside tensor {info.name}: truncated download?", path=self.path)
        return struct.unpack(f"<{info.numel}f", data)


def read(path: str | Path) -> Header:
    """Parse the header of a GGUF file. Raises ModelError (with the path) for anything that is not a sound GGUF."""
    p = str(path)
    try:
        size = Path(p).stat().st_size
        with open(p, "rb") as f:
            return _parse(_Cursor(f, p, size), p, size)
    except FileNotFoundError:
        raise ModelError("the GGUF file does not exist", path=p) from None
    except IsADirectoryError:
        raise ModelError("expected a .gguf file, found a directory", path=p) from None
    except OSError as e:
        raise ModelError(f"cannot read the GGUF file: {e.strerror or e}", path=p) from None


def _parse(c: _Cursor, path: str, size: int) -> Header:
    if c.read(4) != MAGIC:
        raise ModelError("not a GGUF file (the first bytes are not 'GGUF')", path=path,
                         hint="pass a .gguf file as written by llama.cpp's convert_hf_to_gguf.py / llama-quantize")
    version = c.unpack("<I")
    if version not in VERSIONS:
        raise ModelError(f"GGUF version {version} is not supported", path=path, allowed="2, 3",
                         hint="re-convert the model with a current llama.cpp")
    n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise ModelError(f"implausible GGUF header ({n_tensors} tensors, {n_kv} metadata keys): corrupt file?",
                         path=path)
    metadata: dict = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.unpack("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.unpack("<I")
        if n_dims > 8:
            raise ModelError(f"tensor {name!r} claims {n_dims} dimensions: corrupt file?", path=path)
        dims = [c.unpack("<Q") for _ in range(n_dims)]
        ggml_type, offset = c.unpack("<I"), c.unpack("<Q")
        tensors.append(TensorInfo(name, tuple(reversed(dims)), ggml_type, offset))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise ModelError(f"general.alignment is {align!r}", path=path)
    data_offset = -(-c.pos // align) * align
    header = Header(path, version, metadata, tuple(tensors), data_offset)
    for t in header.tensors:
        if t.ggml_type in GGML_TYPES and data_offset + t.offset + t.nbytes > size:
            raise ModelError(f"the file ends before tensor {t.name} does ({size} bytes): truncated download?",
                             path=path, hint="download the file again")
    return header


class _Cursor:
    """Sequential reads with one clear error for a header cut short."""

    def __init__(self, f, path: str, size: int):
        self.f, self.path, self.pos, self.size = f, path, 0, size

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ModelError("the GGUF header is cut short: truncated or not a GGUF file", path=self.path)
        self.pos += n
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 24:
            raise ModelError(f"a {n}-byte string in the GGUF header: corrupt file?", path=self.path)
        return self.read(n).decode("utf-8", errors="replace")

    def _seek(self, n: int) -> None:
        if self.pos + n > self.size:  # a corrupt length: seek would go past the end (or overflow)
            raise ModelError("the GGUF header is cut short: truncated or not a GGUF file", path=self.path)
        self.f.seek(n, 1)
        self.pos += n

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if count > self.size:  # every element takes at least a byte
                raise ModelError(f"a GGUF array claims {count} elements: corrupt file?", path=self.path)
            if count > MAX_ARRAY:
                self._skip(etype, count)
                return LongArray(etype, count)
            return [self.value(etype) for _ in range(count)]
        raise ModelError(f"unknown GGUF metadata type {vtype}: corrupt file or a newer GGUF version", path=self.path)

    def _skip(self, etype: int, count: int) -> None:
        if etype in _SCALARS:
            self._seek(struct.calcsize(_SCALARS[etype]) * count)
        elif etype == _STRING:
            for _ in range(count):
                self._seek(self.unpack("<Q"))
        else:  # arrays of arrays: walk them
            for _ in range(count):
                self.value(etype)
