"""Greedy output of the native models equals transformers' own generate(), token for token."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams
from tests.engine.conftest import next_token_logprobs

N_TOKENS = 40
# Mixed lengths: one fits a single block, others span several blocks and a partial one.
PROMPTS = [[11, 12, 13], list(range(40, 77)), [500 + i for i in range(17)], list(range(900, 1000, 3)),
           [7], [3, 1000, 20, 50, 90, 123, 321, 456, 654]]

ARCHS = {
    "llama": {},
    "llama3-rope": {"arch": "llama", "rope_scaling": "llama3", "max_position_embeddings": 4096},
    "llama-biases": {"arch": "llama", "extra_config": {"attention_bias": True, "mlp_bias": True}},
    "mistral": {"arch": "mistral", "heads": 8, "kv_heads": 2},
    # Mistral v0.1's sliding window, shorter than most prompts + 40 tokens and than the prefill chunks.
    "mistral-window": {"arch": "mistral", "heads": 8, "kv_heads": 2, "extra_config": {"sliding_window": 12}},
    "qwen2": {"arch": "qwen2", "kv_heads": 1},
    "qwen3": {"arch": "qwen3", "head_dim": 32},
    "qwen2-tied": {"arch": "qwen2", "tie_word_embeddings": True},   # bf16: lm_head packed, embeddings read from it
}


def _greedy_requests(prompts, n=N_TOKENS):
    # min_tokens = max_tokens keeps EOS out on both sides, exactly like generate(min_new_tokens=...).
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    return [(f"r{i}", p, params) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.slow
def test_greedy_matches_transformers_fp32_with_requests_joining_mid_flight(tiny_model, hf_greedy, run_core, name):
    kwargs = dict(ARCHS[name])
    model_dir = tiny_model(kwargs.pop("arch", "llama"), **kwargs)
    expected = hf_greedy(model_dir, PROMPTS, N_TOKENS)
    core = EngineCore(EngineConfig(model_dir, dtype="float32", max_num_batched_tokens=64))
    got = run_core(core, _greedy_requests(PROMPTS), join_after=3)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert core.stats().kv_cache_usage == 0.0


def test_chunked_prefill_gives_the_same_tokens_as_whole_prompt_prefill(tiny_model, run_core):
    model_dir = tiny_model("qwen3", head_dim=32)
    reqs = _greedy_requests(PROMPTS, 24)
    whole = run_core(EngineCore(EngineConfig(model_dir, dtype="float32")), reqs)
    # 5-token budget: every prompt above 5 tokens is split, and chunks share steps with decodes.
    chunked = run_core(EngineCore(EngineConfig(model_dir, dtype="float32", max_num_batched_tokens=5)), reqs)
    assert chunked == whole


@pytest.mark.parametrize("prompts", [PROMPTS[1:2], PROMPTS[:4]], ids=["one-sequence", "batch"])
@pytest.mark.slow
def test_sliding_window_with_chunked_prefill_matches_transformers(tiny_model, hf_greedy, run_core, prompts):
    """Window 12 < prompts: prefill chunks of 5 attend to cached keys partly behind the window, and decode
    runs alone (the one-sequence slice) or batched (the padded mask)."""
    kwargs = dict(ARCHS["mistral-window"])
    model_dir = tiny_model(kwargs.pop("arch"), **kwargs)
    expected = hf_greedy(model_dir, prompts, 24)
    core = EngineCore(EngineConfig(model_dir, dtype="float32", max_num_batched_tokens=5))
    assert core.model_config.sliding_window == 12 and len(core.model_config.sliding_layers) == core.model_config.num_layers
    got = run_core(core, _greedy_requests(prompts, 24))
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected


def test_sharded_checkpoint_with_tied_embeddings_loads_and_matches(tiny_model, hf_greedy, run_core):
    model_dir = tiny_model("qwen2", tie_word_embeddings=True, max_shard_size="100KB")
    import os
    assert os.path.exists(os.path.join(model_dir, "model.safetensors.index.json"))
    assert not os.path.exists(os.path.join(model_dir, "model.safetensors"))
    expected = hf_greedy(model_dir, PROMPTS[:3], N_TOKENS)
    core = EngineCore(EngineConfig(model_dir, dtype="float32"))
    got = run_core(core, _greedy_requests(PROMPTS[:3]))
    assert [got[f"r{i}"] for i in range(3)] == expected


def test_opt_runs_through_the_transformers_fallback_with_identical_tokens(tiny_model, hf_greedy, run_core):
    model_dir = tiny_model("opt")
    core = EngineCore(EngineConfig(model_dir, dtype="float32", max_num_batched_tokens=16))
    assert not core.model.native
    expected = hf_greedy(model_dir, PROMPTS[:4], 24)
    got = run_core(core, _greedy_requests(PROMPTS[:4], 24), join_after=2)
    assert [got[f"r{i}"] for i in range(4)] == expected


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2-tied"])
def test_bf16_logprobs_are_as_close_to_fp32_as_transformers_own_bf16(tiny_model, name):
    """Reference: transformers fp32. Our bf16 error may not exceed 2x transformers' bf16 error (both round
    weights and activations to 8 mantissa bits), plus 0.01 nats of slack for differently ordered sums."""
    from transformers import AutoModelForCausalLM
    kwargs = dict(ARCHS[name])
    model_dir = tiny_model(kwargs.pop("arch", "llama"), init_std=0.1, **kwargs)
    ours = next_token_logprobs(EngineCore(EngineConfig(model_dir, dtype="bfloat16")), PROMPTS)
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    err_ours = err_hf = 0.0
    with torch.inference_mode():
        for i, p in enumerate(PROMPTS):
            ref = torch.log_softmax(hf32(torch.tensor([p])).logits[0, -1].float(), -1)
            hf_bf16 = torch.log_softmax(hf16(torch.tensor([p])).logits[0, -1].float(), -1)
            ids = torch.tensor([t for t, _ in ours[i].top])
            mine = torch.tensor([lp for _, lp in ours[i].top])
            err_ours = max(err_ours, (mine - ref[ids]).abs().max().item())
            err_hf = max(err_hf, (hf_bf16[ids] - ref[ids]).abs().max().item())
    assert err_ours <= 2 * err_hf + 0.01, (err_ours, err_hf)
