"""Block-quantized weights: which tensors the engine keeps quantized and how many bytes each takes in memory.

The one home of this rule for the planner (memory sizing, `deploykit plan`) and the engine (which path each tensor
takes at load), so the two can never disagree. A GGUF tensor of a kept type stays in its blocks, repacked once at
load into the kernels' layout (engine/kernels/quant_layout.h); float weights of any source are quantized on load
when the spec asks for it (`model.quantization: q8_0 | q4_0`). Either needs the native int8 kernels
(isa.quantized_kernels); without them every weight is dequantized to the model's dtype, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

ROW_GROUP = 16  # output rows per group of the layout: a weight's row count must be a multiple of it


@dataclass(frozen=True, slots=True)
class Format:
    name: str         # ggml type name
    units: int        # 32-weight units per chunk of the layout
    chunk_bytes: int  # bytes of one chunk of one 16-row group (quant_layout.h)

    @property
    def k_multiple(self) -> int:
        """A weight's row length must be a multiple of this (one chunk)."""
        return 32 * self.units

    def bytes(self, rows: int, cols: int) -> int:
        return rows // ROW_GROUP * (cols // self.k_multiple) * self.chunk_bytes

    @property
    def bits_per_weight(self) -> float:
        return self.chunk_bytes * 8 / (ROW_GROUP * self.k_multiple)


KEPT = {f.name: f for f in (Format("Q8_0", 2, 1088), Format("Q4_0", 2, 576), Format("Q4_1", 2, 640),
                            Format("Q5_0", 2, 704), Format("Q5_1", 2, 768), Format("Q4_K", 8, 2368),
                            Format("Q5_K", 8, 2880), Format("Q6_K", 8, 3392))}
# model.quantization: "none" keeps a .gguf's quantized tensors in their blocks and float weights in the model's
# dtype; q8_0 / q4_0 also quantize the float matrices on load; "dequantize" holds every weight in the model's dtype
# (the exact fp32/bf16 path: more memory and bytes per token, no int8 activations).
ON_LOAD = ("none", "q8_0", "q4_0", "dequantize")
FLOAT_TYPES = ("F32", "F16", "BF16")


def fits(fmt: str, shape: tuple[int, ...]) -> bool:
    """Whether a matrix of this shape can be held in `fmt` (ggml type name): 2-D, whole 16-row groups, whole chunks."""
    f = KEPT.get(fmt)
    return (f is not None and len(shape) == 2 and shape[0] % ROW_GROUP == 0 and shape[1] % f.k_multiple == 0)


def held_as(type_name: str, shape: tuple[int, ...], on_load: str, native: bool) -> str | None:
    """The quantized format the engine holds a weight in, or None when it holds it dequantized in the model's
    dtype. type_name: the tensor's ggml type (a float type for safetensors); on_load: model.quantization; native:
    isa.quantized_kernels of the CPU it runs on. Only matrices are quantized (norms and biases never)."""
    if not native or on_load == "dequantize" or len(shape) != 2:
        return None
    if type_name in KEPT:
        return type_name if fits(type_name, shape) else None
    if type_name in FLOAT_TYPES and on_load != "none" and fits(on_load.upper(), shape):
        return on_load.upper()
    return None
