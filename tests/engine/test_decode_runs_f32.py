"""The fused fp32 decode step (decode_step_f32.cpp: every CPU without AVX-512 runs models in fp32) from token ids to
greedy tokens, and runs of such steps in one call, as the bf16 step has them (test_decode_runs.py): the token table
looked up in the step, the final norm, the LM head and the argmax after the last layer, bitwise what Python computes
around the step; a run gives the same tokens, logits and KV cache as the same steps one call at a time, and ends after
a step that picks an EOS or stop token, where the sampler applies bans and stops as ever.
"""
from __future__ import annotations

import pytest
import torch

from engine import kernels, quant
from engine.models.layers import embed_rows

from tests.engine.conftest import ANY_NATIVE, QUANT_NATIVE
from tests.engine.test_bf16_decode import SHAPE
from tests.engine.test_decode_runs import REQUESTS, _core, _drive, _watch
from tests.engine.test_decode_step import side_by_side
from tests.engine.test_decode_step_f32 import HELD

pytestmark = [pytest.mark.skipif(not ANY_NATIVE, reason="this CPU runs no kernel build (no AVX2), or "
                                 "DEPLOYKIT_KERNELS switches them off"),
              pytest.mark.usefixtures("f32_kernels")]  # a CPU that runs it must have it built


def _f32(model_dir: str, steps: int, **kw):
    return _core(model_dir, steps, dtype="float32", max_num_seqs=16, **kw)


def _runs_against_single_steps(model_dir: str, requests, quantization: str, monkeypatch, threads: int = 2,
                               longest: int = 8, same_blocks: bool = True):
    """longest: the longest run expected (runs are cut where the earliest request reaches its max_tokens);
    same_blocks: the two take the same cache blocks, so the caches compare (many sequences that take a run's blocks
    up front hold other block ids; their logits at every later step still compare)."""
    results = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for steps in (1, 8):
            core = _f32(model_dir, steps, quantization=quantization)
            assert core.model.step_logits_rows == kernels.STEP_F32_MAX_ROWS
            logits, calls = _watch(core, monkeypatch)
            tokens = _drive(core, requests, banned=True)  # a run ends where the argmax is EOS, then banned
            results[steps] = tokens, logits, core.runner.kv._pool.clone(), calls
    finally:
        torch.set_num_threads(before)
    (tokens, logits, kv, calls), (ref_tokens, ref_logits, ref_kv, ref_calls) = results[8], results[1]
    assert set(ref_calls) == {1} and max(calls) == longest and len(calls) < len(ref_calls) / 2
    assert tokens == ref_tokens and [len(t) for t in tokens.values()] == [n for _, n in requests]
    assert not same_blocks or torch.equal(kv, ref_kv), "a run wrote other K/V than the steps one at a time"
    assert 0 < len(logits) < len(ref_logits) / 2  # the sampler sees a run's last step only
    assert all(torch.equal(x, ref_logits[key]) for key, x in logits.items())


@pytest.mark.parametrize("quantization", HELD)
def test_an_fp32_run_is_bitwise_the_same_steps_one_call_at_a_time(tiny_model, quantization, monkeypatch):
    _runs_against_single_steps(tiny_model("qwen3", dtype="bfloat16", **SHAPE), REQUESTS, quantization, monkeypatch)


@pytest.mark.parametrize("quantization", HELD)
def test_fp32_runs_of_up_to_16_rows_hand_out_each_steps_phases_alike(tiny_model, quantization, monkeypatch):
    # Past 4 rows every phase of every step of a run (the LM head's too) hands its items out as threads come free.
    model_dir = tiny_model("qwen3", dtype="bfloat16", **SHAPE)
    _runs_against_single_steps(model_dir, side_by_side(10), quantization, monkeypatch, threads=3, longest=4,
                               same_blocks=False)


def test_an_fp32_run_ends_at_stop_tokens_and_the_sampler_applies_bans_as_ever(tiny_model, monkeypatch):
    model_dir = tiny_model("qwen3", dtype="bfloat16", **SHAPE)
    prompt = list(range(40, 77))
    free = _drive(_f32(model_dir, 1), [(prompt, 30)], ignore_eos=True)["0"]
    at = next(i for i in range(6, 30) if free[i] not in free[:i])  # a token the greedy output first makes here
    for params in ({"stop_token_ids": [free[at]]}, {"stop_token_ids": [free[at]], "min_tokens": at + 3}):
        ref = _drive(_f32(model_dir, 1), [(prompt, 30)], **params)["0"]
        core = _f32(model_dir, 8)
        _, calls = _watch(core, monkeypatch)
        assert _drive(core, [(prompt, 30)], **params)["0"] == ref, params
        assert max(calls) == 8
    assert ref[:at] == free[:at] and ref[at] != free[at]  # (banned, another token came)
    assert _drive(_f32(model_dir, 8), [(prompt, 30)], stop_token_ids=[free[at]])["0"] == free[:at + 1]


def test_the_fp32_step_looks_rows_up_in_every_kind_of_token_table_and_ends_with_the_greedy_token(tiny_model):
    core = _f32(tiny_model("qwen3", dtype="bfloat16", **SHAPE), 1, quantization="q8_0" if QUANT_NATIVE else "none")
    m, s = core.model, core.model.config
    V, H = s.vocab_size, s.hidden_size
    dense = (torch.randn(V, H, generator=torch.Generator().manual_seed(0)) / 4).bfloat16()
    tables = {"fp32": dense.float(), "bf16": dense, "packed bf16": kernels.prepare_bf16w(dense)}
    if QUANT_NATIVE:
        tables["q8_0"] = quant.pack([quant.quantize(dense.float(), "Q8_0")])
        tables["q4_0"] = quant.pack([quant.quantize(dense.float(), "Q4_0")])
    ids = torch.tensor([3, V - 1, 0])
    i32, i64 = torch.int32, torch.int64
    pos, lens = torch.tensor([0, 5, 2], dtype=i64), torch.tensor([1, 6, 3], dtype=i32)
    tables_, slots = torch.tensor([[1], [2], [3]], dtype=i32), torch.tensor([8, 21, 26], dtype=i64)

    def step(h, *tail):
        return kernels.decode_step_(h, m.step_weights, core.runner.kv.layers, m.windows, m.rotary.cos, m.rotary.sin,
                                    pos, tables_, lens, slots, s.num_heads, s.num_kv_heads, s.rms_norm_eps, 0.3,
                                    *tail)

    for name, table in tables.items():
        h = embed_rows(table, ids, torch.float32)  # Python's lookup, then the step, then the head and argmax
        assert step(h) == 1
        want = kernels.logits(m.norm(h), m.lm_head)
        got_h, logits, greedy = torch.full((3, H), torch.nan), torch.empty(3, V), torch.empty(3, dtype=i64)
        assert step(got_h, m.norm.weight, m.lm_head, logits, ids, table, greedy) == 1
        assert torch.equal(got_h, h), name
        assert torch.equal(logits, want) and greedy.tolist() == want.argmax(-1).tolist(), name
    with pytest.raises(RuntimeError, match=f"token id {V} of row 1 is outside the vocabulary"):
        step(got_h, m.norm.weight, m.lm_head, logits, torch.tensor([1, V, 2]), dense, greedy)
    with pytest.raises(RuntimeError, match="the token table: expected a contiguous fp32 or bf16"):
        step(got_h, m.norm.weight, m.lm_head, logits, ids, dense.half(), greedy)
    with pytest.raises(RuntimeError, match="the final norm: expected a contiguous fp32 tensor"):
        step(got_h, m.norm.weight.bfloat16(), m.lm_head, logits, ids, dense, greedy)
    with pytest.raises(RuntimeError, match="a run of more \\(got 2\\) feeds each step's greedy tokens"):
        step(got_h, m.norm.weight, m.lm_head, logits, None, None, None, 2)
