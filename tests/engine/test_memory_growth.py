"""No per-request memory growth: RSS after 1,000 short requests stays where it was after the first 200.

RSS is read after malloc_trim (engine/hugepages.trim), so it counts the memory in use, not the free heap pages the
allocator kept or gave back. The engine trims once at load (the moved weights' originals); in a long-lived process
(the whole suite) later requests fault some of that free heap back in, which is not growth. A leak still shows,
and it can no longer hide in free pages that stayed resident."""

import random

import pytest

from engine import hugepages
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the native kernels' allocations too
@pytest.mark.slow
def test_rss_is_stable_over_1000_short_requests(tiny_model, dtype):
    core = EngineCore(EngineConfig(tiny_model("qwen2", hidden=128, heads=4, intermediate=256), dtype=dtype,
                                   max_model_len=128, max_num_seqs=16, kv_cache_bytes=8 << 20))
    rng = random.Random(0)
    vocab = core.model_config.vocab_size

    def run(first: int, count: int) -> None:
        for i in range(first, first + count):
            params = SamplingParams(max_tokens=rng.randint(1, 6), temperature=rng.choice([0.0, 0.8]),
                                    seed=i, logprobs=rng.choice([None, 2]), repetition_penalty=1.1,
                                    stop_token_ids=(rng.randrange(vocab),))
            core.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randint(1, 24))], params)
            if i % 7 == 0:
                core.abort_request(f"r{i}")  # aborted requests must not leak either
            while len(core.scheduler.running) + len(core.scheduler.waiting) >= 16:
                core.step()
        while core.has_unfinished_requests():
            core.step()

    run(0, 200)  # warm-up: allocator pools, lazily created kernels and caches
    hugepages.trim()
    before = rss_bytes()
    run(200, 800)
    hugepages.trim()
    after = rss_bytes()
    assert core.stats().kv_cache_usage == 0 and not core._requests
    print(f"RSS growth {(after - before) / 2**20:.2f} MiB")
    assert after - before < 2 << 20, f"RSS grew by {(after - before) / 2**20:.1f} MiB over 800 requests"
