"""Text-level API: Engine.generate (strings, token ids, stop strings) and AsyncEngine.stream / abort."""
from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, Engine, EngineConfig, RequestError, SamplingParams  # the documented public API

PROMPTS = ["Hello, world!", "Café 日本語 🚀", "The key-value cache stores attention keys"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineConfig(tiny_model("qwen2"), dtype="float32"))


def test_generate_returns_text_tokens_and_reason(engine):
    outs = engine.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in outs] == [24, 24, 24]
    for prompt, o in zip(PROMPTS, outs):
        assert o.finish_reason == "length"
        assert o.prompt_token_ids == engine.tokenizer.encode(prompt)
        assert o.text == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    # token-id prompts and per-request params give the same greedy continuation
    again = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], [GREEDY] * 3)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert engine.core.stats().kv_cache_usage == 0.0


def test_stop_string_truncates_text_and_finishes_with_stop(engine):
    full = engine.generate([PROMPTS[0]], GREEDY)[0]
    text = full.text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3]
                and text.find(text[i:i + 3]) == i)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                      stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert len(out.token_ids) < 24 and not engine.core.has_unfinished_requests()


def test_generate_rejects_an_over_long_prompt_and_leaves_nothing_running(engine):
    with pytest.raises(RequestError, match="max_model_len"):
        engine.generate(["hi", "x" * 10], [GREEDY, SamplingParams(max_tokens=5000)])
    assert not engine.core.has_unfinished_requests()


@pytest.fixture(scope="module")
def async_engine(tiny_model):
    eng = AsyncEngine(EngineConfig(tiny_model("qwen2"), dtype="float32"))
    yield eng
    eng.shutdown()


def test_concurrent_streams_match_generate(engine, async_engine):
    expected = engine.generate(PROMPTS, GREEDY)

    async def collect(prompt):
        text, ids, outs = "", [], []
        async for out in async_engine.stream(prompt, GREEDY):
            text += out.text
            ids += out.token_ids
            outs.append(out)
        return text, ids, outs

    async def main():
        return await asyncio.gather(*(collect(p) for p in PROMPTS))

    results = asyncio.run(main())
    for exp, (text, ids, outs) in zip(expected, results):
        assert (text, ids) == (exp.text, exp.token_ids)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert outs[-1].num_output_tokens == 24


def test_abort_and_disconnect_free_the_request(async_engine):
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def main():
        reasons = []
        async for out in async_engine.stream("abort me", long, request_id="victim"):
            if out.num_output_tokens == 3:
                await async_engine.abort("victim")
            reasons.append(out.finish_reason)
        # a consumer that walks away mid-stream
        agen = async_engine.stream("walk away", long)
        await agen.__anext__()
        await agen.aclose()
        for _ in range(200):
            if async_engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        return reasons

    reasons = asyncio.run(main())
    assert reasons[-1] == "abort" and all(r is None for r in reasons[:-1])
    assert async_engine.stats().num_running == 0 and async_engine.stats().kv_cache_usage == 0.0


def test_stream_raises_request_errors(async_engine):
    async def main():
        async for _ in async_engine.stream([], GREEDY):
            pass

    with pytest.raises(RequestError, match="empty"):
        asyncio.run(main())
    assert async_engine.is_healthy
