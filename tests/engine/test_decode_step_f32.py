"""The fused decode step under fp32 activations (engine/kernels/decode_step_f32.cpp: every layer in one native call,
for 1 to 16 sequences whether its matrices are quantized or bf16, in every kernel build) computes bitwise what the
per-op fp32 path computes: the same logits at every step and the same K/V in the cache. It is the latency path of
every CPU without AVX-512 (quantized GGUF weights, or a bf16 checkpoint held bf16), so this carries the per-op path's
tests (test_f32_ops, test_quant, test_bf16w_linear, test_smollm2) over to it."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore

from tests.engine.conftest import ANY_NATIVE, QUANT_NATIVE
from tests.engine.test_bf16_decode import SHAPE
from tests.engine.test_decode_step import (CASES, REQUESTS, assert_bitwise, assert_step_profile, drive,
                                          side_by_side)

pytestmark = [pytest.mark.skipif(not ANY_NATIVE, reason="this CPU runs no kernel build (no AVX2), or "
                                 "DEPLOYKIT_KERNELS switches them off"),
              pytest.mark.usefixtures("f32_kernels")]  # a CPU that runs it must have it built

# bf16 checkpoints: their matrices held bf16 and widened in registers, or quantized on load where the CPU runs the
# int8 kernels. In the 18-block case down_proj's 288 columns are no whole number of 64-weight chunks, so it stays
# bf16 beside quantized matrices.
HELD = ["none"] + (["q8_0", "q4_0"] if QUANT_NATIVE else [])


def _run(model_dir: str, fused: bool, threads: int, monkeypatch, quantization: str = "none",
         requests: list = REQUESTS) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """Logits of every step, the final KV cache and (rows, block tables) of each step that took the fused path."""
    from engine import kernels
    core = EngineCore(EngineConfig(model_dir, dtype="float32", block_size=8, max_model_len=256,
                                   quantization=quantization, max_num_seqs=16, decode_steps=1))  # a step a call
    model = core.model
    assert model.step_weights is not None
    matrices = [w for i, w in enumerate(model.step_weights) if i % 11 in (1, 4, 7, 9)]  # qkv, o, gate_up, down
    assert matrices and all(kernels.step_f32_weight(w) for w in matrices)
    assert any(kernels.is_quantized(w) for w in matrices) == (quantization != "none")
    assert model.step_max_rows == kernels.STEP_F32_MAX_ROWS == 16
    if not fused:
        model.step_weights = None
    return drive(core, requests, threads, monkeypatch)


@pytest.mark.parametrize("quantization", HELD)
@pytest.mark.parametrize("name", list(CASES))
def test_fp32_fused_decode_step_is_bitwise_the_per_op_path(tiny_model, name, quantization, monkeypatch):
    kw = dict(CASES[name])
    model_dir = tiny_model(kw.pop("arch"), dtype="bfloat16", **kw)
    ref_logits, ref_kv, ref_calls = _run(model_dir, False, 2, monkeypatch, quantization)
    assert ref_calls == []
    for threads in (2, 1):  # the split between threads may not change a single bit
        logits, kv, calls = _run(model_dir, True, threads, monkeypatch, quantization)
        assert len(calls) == len(logits) - 1, "every decode step should take the fused path (all but the prefill)"
        assert {rows for rows, _ in calls} == {1, 2, 3, 4}
        lone = [tables[0] for rows, tables in calls if rows == 1]
        assert any(t != list(range(t[0], t[0] + len(t))) for t in lone), "no scattered block table was tested"
        assert_bitwise(logits, kv, ref_logits, ref_kv)


# Past 4 rows: 16, 10 and 8 sequences side by side, steps of n rows down to 1, on matrices held bf16 (past 4 rows
# the blocked GEMM of bf16w_blocked.h, its 6-row tiles and their tails), quantized, or both (in the 18-block case
# down_proj stays bf16 beside quantized matrices).
WIDE = [("none", "qwen3-qk-norm", 16), ("none", "llama-all-biases-18-blocks", 10)]
if QUANT_NATIVE:
    WIDE += [("q4_0", "qwen3-qk-norm", 16), ("q8_0", "mistral-window", 10), ("q4_0", "llama-all-biases-18-blocks", 8)]


@pytest.mark.parametrize("quantization,name,n", WIDE)
def test_fp32_fused_step_takes_up_to_16_rows_bitwise_the_per_op_path(tiny_model, quantization, name, n,
                                                                      monkeypatch):
    kw = dict(CASES[name])
    model_dir = tiny_model(kw.pop("arch"), dtype="bfloat16", **kw)
    ref_logits, ref_kv, _ = _run(model_dir, False, 2, monkeypatch, quantization, side_by_side(n))
    for threads in (2, 3):  # past 4 rows a phase's items go out in runs as threads come free: any hand-out, same bits
        logits, kv, calls = _run(model_dir, True, threads, monkeypatch, quantization, side_by_side(n))
        assert {rows for rows, _ in calls} == set(range(1, n + 1)), "steps of every row count up to the widest"
        assert_bitwise(logits, kv, ref_logits, ref_kv)


def test_fp32_step_runs_only_where_it_applies_and_says_so(tiny_model, caplog):
    from engine import kernels
    caplog.set_level("INFO", logger="engine")
    shape = dict(CASES["qwen3-qk-norm"])
    arch = shape.pop("arch")
    held = EngineCore(EngineConfig(tiny_model(arch, dtype="bfloat16", **shape), dtype="float32"))
    assert len(held.model.step_weights) == 11 * held.model.config.num_layers
    assert "decode steps of up to 16 sequences run as one fused native call" in caplog.text
    # An fp32 checkpoint's matrices stay fp32 on PyTorch's GEMM: the per-op path.
    assert EngineCore(EngineConfig(tiny_model(arch, **shape), dtype="float32")).model.step_weights is None
    gelu = tiny_model(arch, dtype="bfloat16", **shape, extra_config={"hidden_act": "gelu"})
    assert EngineCore(EngineConfig(gelu, dtype="float32")).model.step_weights is None  # the step fuses SiLU only
    assert not kernels.decode_step_supported(torch.zeros(1, 14, 12), 4864)  # head_dim 12: no native attention


@pytest.mark.parametrize("quantization", HELD)
def test_fp32_step_profile_counts_every_phase_and_barrier(tiny_model, quantization):
    """benchmarks/decode_profile.py on a CPU without AVX-512: the fp32 step charges the same per-thread phase
    timers as the bf16 one, with bf16-held or quantized matrices."""
    model_dir = tiny_model("qwen3", dtype="bfloat16", **SHAPE)
    assert_step_profile(EngineCore(EngineConfig(model_dir, dtype="float32", quantization=quantization, decode_steps=1)))


def test_fp32_step_rejects_bad_indices_and_too_many_rows(tiny_model):
    from engine import kernels
    shape = dict(CASES["llama3-rope"])
    core = EngineCore(EngineConfig(tiny_model(shape.pop("arch"), dtype="bfloat16", **shape), dtype="float32",
                                   block_size=8, max_model_len=64))
    m, s = core.model, core.model.config
    blocks = core.runner.kv.layers[0].shape[0]

    def call(position=0, table=(0,), length=1, slot=0, rows=1):
        h = torch.randn(rows, s.hidden_size)
        i32, i64 = torch.int32, torch.int64
        ok = [(0, [b] + [0] * (len(table) - 1), 1, b * 8) for b in range(1, rows)]  # row b: own block b
        pos, tables, lens, slots = zip(*ok, (position, list(table), length, slot))
        kernels.decode_step_(h, m.step_weights, core.runner.kv.layers, m.windows, m.rotary.cos, m.rotary.sin,
                             torch.tensor(pos, dtype=i64), torch.tensor(tables, dtype=i32),
                             torch.tensor(lens, dtype=i32), torch.tensor(slots, dtype=i64), s.num_heads,
                             s.num_kv_heads, s.rms_norm_eps, 1.0)
        return h

    assert call().isfinite().all() and call(rows=5).isfinite().all() and call(rows=16).isfinite().all()
    for bad, message in [({"slot": blocks * 8}, "outside the cache"), ({"position": 10 ** 6}, "outside the rotary"),
                         ({"length": 9}, "context length 9 of row 2 is outside"),
                         ({"table": (0, blocks), "length": 9}, f"block id {blocks} of row 2"),
                         ({"slot": -1}, "slot -1 of row 2"), ({"position": -1}, "position -1 of row 2")]:
        with pytest.raises(RuntimeError, match=message):  # every row's indices are checked, not only the first
            call(rows=3, **bad)
    with pytest.raises(RuntimeError, match="1 <= B <= 16"):
        call(rows=17)
    with pytest.raises(RuntimeError, match="expected a contiguous fp32 tensor"):  # bf16 norms are not the fp32 step's
        kernels.decode_step_(torch.zeros(1, s.hidden_size), [w.bfloat16() if w is not None and w.dim() == 1 and
                                                              w.dtype == torch.float32 else w for w in m.step_weights],
                             core.runner.kv.layers, m.windows, m.rotary.cos, m.rotary.sin,
                             torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.long), s.num_heads, s.num_kv_heads, s.rms_norm_eps, 1.0)
