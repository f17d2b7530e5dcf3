"""bf16 decode, step by step, against transformers in fp32: the native path (packed GEMV at M = 1..3, paged decode
attention reading bf16 K/V in place, fused norm/rotary/SiLU) stays as close as transformers' own bf16."""
from __future__ import annotations


import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from tests.engine.conftest import NATIVE
from engine.sampling import SamplingParams

STEPS = 12
PROMPTS = [list(range(40, 77)), [500 + i for i in range(17)], [3, 1000, 20, 50, 90]]
# head_dim 32 (hidden 128 / 4 heads): the native decode attention's smallest supported head size.
SHAPE = {"hidden": 128, "heads": 4, "intermediate": 256, "init_std": 0.1}
VARIANTS = {
    "llama3-rope": {"arch": "llama", "rope_scaling": "llama3", "max_position_embeddings": 4096},
    "mistral-window": {"arch": "mistral", "kv_heads": 2, "extra_config": {"sliding_window": 10}},
    "qwen2-biases": {"arch": "qwen2", "kv_heads": 1},
    "qwen3-qk-norm": {"arch": "qwen3"},
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.slow
def test_bf16_decode_steps_stay_as_close_to_fp32_as_transformers_bf16(tiny_model, name, request):
    """On an AVX-512 CPU the native path is the one tested (a missing build fails); elsewhere the PyTorch path."""
    from transformers import AutoModelForCausalLM

    from engine import kernels
    if NATIVE:
        request.getfixturevalue("native_kernels")
    kw = dict(VARIANTS[name])
    model_dir = tiny_model(kw.pop("arch"), **SHAPE, **kw)
    core = EngineCore(EngineConfig(model_dir, dtype="bfloat16"))
    if NATIVE:
        assert kernels.status()["path"].startswith("native"), kernels.status()
        assert kernels.decode_attention_supported(torch.zeros(1, 4, 32, dtype=torch.bfloat16))
    params = SamplingParams(max_tokens=STEPS, min_tokens=STEPS, temperature=0.0, logprobs=8)
    for i, p in enumerate(PROMPTS):  # all three decode together: M = 3 rows per matmul
        core.add_request(str(i), p, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    tops: dict[int, list] = {i: [] for i in range(len(PROMPTS))}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[int(out.request_id)] += out.new_token_ids
            tops[int(out.request_id)] += [lp.top for lp in out.logprobs]
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    err_ours = err_hf = 0.0
    with torch.inference_mode():
        for i, p in enumerate(PROMPTS):
            seq = torch.tensor([p + tokens[i][:-1]])  # teacher-forced on our own tokens
            ref = torch.log_softmax(hf32(seq).logits[0, len(p) - 1:].float(), -1)   # [STEPS, V]
            bf = torch.log_softmax(hf16(seq).logits[0, len(p) - 1:].float(), -1)
            assert len(tops[i]) == STEPS == ref.shape[0]
            for step, top in enumerate(tops[i]):
                ids = torch.tensor([t for t, _ in top])
                mine = torch.tensor([lp for _, lp in top])
                err_ours = max(err_ours, (mine - ref[step, ids]).abs().max().item())
                err_hf = max(err_hf, (bf[step, ids] - ref[step, ids]).abs().max().item())
    assert err_ours <= 2 * err_hf + 0.02, (err_ours, err_hf)
