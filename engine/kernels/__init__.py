"""Public matmul entry point for the engine: native AVX-512 (BF16 / AMX where the CPU has them) kernels when built,
pure PyTorch otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deploykit import isa
from deploykit.memory import WIDEN_ROWS
from engine.kernels import attention, loader, quant_ops, step, streaming
# The quantized-weight helpers, re-exported (bound to this library below).
from engine.kernels.quant_ops import (is_quantized, quant_pack, quant_parts, quant_rows, quant_segments,
                                      quant_stream_ahead, quant_stream_hint)
# The element-wise ops' PyTorch references (tests compare the native ops with them), re-exported here.
from engine.kernels.reference import (fallback_add_rms_norm, fallback_head_rms_norm_, fallback_rotary_,  # noqa: F401
                                      fallback_silu_mul)

__all__ = ["LIMITS", "PACK_COLS", "add_rms_norm", "argmax", "bf16w_ok", "compact_info", "compact_rows",
           "compact_unpack", "decode_attention", "decode_attention_supported", "decode_step_", "decode_step_supported",
           "step_f32_weight", "fused", "head_rms_norm_", "is_compact", "is_quantized", "linear", "logits",
           "prefill_attention", "prefill_attention_supported", "prepare_bf16w", "prepare_bias", "prepare_weight",
           "quant_pack", "quant_parts", "quant_rows", "quant_segments", "quantized_ok", "rotary_", "silu_mul", "status",
           "tune_streams"]

_NATIVE = loader.load()
# _ops: the AVX-512 library's every op; _qops: the ops the AVX2 build has as well, for quantized or bf16 weights under
# fp32 activations (a CPU without AVX-512 runs fp32 weights and every bf16-activation op on PyTorch).
_ops = torch.ops.deploykit if _NATIVE.full else None
_qops = torch.ops.deploykit if _NATIVE.loaded else None
_BF16 = torch.bfloat16
_F32 = torch.float32
_U8 = torch.uint8
_I8 = torch.int8
# Block-quantized weights (engine/quant.py) run on the int8 kernels: the library has them and the CPU runs them
# (AVX512-VNNI in an AVX-512 build, AVX2 in the AVX2 one).
_QUANT = _qops is not None and isa.quantized_kernels(isa.cpu_flags())
quant_ops.bind(_qops, _QUANT)

# Measured with benchmarks/kernels.py on Sapphire Rapids (2 cores): vdpbf16ps GEMV streams at
# the memory roofline up to M≈4, past that it turns compute-bound and AMX tiles win at every M.
AMX_MIN_M = 5
_amx_min_m = AMX_MIN_M if _NATIVE.amx else 1 << 62
# Plain [N, K] weights (cannot be packed, e.g. an lm_head tied to the embedding): the row-dot kernel
# at M=1, AMX with W as the A operand for small batches, oneDNN beyond. Without BF16 hardware oneDNN's
# bf16 matmul is ~3x slower than the row-dot kernel at every M (benchmarks/kernels.py: 2.8 vs 8.1 GB/s
# at M=16), so the widening build keeps the rows kernel throughout.
ROWS_MAX_M = 1
PLAIN_AMX_MAX_M = 64
_rows_max_m = 1 << 62 if _NATIVE.variant == "avx512" else 4


if _ops is not None:  # resolved once: the OpOverloadPacket lookup costs microseconds per call
    _rows = _ops.linear_rows.default
    _avx512_packed = _ops.linear_packed_avx512.default
    _amx_packed = _ops.linear_packed_amx.default
    _amx_plain = _ops.linear_plain_amx.default
    _add_rms_norm = _ops.add_rms_norm.default
    _silu_mul = _ops.silu_mul.default
    _rotary = _ops.rotary_.default
    _head_rms_norm = _ops.head_rms_norm_.default
    _compact_linear = _ops.compact_linear.default
    _gate_up_silu = _ops.compact_gate_up_silu_amx.default
    _compact_unpack = _ops.compact_unpack.default
if _qops is not None:
    _quant_linear = _qops.quant_linear.default
    # fp32 element-wise ops (f32_ops.cpp, AVX2 + FMA): in every build.
    _add_rms_norm_f32 = _qops.add_rms_norm_f32.default
    _silu_mul_f32 = _qops.silu_mul_f32.default
    _rotary_f32 = _qops.rotary_f32_.default
    _head_rms_norm_f32 = _qops.head_rms_norm_f32_.default
    # fp32 activations times bf16 weights widened in registers (bf16w_linear.cpp, AVX2 + FMA): in every build.
    _bf16w_linear = _qops.linear_bf16w.default
    _argmax_rows = _qops.argmax_rows.default  # (argmax.h: AVX-512 or AVX2)

# The kernels' shape limits, stated once in C++ and read from the extension (decode_step.cpp `limits`):
# head_dim_multiple, max_head_dim: the head sizes the attention kernels take; block_n, block_k: packed weights hold
#   block_n output columns per line and AMX takes K in steps of block_k; step_max_rows, step_max_tile_rows: the fused
#   step's (engine/kernels/step.py). Without the extension nothing runs natively, every use below is behind an
#   `_ops`/`_NATIVE` check, and the limits are empty.
LIMITS: dict[str, int] = dict(_ops.limits()) if _ops is not None else {}
# Output columns a packed line holds (pack below): what the AVX-512 GEMVs read (LIMITS block_n) and, in every build,
# the bf16-weight GEMM (bf16w_linear.cpp checks it); the planner's rule for bf16-held matrices counts on it.
PACK_COLS = WIDEN_ROWS
_block_n, _block_k = LIMITS.get("block_n", PACK_COLS), LIMITS.get("block_k")


def quantized_ok() -> bool:
    """Whether weights may be held block-quantized here (else they are dequantized at load)."""
    return _QUANT


def is_packed(w: torch.Tensor) -> bool:
    """Packed weights are [N/16, K/2, 16, 2] (16 = block_n); a linear weight is otherwise always 2-D."""
    return w.dim() == 4 and w.shape[2] == _block_n and w.shape[3] == 2


def pack(w: torch.Tensor) -> torch.Tensor:
    # [N, K] -> [N/16, K/2, 16, 2]: each 64-byte line is k-pair j of 16 (block_n) output columns (AMX B tile row).
    n, k = w.shape
    return w.reshape(n // _block_n, _block_n, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack(wp: torch.Tensor) -> torch.Tensor:
    nb, kh = wp.shape[0], wp.shape[1]
    return wp.permute(0, 2, 1, 3).reshape(nb * _block_n, kh * 2)


# A compact bf16 matrix (kernels/compact_bf16.h) holds each weight in 12 bits, losslessly, when the 15 most common
# high bytes cover all but this share of its weights (2 in 10,000 miss on the benchmark model; each miss costs 8
# bytes and a patch on every read). Past it the matrix stays packed.
COMPACT_MAX_ESCAPES = 0.002


def is_compact(w: torch.Tensor) -> bool:
    """A compact bf16 matrix is a 1-D int8 blob (kernels/compact_bf16.h)."""
    return w.dtype == _I8 and w.dim() == 1


def compact_unpack(w: torch.Tensor) -> torch.Tensor:
    """A compact matrix -> the packed bf16 matrix it holds, bit for bit."""
    return _compact_unpack(w)


def compact_rows(w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of a compact matrix -> [n, K] bf16, bit for bit (the lookup of an embedding tied to it)."""
    return _ops.compact_rows(w, ids)


def compact_info(w: torch.Tensor) -> tuple[int, int, int]:
    """(N, K, escaped weights) of a compact matrix."""
    return tuple(int(v) for v in _ops.compact_info(w))


def prepare_weight(w: torch.Tensor, compact: bool = False) -> torch.Tensor:
    """Called once per weight at load time; returns what `linear` should be given: packed bf16, or with `compact`
    the same weights in 12 bits each where they allow it. Never keeps a second copy: callers must drop their
    reference to `w` and keep only the result."""
    with torch.no_grad():
        w = w.detach()
        n, k = w.shape
        if _NATIVE.full and w.dtype == torch.bfloat16 and n % _block_n == 0 and k % _block_k == 0:
            p = pack(w)
            if compact:
                c = _ops.compact_pack(p, COMPACT_MAX_ESCAPES)
                if c.numel():
                    return c
            return p
        return w.contiguous()


def bf16w_ok() -> bool:
    """Whether bf16 weights may be held as bf16 under fp32 compute (deploykit.memory.held_dtype): the library is
    loaded, so linear_bf16w widens them in registers."""
    return _qops is not None


def prepare_bf16w(w: torch.Tensor) -> torch.Tensor:
    """A bf16 matrix [N, K] (N a multiple of PACK_COLS) -> what `linear` takes for fp32 activations: packed. Callers
    drop their reference to `w`."""
    with torch.no_grad():
        return pack(w.detach())


def prepare_bias(b: torch.Tensor | None) -> torch.Tensor | None:
    """Called once per bias at load time: the native kernels add an fp32 bias, so convert it once here rather
    than on every call (a bf16 [N] -> fp32 copy per projection per step)."""
    if b is None or not _NATIVE.full or b.dtype != _BF16:
        return b
    return b.float().contiguous()


def fallback_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure PyTorch (oneDNN) path; also the reference the native kernels are tested against."""
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)  # a prepare_bias fp32 copy on a non-native call
    if is_compact(w):
        w = compact_unpack(w)
    w = unpack(w) if is_packed(w) else w
    return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)  # bf16 weights under fp32: widened


def _rows_2d(op, x: torch.Tensor, *args) -> torch.Tensor:
    """op(x2, *args) on x [..., K] as [M, K] with contiguous rows (a view whenever possible), shaped back."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = op(x2 if x2.stride(-1) == 1 else x2.contiguous(), *args)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           prompt_from: int | None = None) -> torch.Tensor:
    """F.linear semantics: x [..., K], w [N, K] or prepare_weight(w), bias [N] -> [..., N]. prompt_from: x's rows
    from this one on are prompt rows (the model's prefill); a quantized matrix runs them on AMX-BF16 tiles where the
    CPU has them (kernels/quant_prompt_amx.cpp), each row the same bits in any chunk. None: no prompt rows."""
    # Hot path of every decode step (~100 calls per token): keep the Python work minimal.
    if w.dtype == _U8:  # block-quantized (exists only where _QUANT): bf16 or fp32 activations
        if prompt_from is not None and _quant_prompt and x.dtype == _BF16 and prompt_from < x.shape[0]:
            return _rows_2d(_quant_prompt_linear, x, w, bias, prompt_from)
        return _rows_2d(_quant_linear, x, w, bias, False)
    if w.dtype == _I8:  # compact bf16 (exists only where the library is loaded)
        return _linear_compact(x, w, bias)
    if x.dtype == _F32 and w.dtype == _BF16 and w.dim() == 4 and _qops is not None:  # prepare_bf16w: fp32 compute
        return _rows_2d(_bf16w_linear, x, w, bias)
    if _ops is None or x.dtype != _BF16 or w.dtype != _BF16:
        return fallback_linear(x, w, bias)
    lead = x.shape[:-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]; a view whenever possible
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return fallback_linear(x, w, bias)
    if w.dim() == 4:  # packed, see is_packed
        y = _amx_packed(x2, w, bias) if m >= _amx_min_m else _avx512_packed(x2, w, bias)
    elif w.dim() != 2 or not w.is_contiguous():
        return fallback_linear(x, w, bias)
    elif m <= ROWS_MAX_M:
        y = _rows(x2, w, bias)
    elif m <= PLAIN_AMX_MAX_M and _NATIVE.amx and w.shape[0] % _block_n == 0 and x2.shape[1] % _block_k == 0:
        y = _amx_plain(x2, w, bias)
    elif m <= _rows_max_m:
        y = _rows(x2, w, bias)
    else:
        return fallback_linear(x, w, bias)
    return y if x.dim() == 2 else y.view(*lead, y.shape[-1])


# On an AMX CPU every compact matrix with K % 32 == 0 runs on AMX tiles for every M (kernels/compact_amx.h): batched
# decode and prefill at AMX speed without unpacking it, and a row's output the same whatever rows share its call.
# The AVX-512 compact kernels sum in another order, so the switch is one per process, made here at load.
_compact_amx = bool(_ops.set_compact_amx(True)) if _ops is not None and _NATIVE.amx else False
# Block-quantized matrices take AMX-INT8 tiles from 16 rows where the CPU has them (kernels/quant_amx.h): the same
# int32 sums and fp32 steps as the VNNI GEMV, so no switch per process is needed for batch invariance.
_quant_amx = bool(_ops.set_quant_amx(True)) if _ops is not None and _QUANT and _NATIVE.amx else False
# A prompt's rows take AMX-BF16 tiles on weights decoded to bf16 in L1 instead (kernels/quant_prompt_amx.cpp).
_quant_prompt = bool(_ops.set_quant_prompt_amx(True)) if _ops is not None and _QUANT and _NATIVE.amx else False
_quant_prompt_linear = _ops.quant_prompt_linear.default if _quant_prompt else None
_quant_prompt_silu = _ops.quant_prompt_gate_up_silu.default if _quant_prompt else None
_quant_prompt_silu_panels = _ops.quant_prompt_gate_up_silu_panels.default if _quant_prompt else None
_quant_prompt_linear_panels = _ops.quant_prompt_linear_panels.default if _quant_prompt else None
_gate_up_silu_panels = _ops.compact_gate_up_silu_panels.default if _compact_amx else None
_compact_linear_panels = _ops.compact_linear_panels.default if _compact_amx else None
# Decode attention's scores on AMX tiles, 16 keys at a time (kernels/attention.h tile_scores): one switch per process,
# for the attention op and the fused step alike, so their outputs stay bitwise the same.
_attention_tiles = bool(_ops.set_attention_tiles(True)) if _ops is not None and _NATIVE.amx else False


def _linear_compact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != _BF16:
        return fallback_linear(x, w, bias)
    return _rows_2d(_compact_linear, x, w, bias)


def on_tiles(w: torch.Tensor) -> bool:
    """Whether this matrix runs on AMX tiles at every row count: compact, on a CPU with AMX, K % 32 == 0."""
    return _compact_amx and is_compact(w) and compact_info(w)[1] % _block_k == 0


def gate_up_silu_ok(w: torch.Tensor) -> bool:
    """Whether gate_up_silu takes this gate_up weight [2I, K] ([gate; up]): on AMX tiles, with whole 16-column
    blocks of gate and of up."""
    return on_tiles(w) and compact_info(w)[0] % 32 == 0


def prompt_gate_up_silu_ok(w: torch.Tensor) -> bool:
    """Whether gate_up_silu takes this quantized gate_up weight for prompt rows: on AMX-BF16 tiles, whole blocks."""
    return _quant_prompt and is_quantized(w) and quant_parts(w)[0] % 32 == 0


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x W_gate^T + b_gate) * (x W_up^T + b_up) [..., I] for a weight gate_up_silu_ok took (or, where every row of
    x is a prompt's, prompt_gate_up_silu_ok), bf16 x: the tiles' epilogue pairs gate block j with up block j and applies
    it, bit for bit what silu_mul(linear(x, w, bias)) gives (prompt_from=0 for a quantized w), without writing the
    [..., 2I] intermediate (kernels/compact_amx.cpp, quant_prompt_amx.cpp)."""
    return _rows_2d(_quant_prompt_silu if w.dtype == _U8 else _gate_up_silu, x, w, bias)


# From this many prompt rows on, prompt_mlp hands gate_up's output to the down projection as tile panels.
PANEL_MIN_M = 64


def prompt_mlp_ok(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether prompt_mlp takes a layer's gate_up [2I, K] and down [K, I]: each compact on AMX tiles or quantized with
    the prompt path on, and I a multiple of 32 (whole panels)."""
    up_ok = (gate_up_silu_ok(gate_up) or prompt_gate_up_silu_ok(gate_up)) and (
        (quant_parts(gate_up)[0] if is_quantized(gate_up) else compact_info(gate_up)[0]) % 64 == 0)
    return up_ok and (on_tiles(down) or (_quant_prompt and is_quantized(down)))


def prompt_mlp(x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor | None, down: torch.Tensor,
               down_bias: torch.Tensor | None) -> torch.Tensor:
    """linear(gate_up_silu(x, gate_up, gate_up_bias), down, down_bias, 0) bit for bit for PANEL_MIN_M+ prompt rows x
    [M, K] (bf16) of weights prompt_mlp_ok took, the [M, I] intermediate handed over as tile panels, not copied into
    tile blocks by the down projection (kernels/amx_slices.h; ~0.27 ms a layer at 512 rows of the benchmark model)."""
    y = (_quant_prompt_silu_panels if gate_up.dtype == _U8 else _gate_up_silu_panels)(x, gate_up, gate_up_bias)
    linear_panels = _quant_prompt_linear_panels if down.dtype == _U8 else _compact_linear_panels
    return linear_panels(y, x.shape[0], down, down_bias)


def logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, H] against the lm_head -> fp32 logits [B, V]; a quantized head writes fp32 directly (no bf16 rounding of
    near-tied logits)."""
    if w.dtype == _U8:
        return _quant_linear(x.contiguous(), w, None, True)
    return linear(x, w, None).float()


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """Row-wise argmax of fp32 [R, V] logits as torch.argmax gives it (first maximum, NaN first), in one native pass;
    None where the library is not loaded (the caller then runs its PyTorch argmax)."""
    if _qops is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    return _argmax_rows(x)


def fused(x: torch.Tensor) -> bool:
    """Whether the fused element-wise ops below run natively for activations like x: bf16 on the AVX-512 builds
    (decode_ops.cpp), fp32 on any build (f32_ops.cpp)."""
    return (_ops is not None and x.dtype == _BF16) or (_qops is not None and x.dtype == _F32)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """h [M, H] += delta (in place, the residual add), then rms_norm(h) * w -> [M, H]. Needs fused(h)."""
    return (_add_rms_norm_f32 if h.dtype == _F32 else _add_rms_norm)(h, delta, w, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate, up) -> silu(gate) * up [M, I]. Needs fused(gate_up)."""
    return (_silu_mul_f32 if gate_up.dtype == _F32 else _silu_mul)(gate_up)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on x [M, heads, D]: x * cos + roll(x, D/2) * sin, cos and signed sin [M, D]. Needs fused(x)."""
    (_rotary_f32 if x.dtype == _F32 else _rotary)(x, cos, sin)


def head_rms_norm_(x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
    """In place on x [M, heads, D]: each head row -> rms_norm(row) * w[head], w [heads, D]. Needs fused(x)."""
    (_head_rms_norm_f32 if x.dtype == _F32 else _head_rms_norm)(x, w, eps)


_streams: streaming.Choice | None = None


def tune_streams() -> streaming.Choice | None:
    """Pick how the bf16 GEMV streams weights on this CPU (engine/kernels/streaming.py), once per process; None
    without the native library. Results are the same either way; only the speed differs."""
    global _streams
    if _ops is not None and _streams is None:
        _streams = streaming.calibrate(_ops)
    return _streams


def status() -> dict:
    """Which matmul path is active and why, for the engine's start-up log."""
    # path: where bf16-activation matmuls run (the AVX2 build has none of them); quantized: whether block-quantized
    # weights are held as they are, on the int8 kernels of `variant`; fp32_ops: whether fp32 models' other ops run
    # natively; bf16_weights_in_fp32: whether a bf16 checkpoint's matrices stay bf16 under fp32 activations.
    path = ("native-amx" if _NATIVE.amx else f"native-{_NATIVE.variant}") if _NATIVE.full else "fallback"
    return {
        "path": path,
        "variant": _NATIVE.variant,
        "isa": _NATIVE.isa,
        "amx": _NATIVE.amx,
        "library": _NATIVE.library,
        "reason": _NATIVE.reason or ("native kernels loaded" if _NATIVE.full else
                                     "CPU lacks AVX-512: the AVX2 build serves quantized and bf16 weights under "
                                     "fp32 activations and the fp32 norms, activations and decode attention; "
                                     "fp32 weights run on PyTorch"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "amx_min_m": AMX_MIN_M,
        "rows_max_m": ROWS_MAX_M,
        "plain_amx_max_m": PLAIN_AMX_MAX_M,
        "compact_amx": _compact_amx,  # compact bf16 matrices on AMX tiles at every M (kernels/compact_amx.h)
        "quantized": _QUANT,
        "quant_amx": _quant_amx,  # block-quantized matrices on AMX-INT8 tiles from 16 rows (kernels/quant_amx.h)
        "quant_prompt_amx": _quant_prompt,  # a prompt's rows on them on AMX-BF16 tiles (quant_prompt_amx.cpp)
        "attention_tiles": _attention_tiles,  # decode attention's scores on AMX-BF16 tiles (kernels/attention.h)
        "fp32_ops": _qops is not None,  # f32_ops.cpp: fp32 norms, rotary, SiLU and decode attention native
        "bf16_weights_in_fp32": _qops is not None,  # bf16w_linear.cpp: a bf16 checkpoint's matrices stay bf16
        "gemv_streams": int(_ops.gemv_streams()) if _ops is not None else None,
        "quant_stream_ahead": quant_stream_ahead(),
        "quant_stream_hint": quant_stream_hint(),
    }


# The attention ops (engine/kernels/attention.py), bound to this library.
attention.bind(_NATIVE, _ops, _qops, LIMITS)
decode_attention_supported, decode_attention = attention.decode_attention_supported, attention.decode_attention
prefill_attention_supported, prefill_attention = attention.prefill_attention_supported, attention.prefill_attention

# The fused decode step (engine/kernels/step.py), bound to this library. The model calls kernels.decode_step_ by
# attribute, so a profiler or a test may wrap it here.
step.bind(_ops, _qops, LIMITS)
decode_step_supported, step_f32_weight = step.decode_step_supported, step.step_f32_weight
decode_step_ = step.decode_step_
STEP_MAX_ROWS, STEP_MAX_TILE_ROWS = step.MAX_ROWS, step.MAX_TILE_ROWS
STEP_F32_MAX_ROWS = step.F32_MAX_ROWS
