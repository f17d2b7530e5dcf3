"""The Python face of the block-quantized weights' ops (kernels/quant_*.h, qlinear.cpp): which matrices are such
blobs, packing GGUF blocks into the kernels' layout, a blob's parts, embedding rows, and how the int8 GEMV streams
weights. engine.kernels binds the library and re-exports these."""

from __future__ import annotations

import torch

_qops = None  # the loaded library's ops (any build), or None
_QUANT = False  # whether the int8 kernels run here (engine.kernels._QUANT)


def bind(qops, quant: bool) -> None:
    global _qops, _QUANT
    _qops, _QUANT = qops, quant


def is_quantized(w: torch.Tensor) -> bool:
    """A packed quantized matrix is a 1-D uint8 blob (kernels/quant_layout.h)."""
    return w.dtype == torch.uint8 and w.dim() == 1


def quant_pack(raws: list[torch.Tensor], formats: list[int], k: int, interleave: bool = False,
               segment_k: int = -1) -> torch.Tensor:
    """GGUF blocks of each row part [rows, bytes] (uint8) in ggml type `formats[i]` -> one quantized matrix blob.
    interleave: two parts of one format and size, stored group by group; segment_k: K cut into segments of that many
    weights, panel by panel (a multiple of 256; 0: not; -1: where the kernels here read it faster); both
    kernels/quant_layout.h. Every product is the same whatever the layout."""
    return _qops.quant_pack(raws, formats, k, interleave, segment_k)


def quant_segments(blob: torch.Tensor) -> tuple[int, int]:
    """(segment_k, panel) of a quantized matrix: (0, 0) where it is not segmented (kernels/quant_layout.h)."""
    seg_k, panel = _qops.quant_segments(blob)
    return int(seg_k), int(panel)


def quant_parts(blob: torch.Tensor) -> list[int]:
    """[N, K, interleaved (0 or 1), format, rows, format, rows, ...] of a quantized matrix."""
    return list(_qops.quant_parts(blob))


def quant_rows(blob: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [n] of a quantized matrix, dequantized -> [n, K] (an embedding lookup)."""
    return _qops.quant_rows(blob, ids, dtype)


def quant_stream_ahead() -> dict[str, int] | None:
    """How far ahead the quantized GEMV streams each format's weights, in bytes (0: not at all; kernels/quant_gemv.h);
    None where the int8 kernels do not run."""
    if not _QUANT:
        return None
    from engine.quant import GGML_IDS  # engine.quant imports this module
    return {name: int(_qops.quant_stream_ahead(i)) for name, i in GGML_IDS.items()}


def quant_stream_hint() -> str | None:
    """Where those requests put the lines: "l2" (PREFETCHT1, the default on Intel CPUs) or "nta" (on AMD's;
    kernels/quant_stream.h); None where the int8 kernels do not run."""
    return str(_qops.quant_stream_hint()) if _QUANT else None
