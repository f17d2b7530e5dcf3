"""Text-level API: Engine.generate (strings, token ids, stop strings); the server streams through the same text
layer (engine.outputs)."""
from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, RequestError, SamplingParams  # the documented public API

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
    with pytest.raises(RequestError, match="maximum context length is 2048 tokens"):
        engine.generate(["hi", "x" * 10], [GREEDY, SamplingParams(max_tokens=5000)])
    assert not engine.core.has_unfinished_requests()
