"""EngineCore request validation, finish reasons (EOS, stop_token_ids, length, context) and counters."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import RequestError
from engine.sampling import SamplingParams

PROMPT = [3, 1000, 20, 50, 90, 123, 321]


def _collect(core, rid):
    toks, last = [], None
    while core.has_unfinished_requests():
        for o in core.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                last = o
    return toks, last


@pytest.fixture(scope="module")
def core(tiny_model):
    return EngineCore(EngineConfig(tiny_model("llama"), dtype="float32", max_model_len=64))


def test_over_long_request_is_rejected_with_both_numbers(core):
    with pytest.raises(RequestError) as e:
        core.add_request("x", list(range(10, 60)), SamplingParams(max_tokens=20))
    assert "50" in str(e.value) and "20" in str(e.value) and "64" in str(e.value)
    with pytest.raises(RequestError, match="64"):
        core.add_request("y", list(range(64)), SamplingParams(max_tokens=None))
    assert not core.has_unfinished_requests()


def test_bad_prompts_are_rejected(core):
    with pytest.raises(RequestError, match="empty"):
        core.add_request("e", [], SamplingParams())
    with pytest.raises(RequestError, match="vocabulary"):
        core.add_request("v", [1, 10**6], SamplingParams())
    core.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="already in use"):
        core.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    _collect(core, "dup")


def test_max_tokens_none_generates_to_the_end_of_the_context(core):
    core.add_request("n", PROMPT, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    toks, last = _collect(core, "n")
    assert len(toks) == 64 - len(PROMPT) and last.finished and last.finish_reason == "length"


def test_stop_token_ids_finish_with_stop_and_include_the_token(core):
    core.add_request("a", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    full, _ = _collect(core, "a")
    stop = full[6]
    core.add_request("b", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=(stop,)))
    toks, last = _collect(core, "b")
    assert toks == full[:full.index(stop) + 1] and last.finish_reason == "stop"


def test_eos_from_generation_config_stops_unless_ignored(tiny_model, tmp_path):
    src = tiny_model("llama")
    core = EngineCore(EngineConfig(src, dtype="float32"))
    core.add_request("a", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    full, _ = _collect(core, "a")
    eos = full[4]
    model_dir = shutil.copytree(src, tmp_path / "m")
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos]}, f)
    core = EngineCore(EngineConfig(str(model_dir), dtype="float32"))
    assert eos in core.eos_token_ids
    core.add_request("b", PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
    toks, last = _collect(core, "b")
    assert toks == full[:full.index(eos) + 1] and last.finish_reason == "stop"
    core.add_request("c", PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    toks, last = _collect(core, "c")
    assert len(toks) == 12 and last.finish_reason == "length"


def test_stats_count_tokens_and_report_queue_lengths(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("llama"), dtype="float32", max_num_seqs=1))
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    core.add_request("b", [4, 5], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    core.step()
    s = core.stats()
    assert (s.num_running, s.num_waiting) == (1, 1) and 0 < s.kv_cache_usage < 1
    while core.has_unfinished_requests():
        core.step()
    s = core.stats()
    assert s.prompt_tokens_total == 5 and s.generation_tokens_total == 6
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)


def test_seeded_sampling_is_reproducible_across_batches(core):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    core.add_request("s1", PROMPT, p)
    alone, _ = _collect(core, "s1")
    core.add_request("other", [9, 9, 9], SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
    core.add_request("s2", PROMPT, p)
    batched, _ = _collect(core, "s2")
    assert alone == batched
