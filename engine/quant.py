"""Block-quantized weights at load: GGUF blocks kept as they are (or float weights quantized on load to Q8_0/Q4_0,
exactly as llama.cpp's reference quantizer does), packed once into the int8 kernels' layout
(engine/kernels/quant_layout.h). Which weight stays quantized is decided by deploykit.quant, the rule the planner
sizes memory with; `WeightPaths` records what happened to each tensor type for the start-up log and /debug/binding.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from deploykit import memory
from deploykit import quant as rule
from engine import kernels

GGML_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
GGML_NAMES = {v: k for k, v in GGML_IDS.items()}
FILE_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
              "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}  # weights and bytes per block in a GGUF file


def native() -> bool:
    """The int8 kernels run here: the native library is loaded and the CPU has AVX512-VNNI."""
    return kernels.quantized_ok()


@dataclass(frozen=True, slots=True)
class Raw:
    """A matrix's GGUF blocks as the file holds them: uint8 [rows, K / block * block_bytes]."""
    type_name: str
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def cols(self) -> int:
        block, size = FILE_BLOCK[self.type_name]
        return self.data.shape[1] // size * block


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), as ggml's reference quantizer rounds."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize(w: torch.Tensor, fmt: str) -> Raw:
    """A float matrix [N, K] -> GGUF Q8_0 or Q4_0 blocks, bit for bit what ggml's quantize_row_q8_0_ref /
    quantize_row_q4_0_ref write (the tests compare with the gguf package's quantizer)."""
    n, k = w.shape
    x = w.detach().float().reshape(n, k // 32, 32)
    if fmt == "Q8_0":
        d = x.abs().amax(-1) / 127                                            # [N, B]
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = _round_away(x * inv[..., None]).to(torch.int8)                    # [N, B, 32]
        blocks = torch.cat([d.half().view(torch.uint8).view(n, k // 32, 2), q.view(torch.uint8)], -1)
    elif fmt == "Q4_0":
        idx = x.abs().argmax(-1, keepdim=True)
        d = torch.gather(x, -1, idx)[..., 0] / -8                             # signed: the largest magnitude is -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = torch.clamp(torch.floor(x * inv[..., None] + 8.5), max=15).to(torch.uint8)
        nib = q[..., :16] | (q[..., 16:] << 4)                                # weight j low, j + 16 high
        blocks = torch.cat([d.half().view(torch.uint8).view(n, k // 32, 2), nib], -1)
    else:
        raise ValueError(f"quantize on load supports Q8_0 and Q4_0, not {fmt}")
    return Raw(fmt, blocks.reshape(n, -1).contiguous())


# The weights of a segment of K in the blobs pack() makes (kernels/quant_layout.h), or -1: the kernels choose
# (segments where a 16-row group outgrows the L1 cache, on CPUs whose quantized matmuls are not on AMX tiles). The
# tests set it to run the segmented layout through models too small to get it.
SEGMENT_K = -1


def pack(parts: list[Raw], interleave: bool = False) -> torch.Tensor:
    """Row parts of one matrix (e.g. q, k, v) -> its blob; consecutive parts of one format are merged first.
    interleave: a gate and an up half of one format and size are stored 16-row group by group instead, so that the
    fused decode step, which takes gate block j with up block j, reads one stream (kernels/quant_layout.h)."""
    if (interleave and len(parts) == 2 and parts[0].type_name == parts[1].type_name
            and parts[0].data.shape == parts[1].data.shape):
        return kernels.quant_pack([p.data.contiguous() for p in parts], [GGML_IDS[parts[0].type_name]] * 2,
                                  parts[0].cols, True, SEGMENT_K)
    merged: list[Raw] = []
    for p in parts:
        if merged and merged[-1].type_name == p.type_name:
            merged[-1] = Raw(p.type_name, torch.cat([merged[-1].data, p.data]))
        else:
            merged.append(p)
    return kernels.quant_pack([p.data.contiguous() for p in merged], [GGML_IDS[p.type_name] for p in merged],
                              parts[0].cols, False, SEGMENT_K)


def describe(blob: torch.Tensor) -> list[tuple[str, int]]:
    """(format, rows) of each part of a packed matrix."""
    v = kernels.quant_parts(blob)
    return [(GGML_NAMES[v[i]], v[i + 1]) for i in range(3, len(v), 2)]


def interleaved(blob: torch.Tensor) -> bool:
    """Whether a packed matrix holds its two halves group by group (pack(interleave=True))."""
    return bool(kernels.quant_parts(blob)[2])


class WeightPaths:
    """Which path each tensor took at load, by the type it had in the file: kept quantized, quantized on load, or
    held in the model's dtype (the start-up log and /debug/binding show it)."""

    def __init__(self):
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bytes = 0

    def add(self, type_name: str, path: str, nbytes: int) -> None:
        self.counts[(type_name, path)] += 1
        self.bytes += nbytes

    def summary(self) -> dict[str, dict[str, int]]:
        """{type in the file: {path: tensors}}, e.g. {"Q4_K": {"quantized Q4_K": 24}, "F32": {"bfloat16": 49}}."""
        out: dict[str, dict[str, int]] = {}
        for (t, path), n in sorted(self.counts.items()):
            out.setdefault(t, {})[path] = n
        return out

    def text(self) -> str:
        return "; ".join(f"{t}: " + ", ".join(f"{n} {p}" for p, n in paths.items())
                         for t, paths in self.summary().items())


class Loader:
    """Loads each matrix of a checkpoint as deploykit.quant says the engine holds it: one quantized blob for a group
    of row parts (q, k, v), or None when it is held in the model's dtype (the caller then dequantizes it)."""

    def __init__(self, reader, dtype: torch.dtype, on_load: str):
        self.reader = reader
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.on_load = on_load
        self.native = native()
        self.widen = kernels.bf16w_ok()
        self.paths = WeightPaths()

    def matrix(self, names: list[str], interleave: bool = False) -> torch.Tensor | None:
        if not self.native:
            return None
        plan = []
        for n in names:
            type_name, shape = self.reader.info(n)
            fmt = rule.held_as(type_name, shape, self.on_load, True)
            if fmt is None:
                return None  # one part in the model's dtype: the whole group is
            plan.append((n, type_name, fmt, shape))
        raws = []
        for n, type_name, fmt, shape in plan:
            raws.append(self.reader.raw(n) if type_name == fmt else quantize(self.reader.get(n), fmt))
            self.paths.add(type_name, f"quantized {fmt}" if type_name == fmt else f"quantized on load to {fmt}",
                           rule.KEPT[fmt].bytes(*shape))
        return pack(raws, interleave)

    def widens(self, names: list[str]) -> bool:
        """Whether matrices `names` (not held quantized) stay in bf16 under the model's fp32, for linear_bf16w to
        widen in registers (deploykit.memory.held_dtype)."""
        return self.dtype_name == "float32" and all(
            memory.held_dtype(*self.reader.info(n), self.dtype_name, self.widen) == "bfloat16" for n in names)

    def widened(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Record a tensor held in bf16 under fp32 compute (see widens)."""
        type_name, _ = self.reader.info(name)
        self.paths.add(type_name, "bfloat16, widened to float32 in registers", tensor.numel() * tensor.element_size())
        return tensor

    def estimate(self) -> int:
        """At least the bytes of weights the model will hold, from the checkpoint's tensor table before any is read,
        so hugepages.Arena reserves one mapping (address space; untouched pages cost nothing). Quantized bytes where
        deploykit.quant keeps a matrix quantized, the model's dtype otherwise (compact bf16 is smaller), 1-D tensors
        at 4 bytes (biases become fp32); 4 KiB a tensor for a packed blob's header and the arena's 64-byte rounding;
        and slack for what the model derives (Qwen3's q/k norm, one row per head)."""
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype_name)).element_size()
        total = 0
        for n in self.reader.names():
            type_name, shape = self.reader.info(n)
            fmt = rule.held_as(type_name, shape, self.on_load, self.native)
            if fmt:
                total += rule.KEPT[fmt].bytes(*shape)
            elif memory.held_dtype(type_name, shape, self.dtype_name, self.widen) == "bfloat16":
                total += math.prod(shape) * 2
            else:
                total += math.prod(shape) * (itemsize if len(shape) > 1 else max(itemsize, 4))
            total += 4096
        return total + total // 64 + (8 << 20)

    def compacted(self, names: list[str], dense_bytes: int, held_bytes: int) -> None:
        """Tensors `names`, recorded by `dense`, are held as one compact bf16 matrix of `held_bytes`."""
        for n in names:
            type_name, _ = self.reader.info(n)
            self.paths.counts[(type_name, self.dtype_name)] -= 1
            self.paths.counts[(type_name, f"{self.dtype_name} compact (12-bit, lossless)")] += 1
        self.paths.counts += Counter()  # drops the paths no tensor took any more
        self.paths.bytes += held_bytes - dense_bytes

    def dense(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Record a tensor held in the model's dtype (its type in the file, dequantized or as is)."""
        type_name, _ = self.reader.info(name)
        self.paths.add(type_name, self.dtype_name, tensor.numel() * tensor.element_size())
        return tensor
