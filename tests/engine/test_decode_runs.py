"""Runs of greedy decode steps in one native call (EngineCore._run_steps, decode_step.cpp `steps`): each step's argmax
is the next step's token, so a run gives the same tokens, logits and KV cache as the same steps one call at a time; a
run ends after a step that picks an EOS or stop token, where the sampler applies bans and stops as it always does;
only plain greedy batches with nothing waiting run several steps.
"""
from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.engine import Engine
from engine.kv_cache import BlockAllocator
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

from tests.engine.conftest import NATIVE
from tests.engine.test_bf16_decode import SHAPE
from tests.engine.test_decode_step import HELD

pytestmark = [pytest.mark.skipif(not NATIVE, reason="no native path here (a CPU without AVX-512, or DEPLOYKIT_KERNELS "
                                                    "off)"),
              pytest.mark.usefixtures("native_kernels")]  # a CPU that runs it must have it built

_STEP = kernels.decode_step_  # (each core's watch wraps the op itself, not another core's watch)

# (prompt, tokens): side by side, then the longest ones alone; runs are cut where a request reaches its max_tokens.
REQUESTS = [(list(range(40, 77)), 29), ([3, 1000, 20, 50, 90], 12), ([7, 8, 9], 20)]


def _core(model_dir: str, steps: int, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model_dir, **{"dtype": "bfloat16", "block_size": 8, "max_model_len": 256,
                                                 "decode_steps": steps, **kw}))


def _watch(core: EngineCore, monkeypatch) -> tuple[dict, list[int]]:
    """Records the logits the sampler gets, by (request, output tokens so far), and the steps asked of each native
    decode call."""
    logits: dict[tuple[str, int], torch.Tensor] = {}
    sample = core.sampler

    def sampler(x, states, argmax=None):
        for row, st in zip(x, states):
            logits[(st.params.seed, st.num_output_tokens)] = row.clone()
        return sample(x, states, argmax)

    core.sampler = sampler
    steps: list[int] = []
    monkeypatch.setattr(kernels, "decode_step_", lambda *a: steps.append(a[20] if len(a) > 20 else 1) or _STEP(*a))
    return logits, steps


def _drive(core: EngineCore, requests, banned: bool = False, **params) -> dict[str, list[int]]:
    """Runs (prompt, tokens) requests greedily to their end; banned: EOS banned throughout (min_tokens)."""
    for i, (prompt, n) in enumerate(requests):
        p = {"max_tokens": n, "temperature": 0.0, "seed": i, "min_tokens": n if banned else 0, **params}  # seed: the
        # row's key in _watch
        core.add_request(str(i), prompt, SamplingParams(**p))
    out: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("quantization,compact", HELD)
def test_a_run_of_steps_is_bitwise_the_same_steps_one_call_at_a_time(tiny_model, quantization, compact, monkeypatch):
    model_dir = tiny_model("qwen3", **SHAPE)
    results = {}
    for steps in (1, 8):
        core = _core(model_dir, steps, quantization=quantization, compact_weights=compact)
        logits, calls = _watch(core, monkeypatch)
        tokens = _drive(core, REQUESTS, banned=True)  # a run ends where the argmax is EOS, then banned
        results[steps] = tokens, logits, core.runner.kv._pool.clone(), calls
    (tokens, logits, kv, calls), (ref_tokens, ref_logits, ref_kv, ref_calls) = results[8], results[1]
    assert set(ref_calls) == {1} and max(calls) == 8 and len(calls) < len(ref_calls) / 3
    assert tokens == ref_tokens and [len(t) for t in tokens.values()] == [n for _, n in REQUESTS]
    assert torch.equal(kv, ref_kv), "a run wrote other K/V than the steps one at a time"
    # The sampler sees a run's last step only; those logits are the same steps' one at a time.
    assert 0 < len(logits) < len(ref_logits) / 3
    assert all(torch.equal(x, ref_logits[key]) for key, x in logits.items())


def test_a_run_ends_at_stop_tokens_and_the_sampler_applies_bans_and_stops_as_ever(tiny_model, monkeypatch):
    model_dir = tiny_model("qwen3", **SHAPE)
    prompt = list(range(40, 77))
    free = _drive(_core(model_dir, 1), [(prompt, 30)], ignore_eos=True)["0"]
    at = next(i for i in range(6, 30) if free[i] not in free[:i])  # a token the greedy output first makes here
    cases = [{"stop_token_ids": [free[at]]},                               # it ends the request
             {"stop_token_ids": [free[at]], "min_tokens": at + 3},          # it is banned there: the next best
             {"stop_token_ids": [free[at]], "min_tokens": at + 3, "ignore_eos": True}]
    for params in cases:
        ref = _drive(_core(model_dir, 1), [(prompt, 30)], **params)["0"]
        core = _core(model_dir, 8)
        _, calls = _watch(core, monkeypatch)
        assert _drive(core, [(prompt, 30)], **params)["0"] == ref, params
        assert max(calls) == 8
    assert ref[:at] == free[:at] and ref[at] != free[at]  # (banned, another token came)
    assert _drive(_core(model_dir, 8), [(prompt, 30)], stop_token_ids=[free[at]])["0"] == free[:at + 1]


def test_stop_strings_end_a_run_at_the_token_that_completed_them(tiny_model):
    model_dir = tiny_model("qwen3", **SHAPE)
    prompt = list(range(40, 77))
    ref = Engine(EngineConfig(model_dir, dtype="bfloat16", decode_steps=1))
    text = ref.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop and text.index(stop) > 0
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    runs = Engine(EngineConfig(model_dir, dtype="bfloat16", decode_steps=8))
    got, want = runs.generate([prompt], params)[0], ref.generate([prompt], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert len(got.token_ids) < 30 and stop not in got.text


def test_only_plain_greedy_batches_with_nothing_waiting_run_several_steps(tiny_model, monkeypatch):
    model_dir = tiny_model("qwen3", **SHAPE)
    for params in ({"temperature": 0.8}, {"logprobs": 2}, {"repetition_penalty": 1.3}):
        core = _core(model_dir, 8)
        _, calls = _watch(core, monkeypatch)
        outs = []
        core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0))
        core.add_request("b", [8, 9], SamplingParams(max_tokens=12, **params))
        while core.has_unfinished_requests():
            outs += core.step()
        assert set(calls) == {1} and all(len(o.new_token_ids) == 1 for o in outs), params
    # A request that arrives starts at the next step, beside the running one, not after a run.
    core = _core(model_dir, 8)
    _, calls = _watch(core, monkeypatch)
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0))
    while len(calls) < 3:
        core.step()
    core.add_request("b", [8, 9], SamplingParams(max_tokens=4, temperature=0.0))
    assert "b" in {o.request_id for o in core.step()} and max(calls) == 8
    # One that cannot start (max_num_seqs) waits for the run, which ends where a running request does anyway.
    ref = _drive(_core(model_dir, 1, max_num_seqs=1), [([5, 6, 7], 20), ([8, 9], 20)])
    core = _core(model_dir, 8, max_num_seqs=1)
    _, calls = _watch(core, monkeypatch)
    assert _drive(core, [([5, 6, 7], 20), ([8, 9], 20)]) == ref and calls.count(8) >= 3


def test_the_scheduler_takes_a_runs_blocks_up_front_or_runs_one_step():
    sched = Scheduler(BlockAllocator(num_blocks=6, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence("a", list(range(6)), 6, max_tokens=40, sampling=None, arrival=0)
    sched.add(a)
    batch = sched.schedule(8)
    assert batch.steps == 1 and batch.num_new_tokens == [6]  # its prompt: a prefill runs one step
    sched.computed(batch)
    a.token_ids.append(0)  # 7 tokens, 6 computed: decoding
    batch = sched.schedule(8)
    assert batch.steps == 8 and len(a.block_table) == 4  # positions 6..13: 14 tokens in blocks of 4, taken now
    sched.computed(batch, 8)
    assert a.num_computed_tokens == 14
    a.token_ids += [0] * 8
    b = Sequence("b", [1, 2], 2, max_tokens=4, sampling=None, arrival=1)
    sched.add(b)
    batch = sched.schedule(8)
    assert batch.steps == 1 and batch.seqs == [a, b]  # b waited: its prompt runs beside a's one step
    sched.computed(batch)
    b.token_ids.append(0)
    a.token_ids.append(0)
    assert len(a.block_table) == 4 and sched.allocator.num_free == 1
    assert sched.schedule(8).steps == 1  # a run needs 2 blocks more for a and 2 for b; one is free


def test_a_run_refuses_bad_arguments_by_name(tiny_model):
    core = _core(tiny_model("qwen3", **SHAPE), 8, max_model_len=64)
    m, s = core.model, core.model.config
    i32, i64 = torch.int32, torch.int64

    def run(steps=2, greedy=(2, 1), position=0, length=1, table=(0,), stops=None):
        h = torch.empty(1, s.hidden_size, dtype=torch.bfloat16)
        return kernels.decode_step_(h, m.step_weights, core.runner.kv.layers, m.windows, m.rotary.cos, m.rotary.sin,
                                    torch.tensor([position], dtype=i64), torch.tensor([list(table)], dtype=i32),
                                    torch.tensor([length], dtype=i32), torch.tensor([position], dtype=i64),
                                    s.num_heads, s.num_kv_heads, s.rms_norm_eps, 1.0, m.norm.weight, m.lm_head,
                                    torch.empty(1, s.vocab_size), torch.tensor([5]), m._table(),
                                    None if greedy is None else torch.zeros(greedy, dtype=i64), steps, stops)

    assert run() == 2 and run(steps=3, greedy=(3, 1), table=(0, 1), length=6) == 3
    assert run(steps=4, greedy=(4, 1), stops=torch.arange(s.vocab_size)) == 1  # any token stops it after one step
    for kw, message in [({"greedy": None}, "a run of more \\(got 2\\) feeds each step's greedy tokens"),
                        ({"greedy": (1,)}, "greedy must be a contiguous int64 \\[B\\] tensor \\(\\[steps, B\\]"),
                        ({"steps": 0, "greedy": (0, 1)}, "steps must be >= 1"),
                        ({"stops": torch.tensor([1.0])}, "stops must be a contiguous int64"),
                        ({"length": 8, "position": 7}, "context length 9 of row 0 is outside \\[1, 8\\]"),
                        ({"position": 63, "table": tuple(range(8)), "length": 1}, "position 64 of row 0 is outside")]:
        with pytest.raises(RuntimeError, match=message):
            run(**kw)
