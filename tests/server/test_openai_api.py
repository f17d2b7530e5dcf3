"""The OpenAI API as the official `openai` client sees it, against a live server on a tiny model."""
from __future__ import annotations

import os

import httpx
import pytest

from deploykit import cpulist, hostsettings
from deploykit.binding_report import BindingReport
from tests.server.conftest import MAX_MODEL_LEN

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def chat(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def test_completion_text_usage_and_finish_reason(client, tokenizer):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **GREEDY)
    (c,) = r.choices
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert c.finish_reason == "length" and c.text
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_uses_the_chat_template(client, tokenizer):
    msgs = chat("Hello!")
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, **GREEDY)
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_max_tokens_defaults_match_openai(client, tokenizer):
    """Chat: max_completion_tokens wins, and without either the rest of the context. Completions: 16 without
    max_tokens (OpenAI's and vLLM's default), the rest of the context with an explicit null."""
    r = client.chat.completions.create(model="tiny", messages=chat("hi"), max_completion_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3
    r = client.chat.completions.create(model="tiny", messages=chat("hi"), **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == MAX_MODEL_LEN
    r = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=None, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == MAX_MODEL_LEN


def test_streamed_completion_equals_the_blocking_one(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, **GREEDY)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_streamed_chat_starts_with_the_role_and_equals_the_blocking_one(client):
    full = client.chat.completions.create(model="tiny", messages=chat("Count"), max_tokens=10, **GREEDY)
    chunks = list(client.chat.completions.create(model="tiny", messages=chat("Count"), max_tokens=10, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_n_choices_are_distinct_and_counted(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3
    assert r.usage.completion_tokens == 24
    streamed = list(client.chat.completions.create(model="tiny", messages=chat("x"), max_tokens=5, n=2,
                                                   stream=True, **GREEDY))
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length"}


def test_prompt_counted_once_for_n_choices(client, tokenizer):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, **GREEDY)
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) and r.usage.completion_tokens == 8


def test_stop_string_cuts_the_text_and_frees_the_request(client, server):
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    want = base[: base.index(stop)]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop], **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=stop, stream=True,
                                              **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_sampling(client):
    def run(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely token
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3, stream=True,
                                              **GREEDY))
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=5, logprobs=True,
                                       top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob <= 0
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(t.bytes).decode(errors="replace") == t.token
    plain = client.chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_vllm_sampling_extensions_are_accepted(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=1,
                                  presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 6})
    assert r.usage.completion_tokens == 6


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, **GREEDY)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def test_token_id_prompts_and_batches(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, **GREEDY)
    by_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], max_tokens=3, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text[: len(batch.choices[0].text)]


def test_models_tokenize_detokenize_version(server, tokenizer):
    (card,) = server.get("/v1/models").json()["data"]
    assert (card["id"], card["max_model_len"]) == ("tiny", MAX_MODEL_LEN)
    tok = server.post("/tokenize", {"prompt": PROMPT}).json()
    assert tok == {"tokens": tokenizer.encode(PROMPT), "count": len(tokenizer.encode(PROMPT)),
                   "max_model_len": MAX_MODEL_LEN}
    assert server.post("/detokenize", {"tokens": tok["tokens"]}).json() == {"prompt": PROMPT}
    assert server.get("/version").json()["version"]


def test_metrics_follow_the_requests(client, server):
    before = server.metric("deploykit_generation_tokens_total")
    ttft = server.metric("deploykit_time_to_first_token_seconds_count")
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, **GREEDY)
    assert server.metric("deploykit_generation_tokens_total") - before == 7
    assert server.metric("deploykit_time_to_first_token_seconds_count") == ttft + 1
    assert server.metric("deploykit_inter_token_latency_seconds_count") >= 6
    assert server.metric("deploykit_prompt_tokens_total") > 0
    assert server.metric("deploykit_num_requests_running") == 0
    assert server.metric("deploykit_kv_cache_usage_ratio") == 0
    assert server.metric("deploykit_engine_up") == 1


def test_the_metrics_port_serves_the_same_metrics_and_no_api(server):
    """What the chart's NetworkPolicy opens to the monitoring namespace: /metrics, and nothing of the API."""
    scrape = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10)
    assert scrape.status_code == 200 and "deploykit_engine_up" in scrape.text
    generated = server.metric("deploykit_generation_tokens_total")  # through the API port
    assert f'deploykit_generation_tokens_total{{model_name="tiny"}} {generated}' in scrape.text
    post = httpx.post(f"http://127.0.0.1:{server.metrics_port}/v1/completions", json={"model": "tiny"}, timeout=10)
    assert post.status_code == 405  # no such method there: the API is only on the API port


def test_prefix_cache_metrics_count_a_repeated_prompt(client, server):
    prompt = [(37 * i) % 900 + 50 for i in range(40)]  # 2 full 16-token blocks a repeat may reuse, 8 more tokens
    queries = server.metric("deploykit_prefix_cache_queries_total")
    hits = server.metric("deploykit_prefix_cache_hits_total")
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY).choices[0].text
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY).choices[0].text == first
    assert server.metric("deploykit_prefix_cache_queries_total") - queries == 80
    assert server.metric("deploykit_prefix_cache_hits_total") - hits == 32
    blocks = {s: server.metric("deploykit_kv_cache_blocks", state=s) for s in ("active", "cached", "free")}
    assert blocks["active"] == 0 and blocks["cached"] >= 2 and blocks["free"] > 0


def test_debug_binding_reports_the_engine_process(server):
    rep = server.get("/debug/binding").json()
    engine = rep["engine"]
    assert engine["pid"] != server.proc.pid and rep["frontend"]["pid"] == server.proc.pid
    omp = [t for t in engine["threads"] if t["omp_thread"] is not None]
    assert len(omp) == engine["omp_threads"] >= 1
    assert set(cpulist.parse(engine["planned_cpus"])) <= os.sched_getaffinity(0)
    # each OpenMP thread's L3 group, from the host's cache files (this host: one L3 shared by its CPUs)
    groups = {g["id"]: set(cpulist.parse(g["cpus"])) for g in engine["topology"]["l3_groups"]}
    assert groups and all(int(cpulist.parse(t["allowed_cpus"])[0]) in groups[t["l3"]] for t in omp)
    # where the weights sit: one arena, and how much of it the kernel put on 2 MiB pages (engine/hugepages.py)
    pages = engine["weights"]["pages"]
    assert pages["asked"] and pages["bytes"] > 0 and pages["thp"] == (hostsettings.thp_mode() or "unknown")
    # only whole 2 MiB pages ask (this tiny model's weights fill less than one): never more than those
    assert 0 <= pages["huge_bytes"] <= pages["bytes"] // (2 << 20) * (2 << 20)
    # the JSON form reads back as deploykit's own type, the one doctor, status and `helm test` read
    assert BindingReport.from_dict(rep).to_dict() == rep
