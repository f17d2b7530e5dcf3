"""The sampling controls clients send change what comes back (not merely accepted), and odd values stay 4xx/200."""
from __future__ import annotations

import openai
import pytest

PROMPT = "The quick brown fox"


def complete(client, **kw):
    """A greedy-by-default completion of PROMPT."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
            "extra_body": {"ignore_eos": True, **kw.pop("extra_body", {})}, **kw}
    return client.completions.create(**body)


def test_top_k_1_and_min_p_1_sample_the_greedy_token(client):
    greedy = complete(client).choices[0].text
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = complete(client, temperature=1.0, seed=3, extra_body=extra)
        assert r.choices[0].text == greedy, extra


def test_min_tokens_holds_back_stop_tokens(client, tokenizer):
    """Every token but the prompt's is a stop token: without min_tokens the first token ends the request, with
    min_tokens=6 the first 6 come from the few allowed ones."""
    allowed = set(tokenizer.encode(PROMPT, add_special_tokens=False))
    stops = [t for t in range(len(tokenizer)) if t not in allowed]
    early = complete(client, extra_body={"stop_token_ids": stops})
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    held = complete(client, extra_body={"stop_token_ids": stops, "min_tokens": 6})
    assert held.usage.completion_tokens >= 6


def test_top_k_beyond_int64_is_just_no_limit(client, server):
    """top_k = 2**63 does not fit a tensor; it must mean "all tokens", not a 500 that fails the whole batch."""
    # ignore_eos: with random weights an end token may come first, depending on the host's dtype
    r = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "top_k": 2**63,
                                        "temperature": 1.0, "seed": 1, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    again = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "top_k": 2**63,
                                            "temperature": 1.0, "seed": 1, "ignore_eos": True})
    assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]  # still seeded


def test_too_many_stop_strings_is_a_400(server):
    r = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                        "stop": [f"s{i}" for i in range(33)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_streamed_chat_reports_usage_when_asked(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True, temperature=0.0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
