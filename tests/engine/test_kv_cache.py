"""KV budget: admission control, preemption with recompute, abort freeing blocks, block allocator."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import BlockAllocator
from engine.sampling import SamplingParams

PROMPTS = [[11, 12, 13], list(range(40, 77)), [500 + i for i in range(17)], list(range(900, 1000, 3)),
           [7], [3, 1000, 20, 50, 90, 123, 321, 456, 654], list(range(100, 130)), [42] * 20]
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16   # tiny llama fp32: K+V x layers x kv_heads x head_dim x 4 B x 16 tokens


def _greedy(n):
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


def test_allocator_hands_out_and_takes_back_blocks():
    a = BlockAllocator(num_blocks=4, block_size=16)
    table: list[int] = []
    assert a.can_grow(table, 64) and not a.can_grow(table, 65)
    a.grow(table, 17)                        # 17 tokens need 2 blocks
    assert len(table) == 2 and a.usage() == 0.5
    a.grow(table, 32)                        # still fits in 2
    assert len(table) == 2
    a.release(table)
    assert table == [] and a.usage() == 0.0 and a.num_free == 4


def test_more_requests_than_the_kv_cache_holds_all_finish_with_unchanged_tokens(tiny_model, run_core):
    model_dir = tiny_model("llama")
    reqs = [(f"r{i}", p, _greedy(24)) for i, p in enumerate(PROMPTS)]
    roomy = run_core(EngineCore(EngineConfig(model_dir, dtype="float32")), reqs)
    # 5 blocks = 80 tokens: the longest request (37 + 24 tokens) fits alone, all eight together need ~3x that.
    tight = EngineCore(EngineConfig(model_dir, dtype="float32", kv_cache_bytes=5 * BYTES_PER_BLOCK))
    assert tight.allocator.num_blocks == 5
    assert run_core(tight, reqs, join_after=2) == roomy
    stats = tight.stats()
    assert stats.num_preemptions > 0          # growth of running sequences really hit the limit
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0 and stats.num_waiting == 0


def test_max_model_len_is_lowered_to_what_the_kv_cache_can_hold(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32", kv_cache_bytes=3 * BYTES_PER_BLOCK))
    assert core.max_model_len == 48


def test_abort_frees_the_kv_cache(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32", max_num_seqs=2))
    for i, p in enumerate(PROMPTS[:4]):
        core.add_request(f"r{i}", p, _greedy(100))
    for _ in range(3):
        core.step()
    s = core.stats()
    assert s.kv_cache_usage > 0 and s.num_running == 2 and s.num_waiting == 2
    assert core.abort_request("r0") and core.abort_request("r3")    # one running, one still waiting
    assert not core.abort_request("r0") and not core.abort_request("nope")
    assert core.stats().num_running == 1 and core.stats().num_waiting == 1
    core.abort_request("r1")
    core.abort_request("r2")
    s = core.stats()
    assert s.kv_cache_usage == 0.0 and not core.has_unfinished_requests()
    assert core.step() == []
