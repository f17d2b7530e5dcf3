"""Prefix caching: full KV blocks shared by content across requests, kept after use until evicted.

The block accounting is checked directly (every block active, cached or free, reference counts back to zero, free +
cached = all blocks when idle) through preemption, n > 1 and aborts; outputs are compared token for token with the
cache on and off, on a tiny model under KV pressure and on the real model in fp32 and bf16.
"""
from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import BlockAllocator, extend_hashes
from engine.sampling import SamplingParams
from engine.sequence import Sequence

BS = 16
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * BS  # tiny llama fp32: K+V x layers x kv_heads x head_dim x 4 B x 16 tokens


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)


def _seq(tokens: list[int], rid: str = "s") -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), max_tokens=8, sampling=None, arrival=0)


def _idle(a: BlockAllocator) -> None:
    """Nothing runs: no block is referenced, and every block is free or cached."""
    a.check()
    assert a.num_active == 0 and a.num_free == a.num_blocks and a.usage() == 0.0
    assert not a._computing  # no promise of a block outlives the sequence that made it (aborts included)


def _drain(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_block_hashes_chain_on_the_parent():
    a = extend_hashes([], list(range(48)), BS, 3)
    b = extend_hashes([], [99] + list(range(1, 48)), BS, 3)  # first token differs
    assert len(a) == 3 and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, b))  # the same tokens 16..47 after another first block: other keys
    assert extend_hashes(a[:1], list(range(48)), BS, 3) == a  # extending computes only what is missing


def test_allocator_shares_cached_blocks_and_evicts_least_recently_released_first():
    a = BlockAllocator(num_blocks=6, block_size=4)
    first = _seq(list(range(10)))                       # 10 tokens: blocks of 4, 4, 2
    assert a.match(first) == []
    a.admit(first, [])
    a.grow(first.block_table, 10)
    first.num_computed_tokens = 10
    a.commit(first)                                     # two full blocks become cacheable
    assert first.num_committed_blocks == 2
    second = _seq(list(range(8)) + [50, 51, 52])        # same first 8 tokens
    hit = a.match(second)
    assert hit == first.block_table[:2]
    assert a.can_admit(hit, 11)
    a.admit(second, hit)
    assert second.num_computed_tokens == 8 and a.queries == 10 + 11 and a.hits == 8
    a.grow(second.block_table, 11)
    assert a.num_active == 4 and a.num_cached == 0      # 2 shared + 1 + 1 private
    a.release(first.block_table)
    assert a.num_active == 3 and a.num_cached == 0      # the shared blocks are still referenced by `second`
    a.release(second.block_table)
    _idle(a)
    assert a.num_cached == 2 and a.num_free == 6        # cached blocks count as free
    # Taking 5 new blocks uses the 4 never-cached ones first, then evicts one cached block: the later one (block 2
    # of the prefix) goes before the first, since tails are released ahead of their prefixes.
    table: list[int] = []
    a.grow(table, 20)
    assert a.num_cached == 1 and a.match(_seq(list(range(8)) + [7])) == hit[:1]
    a.release(table)
    _idle(a)


def test_at_least_the_last_two_prompt_tokens_are_computed():
    a = BlockAllocator(num_blocks=8, block_size=4)
    s = _seq(list(range(9)))
    a.admit(s, [])
    a.grow(s.block_table, 9)
    s.num_computed_tokens = 9
    a.commit(s)
    a.release(s.block_table)
    assert len(a.match(_seq(list(range(8))))) == 1       # 8 tokens, 2 full blocks cached: only the first is used
    assert len(a.match(_seq(list(range(10))))) == 2      # 10 tokens: 8 cached, 2 computed
    assert a.match(_seq([0])) == [] and a.match(_seq([0, 1, 2, 3, 4])) == []
    assert BlockAllocator(8, 4, prefix_caching=False).match(_seq(list(range(10)))) == []


def test_a_shared_prefix_is_prefilled_once_and_later_prompts_compute_only_the_rest(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32"))
    log = _record(core)
    system = list(range(10, 110))                       # 100 tokens: 6 full blocks
    core.add_request("a", system + [5, 6, 7], _greedy(4))
    _drain(core)
    core.add_request("b", system + [8, 9], _greedy(4))
    _drain(core)
    fed = {r: sum(n for step in log for rid, n, _ in step if rid == r) for r in ("a", "b")}
    assert fed == {"a": 103 + 3, "b": (102 - 96) + 3}  # b prefilled 6 of its 102 prompt tokens
    s = core.stats()
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (103 + 102, 96)
    assert s.kv_blocks_active == 0 and s.kv_blocks_cached > 0
    _idle(core.allocator)


def _record(core: EngineCore) -> list[list[tuple[str, int, int]]]:
    """Every step's (request, tokens fed, tokens computed before) from here on."""
    log: list[list[tuple[str, int, int]]] = []
    schedule = core.scheduler.schedule

    def record(*steps):
        batch = schedule(*steps)
        log.append([(s.request_id, n, s.num_computed_tokens) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        return batch

    core.scheduler.schedule = record
    return log


def test_chunked_prefill_composes_with_a_hit_900_of_1000_tokens_prefills_100(tiny_model):
    """With 4-token blocks, a 1,000-token prompt whose first 900 are cached feeds exactly its last 100, in chunks of
    the step budget, while another request keeps decoding."""
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32", block_size=4, max_num_batched_tokens=64))
    shared = [(7 * i) % 900 + 11 for i in range(900)]
    core.add_request("warm", shared + [1, 2, 3], _greedy(1))
    _drain(core)
    core.add_request("decoding", [3, 4, 5], _greedy(30))
    core.step()
    log = _record(core)
    core.add_request("long", shared + [(3 * i) % 500 + 20 for i in range(100)], _greedy(2))
    _drain(core)
    prefill = [(n, c, [r for r, _, _ in step]) for step in log for r, n, c in step if r == "long" and c < 1000]
    assert prefill == [(63, 900, ["decoding", "long"]), (37, 963, ["decoding", "long"])]  # 64-token budget, 1 decoding
    assert core.stats().prefix_cache_hits_total == 900
    _idle(core.allocator)


def test_eviction_makes_room_for_a_request_that_fits_without_the_cache(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32", kv_cache_bytes=6 * BYTES_PER_BLOCK))
    for i in range(3):  # 43 tokens computed each: 3 blocks while running, 2 cached after, 6 cached in all
        core.add_request(f"fill{i}", [100 * i + t for t in range(40)], _greedy(4))
        _drain(core)
    assert core.allocator.num_cached == 5 and core.allocator.num_free == 6  # the third request evicted one
    core.add_request("big", list(range(500, 590)), _greedy(4))  # 94 tokens: all 6 blocks
    out = _drain(core)
    assert len(out["big"]) == 4 and core.stats().num_preemptions == 0
    _idle(core.allocator)


PROMPTS = [[11, 12, 13], list(range(40, 77)), [500 + i for i in range(17)], list(range(900, 1000, 3)),
           [7], [3, 1000, 20, 50, 90, 123, 321, 456, 654], list(range(100, 130)), [42] * 20]
SYSTEM = list(range(200, 248))                           # 48 tokens: 3 full blocks every request shares


def _pressure(model: str, caching: bool, n: int) -> tuple[dict[str, list[int]], EngineCore]:
    """Eight requests (a shared system prompt, then their own tokens), n choices each, through a KV cache of 9
    blocks: growth preempts; two requests are aborted, one while decoding, one while still queued."""
    core = EngineCore(EngineConfig(model, dtype="float32", kv_cache_bytes=9 * BYTES_PER_BLOCK, max_num_seqs=6,
                                   prefix_caching=caching))
    ids = [f"r{i}-{c}" for i in range(len(PROMPTS)) for c in range(n)]
    for i, p in enumerate(PROMPTS[:4]):
        for c in range(n):
            core.add_request(f"r{i}-{c}", SYSTEM + p, _greedy(24))
    out: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        if steps == 3:
            for i, p in enumerate(PROMPTS[4:], 4):
                for c in range(n):
                    core.add_request(f"r{i}-{c}", SYSTEM + p, _greedy(24))
        if steps == 12:
            running = {s.request_id for s in core.scheduler.running if s.num_output_tokens > 0}
            waiting = {s.request_id for s in core.scheduler.waiting}
            assert running and waiting, "the abort cases need a decoding and a queued request"
            for rid in (min(running), max(waiting)):
                assert core.abort_request(rid)
                ids.remove(rid)
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        core.allocator.check()
    return {rid: out.get(rid, []) for rid in ids}, core


@pytest.mark.parametrize("n", [1, 2], ids=["n=1", "n=2"])
def test_under_pressure_preemption_and_aborts_keep_exact_block_accounting_and_the_same_tokens(tiny_model, n):
    model = tiny_model("llama")
    off, core_off = _pressure(model, False, n)
    on, core = _pressure(model, True, n)
    assert set(on) == set(off) and on == off
    assert all(len(t) == 24 for t in on.values())
    s = core.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits_total >= 3 * BS  # pressure and hits both happened
    _idle(core.allocator)
    _idle(core_off.allocator)
    assert core_off.allocator.num_cached == 0 and core.allocator.num_cached > 0


def test_identical_requests_arriving_together_compute_their_prompt_once(tiny_model):
    """n > 1, or a burst of chats with one system prompt: the first computes the shared blocks, the others wait one
    step for them instead of computing them again, then take them from the cache."""
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32"))
    log = _record(core)
    prompt = list(range(300, 340))                      # 2 full blocks + 8 tokens
    for c in range(3):
        core.add_request(f"c{c}", prompt, _greedy(5))
    out = _drain(core)
    assert len({tuple(t) for t in out.values()}) == 1
    assert log[0] == [("c0", 40, 0)] and log[1] == [("c0", 1, 40), ("c1", 8, 32), ("c2", 8, 32)]
    assert core.stats().prefix_cache_hits_total == 2 * 32
    _idle(core.allocator)
    assert core.allocator.num_cached == 2               # one copy of the shared blocks (44 tokens computed each)
    core.add_request("later", prompt, _greedy(5))
    assert _drain(core)["later"] == out["c0"] and core.stats().prefix_cache_hits_total == 3 * 32
    _idle(core.allocator)


def test_a_chat_turn_reuses_the_prefilled_blocks_of_the_last_one_and_a_reply_once_it_was_prefilled(tiny_model):
    """Blocks filled while decoding are not cached (decode's K/V differ in the last bits from prefill's): the next
    turn reuses the previous prompt's blocks and prefills the reply, which the turn after reuses."""
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32"))
    turn1 = list(range(20, 40))                         # 20 tokens: 1 full block
    core.add_request("t1", turn1, _greedy(30))
    turn2 = turn1 + _drain(core)["t1"] + [5, 6, 7]      # 53 tokens: 3 full blocks, 2 of them filled while decoding
    core.add_request("t2", turn2, _greedy(3))
    _drain(core)
    assert core.stats().prefix_cache_hits_total == 16
    core.add_request("t3", turn2 + [8, 9], _greedy(3))
    _drain(core)
    assert core.stats().prefix_cache_hits_total == 16 + 48
    _idle(core.allocator)


# ---- the real model ----

SYSTEM_PROMPT = ("You are a careful assistant for a company that builds deployment tools for language models on CPU "
                 "servers. Answer in one or two short sentences, plainly, without lists or markdown. If a question is "
                 "about hardware, mention the relevant CPU feature by name (AVX-512, AMX, NUMA) when it matters. If "
                 "you do not know the answer, say so instead of guessing. Keep units explicit and prefer numbers to "
                 "adjectives. The user is an engineer who reads quickly and wants the conclusion first, then the "
                 "reason. Never repeat the question back. ") * 2
FOLLOW_UP = "Say that again in fewer words."
TURN_TOKENS = 24
REAL_PATHS = {  # name -> (dtype, engine config)
    "fp32": ("float32", {"max_num_seqs": 4}),
    "bf16, fused decode step": ("bfloat16", {"max_num_seqs": 4}),
    # 32-token chunks leave some prompts' last token alone in a chunk, and the cache moves where chunks end: that token
    # is prefill (model_runner._decodes), never the decode attention kernel, which rounds differently (it flipped q7
    # at token 10 and 3 of 32 requests of 16 chats until 2026-11-28).
    "bf16, chunked prefill (32-token chunks)": ("bfloat16", {"max_num_seqs": 4, "max_num_batched_tokens": 32}),
    "bf16 dequantized, chunked prefill": ("bfloat16", {"max_num_seqs": 4, "max_num_batched_tokens": 32,
                                                      "quantization": "dequantize"}),
}


def _chat(tok, *messages: str) -> list[int]:
    roles = ["system"] + ["user", "assistant"] * len(messages)
    text = tok.apply_chat_template([{"role": r, "content": m} for r, m in zip(roles, (SYSTEM_PROMPT, *messages))],
                                   tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _conversations(core: EngineCore, tok) -> dict[str, list[int]]:
    """The first chat alone (it computes the system prompt), the other fifteen together (four run at a time), then
    each chat's second turn: its first prompt + reply + a follow-up, as token ids, so its first turn is a prefix of
    it."""
    from tests.engine.fidelity import CHAT
    first = [_chat(tok, q) for q in CHAT]
    out: dict[str, list[int]] = {}
    for wave in ([0], range(1, len(first))):
        for i in wave:
            core.add_request(f"q{i}", first[i], _greedy(TURN_TOKENS))
        out |= _drain(core)
    follow = tok.encode(f"<|im_end|>\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    for i in range(len(first)):
        core.add_request(f"t{i}", first[i] + out[f"q{i}"] + follow, _greedy(TURN_TOKENS))
    return out | _drain(core)


@pytest.mark.slow
@pytest.mark.parametrize("path", list(REAL_PATHS))
def test_real_model_outputs_are_the_same_tokens_with_the_cache_on_and_off(smollm2, path, native_kernels):
    from engine import tokenizer as tokenizers
    tok = tokenizers.load(smollm2)
    dtype, config = REAL_PATHS[path]
    runs = {}
    for caching in (False, True):
        core = EngineCore(EngineConfig(smollm2, dtype=dtype, max_model_len=2048, prefix_caching=caching, **config))
        assert core.model.step_weights is not None  # decode steps run fused: decode_step.cpp, fp32 its _f32 twin
        runs[caching] = _conversations(core, tok), core.stats()
        _idle(core.allocator)
    (off, _), (on, stats) = runs[False], runs[True]
    system_blocks = len(_chat(tok, "")) // BS - 1
    assert stats.prefix_cache_hits_total >= 15 * system_blocks * BS  # every later first turn reused the system prompt
    assert stats.prefix_cache_hits_total >= stats.prefix_cache_queries_total // 2
    for rid in off:
        assert on[rid] == off[rid], f"{rid} differs at token {next(i for i, (a, b) in enumerate(zip(on[rid], off[rid])) if a != b)}"
