"""Continuous batching: joins between steps, chunked prefill that does not stall decoding, batch limits."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import BlockAllocator
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def _greedy(n):
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


def test_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32", max_num_batched_tokens=16))
    core.add_request("short", [5, 6, 7], _greedy(60))
    core.step()
    core.step()
    core.add_request("long", list(range(10, 310)), _greedy(5))     # 300 tokens = 19 chunks of <= 15
    steps_until_long_starts = 0
    while True:
        produced = {o.request_id for o in core.step()}
        assert "short" in produced                 # a decode token every single step
        steps_until_long_starts += 1
        if "long" in produced:
            break
    assert steps_until_long_starts >= 300 // 15


def test_max_num_seqs_bounds_the_running_batch(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32", max_num_seqs=3))
    for i in range(7):
        core.add_request(str(i), [20 + i, 30, 40], _greedy(4 + i))
    done = {}
    while core.has_unfinished_requests():
        for o in core.step():
            if o.finished:
                done[o.request_id] = o.finish_reason
        assert core.stats().num_running <= 3
    assert done == {str(i): "length" for i in range(7)}


def test_scheduler_keeps_each_step_within_the_token_budget_and_decodes_first():
    sched = Scheduler(BlockAllocator(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=8)
    seqs = [Sequence(str(i), list(range(20 + i)), 20 + i, max_tokens=3, sampling=None, arrival=i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        steps += 1
        assert 0 < sum(batch.num_new_tokens) <= 8
        decoding = [s.is_decoding for s in batch.seqs]
        assert decoding == sorted(decoding, reverse=True)          # decodes ahead of prefill chunks
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:              # reached the end: one new token sampled
                s.token_ids.append(0)
                if s.num_output_tokens == s.max_tokens:
                    sched.finish(s, "length")
    assert steps >= sum(20 + i for i in range(4)) // 8
    assert sched.allocator.usage() == 0.0
