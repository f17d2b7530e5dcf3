"""The fused decode step (kernels.decode_step_: every layer in one native call, for 1 to 4 sequences, up to 16 where
every matrix is quantized or runs on AMX tiles) computes
bitwise what the per-op native path computes: the same logits at every step and the same K/V in the cache.
test_bf16_decode holds the per-op path to fp32 transformers, so this carries that guarantee over to the latency path.
"""
from __future__ import annotations

import pytest
import torch

from engine import kernels, quant
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams

from tests.engine.conftest import NATIVE, record_logits
from tests.engine.test_bf16_decode import SHAPE, VARIANTS

pytestmark = [pytest.mark.skipif(not NATIVE, reason="no native path here (a CPU without AVX-512, or DEPLOYKIT_KERNELS off)"),
              pytest.mark.usefixtures("native_kernels")]  # a CPU that runs it must have it built

# (prompt, tokens to generate): they finish one after another, so decode steps have 4, 3, 2, then 1 rows.
REQUESTS = [(list(range(40, 77)), 40), ([3, 1000, 20, 50, 90], 12), ([7, 8, 9], 20), (list(range(100, 121)), 28)]
# test_bf16_decode's four architectures, plus every bias slot (o, gate/up, down) and an intermediate size of 18
# column blocks (9 per thread, 18 on one), so the groups of 4 gate/up block pairs leave single pairs.
CASES = {name: {**SHAPE, **kw} for name, kw in VARIANTS.items()}
CASES["llama-all-biases-18-blocks"] = {**SHAPE, "arch": "llama", "intermediate": 288,
                                             "extra_config": {"attention_bias": True, "mlp_bias": True}}


def _run(model_dir: str, fused: bool, threads: int, monkeypatch, quantization: str = "none",
         streams: int = 8, compact: bool = False,
         take_over: bool = True) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """Logits of every step, the final KV cache and (rows, block tables) of each step that took the fused path.
    The requests decode side by side first, so when the longest goes on alone its block table (block_size 8) is no
    longer one contiguous run. streams: how the bf16 GEMV reads its blocks (kernels/gemv.h Streams); take_over:
    whether a thread done with its share of a phase takes work over from the other (kernels/runs.h Shares, the
    default) or each keeps its fixed share."""
    core = EngineCore(EngineConfig(model_dir, dtype="bfloat16", block_size=8, max_model_len=256, decode_steps=1,
                                   quantization=quantization, compact_weights=compact))
    ops = torch.ops.deploykit
    picked = int(ops.gemv_streams())
    ops.set_gemv_streams(streams)
    ops.set_step_take_over(take_over)
    model = core.model
    assert model.step_weights is not None
    held = [w for w in model.step_weights if w is not None and kernels.is_quantized(w)]
    assert bool(held) == (quantization != "none"), "quantized on load, or not at all"
    # Quantized gate_up halves lie group by group (quant.pack interleave), which the step reads in its own order.
    assert all(quant.interleaved(y.gate_up) for y in model.layers if kernels.is_quantized(y.gate_up))
    compacted = any(w is not None and kernels.is_compact(w) for w in model.step_weights)
    assert compacted == compact if quantization == "none" else compacted <= compact
    if not fused:
        model.step_weights = None
    try:
        return drive(core, REQUESTS, threads, monkeypatch)
    finally:
        ops.set_gemv_streams(picked)
        ops.set_step_take_over(True)


def assert_bitwise(logits: list[torch.Tensor], kv: torch.Tensor, ref_logits: list[torch.Tensor],
                   ref_kv: torch.Tensor) -> None:
    """Every step's logits and the final KV cache are the reference's, bit for bit."""
    assert len(logits) == len(ref_logits)
    for i, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max():.3g}"
    assert torch.equal(kv, ref_kv)


def drive(core: EngineCore, requests: list[tuple[list[int], int]], threads: int,
          monkeypatch) -> tuple[list[torch.Tensor], torch.Tensor, list]:
    """Runs (prompt, tokens) requests greedily to the end on `threads` threads: the logits of every step, the final KV
    cache and (rows, block tables) of each step that took the fused path (test_decode_step_f32 drives it too)."""
    logits = record_logits(core)
    calls = []
    step = kernels.decode_step_
    monkeypatch.setattr(kernels, "decode_step_",
                        lambda *a: calls.append((a[0].shape[0], a[7].tolist())) or step(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, (prompt, n) in enumerate(requests):
            core.add_request(str(i), prompt, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0))
        while core.has_unfinished_requests():
            core.step()
    finally:
        torch.set_num_threads(before)
    return logits, core.runner.kv._pool.clone(), calls


# Weights quantized on load run the int8 kernels in the same fused step (where the CPU has VNNI); in the 18-block case
# down_proj's 288 columns are no whole number of 64-weight chunks, so it stays bf16 beside quantized matrices. bf16
# matrices are packed, or compact (kernels/compact_bf16.h, the default), beside quantized ones too.
HELD = [("none", False), ("none", True)] + ([("q8_0", True), ("q4_0", True)] if kernels.quantized_ok() else [])


@pytest.mark.parametrize("quantization,compact", HELD)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_decode_step_is_bitwise_the_per_op_path(tiny_model, name, quantization, compact, monkeypatch):
    kw = dict(CASES[name])
    model_dir = tiny_model(kw.pop("arch"), **kw)
    ref_logits, ref_kv, ref_calls = _run(model_dir, False, 2, monkeypatch, quantization, compact=compact)
    assert ref_calls == []
    # Neither the split between threads (fixed shares, or taken over as threads finish) nor how the GEMV streams its
    # blocks may change a single bit.
    for threads, streams, take_over in ((2, 8, True), (2, 1, False), (1, 1, True)):
        logits, kv, calls = _run(model_dir, True, threads, monkeypatch, quantization, streams, compact, take_over)
        assert len(calls) == len(logits) - 1, "every decode step should take the fused path (all but the prefill)"
        assert {rows for rows, _ in calls} == {1, 2, 3, 4}
        lone = [tables[0] for rows, tables in calls if rows == 1]
        assert any(t != list(range(t[0], t[0] + len(t))) for t in lone), "no scattered block table was tested"
        assert_bitwise(logits, kv, ref_logits, ref_kv)


# Taken over for certain: thread 0 spins before each claim (set_first_thread_delay), so thread 1 finishes its share
# first and takes over the rest of thread 0's, in every phase of every step. Quantized matrices at 1-4 rows and at 16
# (AMX-INT8 tiles where the CPU has them), compact ones (on AMX tiles where it has them).
TAKEN = ([("q4_0", True, 4), ("q4_0", True, 16)] if kernels.quantized_ok() else []) + [("none", True, 4)]


@pytest.mark.parametrize("quantization,compact,n", TAKEN)
def test_a_step_taken_over_is_bitwise_the_per_op_path(tiny_model, quantization, compact, n, monkeypatch):
    kw = dict(CASES["qwen3-qk-norm"])
    model_dir = tiny_model(kw.pop("arch"), **kw)
    ops = torch.ops.deploykit

    def run(fused: bool, delay_us: float) -> tuple[list[torch.Tensor], torch.Tensor, list, int]:
        core = EngineCore(EngineConfig(model_dir, dtype="bfloat16", block_size=8, max_model_len=256, decode_steps=1,
                                       quantization=quantization, compact_weights=compact, max_num_seqs=16))
        if n > core.model.step_max_rows:
            pytest.skip(f"{n} rows take the fused step only on AMX or quantized matrices")
        if not fused:
            core.model.step_weights = None
        ops.step_take_overs()
        before = ops.set_first_thread_delay(delay_us)
        try:
            logits, kv, calls = drive(core, side_by_side(n), 2, monkeypatch)
        finally:
            ops.set_first_thread_delay(before)
        return logits, kv, calls, int(ops.step_take_overs())

    ref_logits, ref_kv, ref_calls, _ = run(False, 0.0)
    logits, kv, calls, taken = run(True, 200.0)
    assert {rows for rows, _ in calls} == set(range(1, n + 1))
    assert taken >= len(calls), f"{taken} take-overs in {len(calls)} steps: thread 1 should take over every phase"
    assert_bitwise(logits, kv, ref_logits, ref_kv)


def test_fused_step_is_used_only_where_it_applies(tiny_model, caplog):
    caplog.set_level("INFO", logger="engine")
    fp32 = EngineCore(EngineConfig(tiny_model("llama", **SHAPE), dtype="float32"))
    assert fp32.model.step_weights is None  # an fp32 checkpoint's fp32 matrices: per-op (test_decode_step_f32)
    assert "fused native call" not in caplog.text
    gelu = EngineCore(EngineConfig(tiny_model("llama", **SHAPE, extra_config={"hidden_act": "gelu"}),
                                   dtype="bfloat16"))
    assert gelu.model.step_weights is None  # the kernel fuses SiLU only
    bf16 = EngineCore(EngineConfig(tiny_model("qwen3", **SHAPE), dtype="bfloat16"))
    assert len(bf16.model.step_weights) == 11 * bf16.model.config.num_layers
    tiles = kernels.status()["compact_amx"]  # compact matrices (the default) on AMX tiles: up to 16 sequences
    assert bf16.model.step_max_rows == (kernels.STEP_MAX_TILE_ROWS if tiles else kernels.STEP_MAX_ROWS)
    assert f"decode steps of up to {bf16.model.step_max_rows} sequences run as one fused native call" in caplog.text
    kw = dict(CASES["llama-all-biases-18-blocks"])
    biased = EngineCore(EngineConfig(tiny_model(kw.pop("arch"), **kw), dtype="bfloat16")).model.step_weights
    assert sum(w is None for w in biased) == len(biased) // 11  # only qk_norm absent: every bias slot is tested


def test_fused_step_rejects_indices_outside_the_cache_and_tables(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("llama", **SHAPE), dtype="bfloat16", block_size=8, max_model_len=64))
    m, s = core.model, core.model.config
    blocks = core.runner.kv.layers[0].shape[0]

    def call(position=0, table=(0,), length=1, slot=0, rows=1):
        """One step of `rows` sequences; the last row gets the given indices, the others valid ones."""
        h = torch.randn(rows, s.hidden_size).bfloat16()
        i32, i64 = torch.int32, torch.int64
        ok = [(0, [b] + [0] * (len(table) - 1), 1, b * 8) for b in range(1, rows)]  # row b: own block b
        pos, tables, lens, slots = zip(*ok, (position, list(table), length, slot))
        kernels.decode_step_(h, m.step_weights, core.runner.kv.layers, m.windows, m.rotary.cos, m.rotary.sin,
                             torch.tensor(pos, dtype=i64), torch.tensor(tables, dtype=i32),
                             torch.tensor(lens, dtype=i32), torch.tensor(slots, dtype=i64), s.num_heads,
                             s.num_kv_heads, s.rms_norm_eps, 1.0)
        return h

    assert call().isfinite().all()  # valid indices run
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(slot=blocks * 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        call(position=10 ** 6)
    with pytest.raises(RuntimeError, match="context length 9 of row 0 is outside"):
        call(length=9)  # one block of 8 listed
    with pytest.raises(RuntimeError, match="block id .* out of range"):
        call(table=(0, blocks), length=9)
    assert call(rows=3).isfinite().all()
    for bad, message in [({"slot": -1}, "slot -1 of row 2"), ({"table": (blocks,)}, f"block id {blocks} of row 2"),
                         ({"length": 0}, "context length 0 of row 2"), ({"position": -1}, "position -1 of row 2")]:
        with pytest.raises(RuntimeError, match=message):  # every row's indices are checked, not only the first
            call(rows=3, **bad)
    # One row more than the step takes is the per-op path's job; the engine routes by these same constants.
    def rows(n: int, weights: list) -> None:
        i32, i64 = torch.int32, torch.int64
        kernels.decode_step_(torch.zeros(n, s.hidden_size, dtype=torch.bfloat16), weights, core.runner.kv.layers,
                             m.windows, m.rotary.cos, m.rotary.sin, torch.zeros(n, dtype=i64),
                             torch.zeros(n, 1, dtype=i32), torch.ones(n, dtype=i32), torch.zeros(n, dtype=i64),
                             s.num_heads, s.num_kv_heads, s.rms_norm_eps, 1.0)

    with pytest.raises(RuntimeError, match=f"1 <= B <= {kernels.STEP_MAX_TILE_ROWS}"):
        rows(kernels.STEP_MAX_TILE_ROWS + 1, m.step_weights)
    packed = EngineCore(EngineConfig(tiny_model("llama", **SHAPE), dtype="bfloat16", compact_weights=False))
    assert packed.model.step_max_rows == kernels.STEP_MAX_ROWS  # 16-bit packed matrices: the GEMV's 4 rows
    with pytest.raises(RuntimeError, match=f"rows take every matrix quantized or compact on AMX tiles; with others "
                                           f"1 <= B <= {kernels.STEP_MAX_ROWS}"):
        rows(kernels.STEP_MAX_ROWS + 1, packed.model.step_weights)


def test_step_profile_counts_every_phase_and_barrier(tiny_model):
    """benchmarks/decode_profile.py's view inside the fused step: per thread, time in each phase and 5 barriers
    per layer per step; off, nothing is counted."""
    assert_step_profile(EngineCore(EngineConfig(tiny_model("qwen3", **SHAPE), dtype="bfloat16", decode_steps=1)))


def assert_step_profile(core: EngineCore) -> None:
    """Three fused steps profiled: each thread's time in each phase and 5 barriers per layer per step; then steps
    with profiling off count nothing."""
    ops = torch.ops.deploykit
    layers = core.model.config.num_layers
    assert core.model.step_weights is not None
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    core.step()  # prefill: not the fused step
    ops.step_profile_(True)
    for _ in range(3):
        core.step()
    phases, steps = ops.step_profile_(False)
    names = list(ops.step_profile_phases())
    assert names == ["qkv", "attention", "o_proj", "gate_up", "down", "residual", "lm_head", "barrier"]
    assert steps == 3 and phases.shape == (torch.get_num_threads(), len(names) + 1)
    assert (phases[:, len(names)] == 3 * 5 * layers).all()  # barriers per thread (none more for the LM head)
    assert (phases[:, names.index("gate_up")] > 0).all() and (phases[:, :len(names)] >= 0).all()
    assert bool((phases[:, names.index("lm_head")] > 0).all()) == (core.model.step_logits_rows > 0)
    while core.has_unfinished_requests():
        core.step()
    phases, steps = ops.step_profile_(False)
    assert steps == 0 and int(phases.sum()) == 0  # off: nothing recorded


# Requests side by side: steps of n rows down to 1, ending one after another.
def side_by_side(n: int) -> list[tuple[list[int], int]]:
    return [(list(range(40 + 3 * i, 47 + 5 * i)), 6 + 3 * i) for i in range(n)]


# Past 4 rows the step takes matrices quantized (any AVX512-VNNI CPU) or compact on AMX tiles; in the 18-block case
# down_proj stays bf16 beside quantized matrices (see HELD), so there it needs AMX tiles too.
# The q4_0 cases run 16 sequences: at 16 rows the per-op path takes AMX-INT8 tiles where the CPU has them (and in
# the 18-block case the compact down_proj AMX-BF16 tiles, the two configurations in turn on a thread).
WIDE = ([("none", "qwen3-qk-norm", 10), ("none", "mistral-window", 10), ("none", "llama-all-biases-18-blocks", 10)]
        if kernels.status()["compact_amx"] else []) + ([("q4_0", "qwen3-qk-norm", 16), ("q8_0", "mistral-window", 10)]
                                                       + ([("q4_0", "llama-all-biases-18-blocks", 16)]
                                                          if kernels.status()["compact_amx"] else [])
                                                       if kernels.quantized_ok() else [])


@pytest.mark.skipif(not WIDE, reason="past 4 rows the fused step needs quantized matrices (VNNI) or AMX tiles")
@pytest.mark.parametrize("quantization,name,n", WIDE)
def test_the_fused_step_takes_up_to_16_rows_bitwise_the_per_op_path(tiny_model, quantization, name, n, monkeypatch):
    kw = dict(CASES[name])
    model_dir = tiny_model(kw.pop("arch"), **kw)

    def run(fused: bool) -> tuple[list[torch.Tensor], torch.Tensor, set[int]]:
        core = EngineCore(EngineConfig(model_dir, dtype="bfloat16", block_size=8, max_model_len=256, decode_steps=1,
                                       quantization=quantization, max_num_seqs=16))
        model = core.model
        assert model.step_max_rows == kernels.STEP_MAX_TILE_ROWS == 16
        held = [w for w in model.step_weights if w is not None and kernels.is_quantized(w)]
        assert bool(held) == (quantization != "none"), "quantized on load, or not at all"
        if not fused:
            model.step_weights = None
        logits, kv, calls = drive(core, side_by_side(n), torch.get_num_threads(), monkeypatch)
        return logits, kv, {rows for rows, _ in calls}

    ref_logits, ref_kv, ref_rows = run(False)
    assert ref_rows == set()
    logits, kv, rows = run(True)
    assert rows == set(range(1, n + 1)), rows
    assert_bitwise(logits, kv, ref_logits, ref_kv)


# Segmented matrices (kernels/quant_layout.h SEGMENT_AT): the packer segments groups longer than L1 by itself (down of
# the benchmark model, K = 4864), which these tiny models do not have, so here K is cut into 256-weight segments: every
# matrix of a 512-wide model (gate_up interleaved as well), in panels of 4 groups. At 1-4 rows the step reads whole
# panels; with thread 0 held back, thread 1 takes over panels; 16 rows go in tiles over pairs of groups.
SEGMENTED = [("q4_0", 4), ("q8_0", 4), ("q4_0", 16)] if kernels.quantized_ok() else []


@pytest.mark.parametrize("quantization,n", SEGMENTED)
def test_segmented_weights_decode_bitwise_as_the_plain_layout(tiny_model, quantization, n, monkeypatch):
    model_dir = tiny_model("qwen2", hidden=512, heads=8, kv_heads=2, intermediate=640, init_std=0.1)
    ops = torch.ops.deploykit

    def run(segment_k: int, fused: bool, delay_us: float = 0.0) -> tuple[list[torch.Tensor], torch.Tensor, list]:
        monkeypatch.setattr(quant, "SEGMENT_K", segment_k)
        core = EngineCore(EngineConfig(model_dir, dtype="bfloat16", block_size=8, max_model_len=256, decode_steps=1,
                                       quantization=quantization, max_num_seqs=16))
        y = core.model.layers[0]
        want = (segment_k, 4) if segment_k else (0, 0)
        assert [kernels.quant_segments(w) for w in (y.qkv, y.o, y.gate_up, y.down)] == [want] * 4
        if not fused:
            core.model.step_weights = None
        before = ops.set_first_thread_delay(delay_us)
        try:
            return drive(core, side_by_side(n), 2, monkeypatch)
        finally:
            ops.set_first_thread_delay(before)

    ref_logits, ref_kv, _ = run(0, False)
    for fused, delay_us in ((False, 0.0), (True, 0.0), (True, 200.0)):
        logits, kv, calls = run(256, fused, delay_us)
        assert {rows for rows, _ in calls} == (set(range(1, n + 1)) if fused else set())
        assert_bitwise(logits, kv, ref_logits, ref_kv)
