"""fp32 activations times bf16 weights widened in registers (engine/kernels/bf16w_linear.cpp, in every build): what a
CPU without bf16 units runs a bf16 checkpoint's matrices on, held in bf16 (deploykit.memory.held_dtype). Held to an
fp64 evaluation of the product, to itself across batch sizes and thread counts, and, through a model, to the same
model with its weights held widened to fp32."""
from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import next_token_logprobs

# One fp32 FMA chain per output over K: its error stays far below this share of sum |x w| at these K.
RTOL = 1e-5


def exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 x w^T (+ bias), and the scale the error is measured against: sum |x w| per output (+ |bias|)."""
    xd, wd = x.double(), w.double()
    y, scale = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        y, scale = y + bias.double(), scale + bias.double().abs()
    return y, scale


# Up to 4 rows the weights are widened in registers; beyond, in 128-k chunks for blocks of 64 rows in 6-row tiles,
# and from 128 rows (their activations packed tile by tile first) in tasks of one block x a few groups that threads
# take as they come free: m and k cover whole and partial tiles, blocks, tasks and chunks (k 1000 = 7 chunks + 104,
# k 30 one partial chunk).
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 17, 70, 150])
@pytest.mark.parametrize("n,k,with_bias", [(16, 2, False), (48, 64, True), (896, 896, True), (32, 4864, False),
                                           (80, 30, True), (48, 1000, True)])
def test_matches_the_fp64_product(f32_kernels, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 7919 + n * k)
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) if with_bias else None
    y = f32_kernels.linear(x, f32_kernels.prepare_bf16w(w), bias)
    ref, scale = exact(x, w, bias)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    err = ((y.double() - ref).abs() / scale).max().item()
    assert err < RTOL, f"relative error {err:.3g}"
    # The PyTorch reference the engine falls back to computes the same product (MKL's order of sums).
    fallback = f32_kernels.fallback_linear(x, f32_kernels.prepare_bf16w(w), bias)
    assert ((fallback.double() - ref).abs() / scale).max().item() < RTOL


@pytest.mark.parametrize("k", [896, 1000])
def test_a_rows_output_does_not_depend_on_its_batch_or_the_thread_count(f32_kernels, k):
    """The decode path (<= 4 rows) and the blocked one (more, packed from 128) run each output's chain in the same
    order: a prompt's rows in a 512-token prefill equal the same rows decoded one at a time, bit for bit."""
    g = torch.Generator().manual_seed(3)
    w = f32_kernels.prepare_bf16w(torch.randn(112, k, generator=g).bfloat16())  # 7 column groups: odd pairs
    bias = torch.randn(112, generator=g)
    x = torch.randn(133, k, generator=g)
    alone = torch.cat([f32_kernels.linear(x[i:i + 1], w, bias) for i in range(133)])
    for m in (2, 3, 4, 5, 6, 7, 16, 19, 64, 65, 133):
        assert torch.equal(f32_kernels.linear(x[:m], w, bias), alone[:m]), f"batch of {m}"
    no_bias = torch.cat([f32_kernels.linear(x[i:i + 1], w) for i in range(19)])
    assert torch.equal(f32_kernels.linear(x[:19], w), no_bias)
    # rows that lie apart (a view of wider rows): the packing reads them at their stride
    wide = torch.zeros(133, k + 24)
    wide[:, :k] = x
    assert torch.equal(torch.ops.deploykit.linear_bf16w(wide[:, :k], w, bias), alone)
    # Past 4 rows threads take column groups in runs as they come free (kernels/runs.h): any hand-out, the same bits.
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            for m in (16, 64, 133):
                assert torch.equal(f32_kernels.linear(x[:m], w, bias), alone[:m]), f"{t} threads, batch of {m}"
    finally:
        torch.set_num_threads(threads)


def test_linear_takes_any_leading_shape_and_strided_rows(f32_kernels):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 96, generator=g).bfloat16()
    packed = f32_kernels.prepare_bf16w(w)
    wide = torch.randn(2, 3, 128, generator=g)
    x = wide[..., :96]  # rows 128 apart: made contiguous on the way in
    y = f32_kernels.linear(x, packed)
    assert y.shape == (2, 3, 64)
    assert torch.equal(y, f32_kernels.linear(x.contiguous().view(6, 96), packed).view(2, 3, 64))
    ref, scale = exact(x.reshape(6, 96), w, None)
    assert ((y.reshape(6, 64).double() - ref).abs() / scale).max().item() < RTOL
    logits = f32_kernels.logits(x.reshape(6, 96), packed)
    assert logits.dtype == torch.float32 and torch.equal(logits, y.reshape(6, 64))


def test_bad_operands_are_refused_with_what_is_wrong(f32_kernels):
    op = torch.ops.deploykit.linear_bf16w
    w = f32_kernels.prepare_bf16w(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="must be packed"):
        op(torch.randn(1, 64), torch.randn(32, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="x must be a 2-D fp32 tensor"):
        op(torch.randn(1, 64).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="x has K=48, the weight has K=64"):
        op(torch.randn(1, 48), w, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[N\]"):
        op(torch.randn(1, 64), w, torch.randn(31))
    assert op(torch.empty(0, 64), w, None).shape == (0, 32)


PROMPTS = [[11, 12, 13], list(range(40, 77)), [7], [3, 1000, 20, 50, 90, 123, 321, 456, 654]]


@pytest.mark.parametrize("kwargs", [{"arch": "llama", "extra_config": {"attention_bias": True, "mlp_bias": True}},
                                    {"arch": "qwen2", "tie_word_embeddings": True}], ids=["llama-biases", "qwen2-tied"])
def test_a_bf16_checkpoint_runs_in_fp32_from_its_bf16_weights(f32_kernels, tiny_model, kwargs):
    """Every matrix stays bf16 (half the bytes, as the planner counts them) and the model computes what transformers
    does in fp32 on the same weights: next-token log-probabilities within fp32 rounding."""
    from transformers import AutoModelForCausalLM

    from deploykit import memory
    from engine.config import EngineConfig
    from engine.core import EngineCore
    kwargs = dict(kwargs)
    model_dir = tiny_model(kwargs.pop("arch"), dtype="bfloat16", init_std=0.1, **kwargs)
    core = EngineCore(EngineConfig(model_dir, dtype="float32"))
    paths = core.model.weight_paths["BF16"]
    shape = memory.shape(type("S", (), {"source": model_dir, "revision": None, "architecture": None})())
    matrices = sum(len(dims) == 2 for _, dims in shape.tensors)
    assert paths["bfloat16, widened to float32 in registers"] == matrices, paths
    assert core.model.weight_bytes == shape.weight_bytes("float32", "none", False, True)
    assert core.model.weight_bytes < 0.6 * shape.weight_bytes("float32")  # the 1-D norms and biases stay fp32
    ours = next_token_logprobs(core, PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for i, p in enumerate(PROMPTS):
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1)
            ids = torch.tensor([t for t, _ in ours[i].top])
            mine = torch.tensor([lp for _, lp in ours[i].top])
            assert ids[0] == ref.argmax()
            assert (mine - ref[ids]).abs().max().item() < 1e-4


def test_a_long_prompts_mlp_runs_in_row_slices_with_the_same_result(f32_kernels, tiny_model, monkeypatch):
    """A prefill of more than MLP_ROWS rows runs its MLP a slice of rows at a time, so its [N, 2I] intermediate stays
    in cache and in reused memory: every row's result is the one a single call gives (the kernels are
    batch-invariant), so the next-token log-probabilities are bitwise those of the unsliced prefill."""
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.models import llama
    model_dir = tiny_model("llama", dtype="bfloat16", init_std=0.1,
                           extra_config={"attention_bias": True, "mlp_bias": True})
    core = EngineCore(EngineConfig(model_dir, dtype="float32", prefix_caching=False))
    rows: list[int] = []
    mlp = llama.LlamaModel.mlp
    monkeypatch.setattr(llama.LlamaModel, "mlp", lambda self, L, x, nd: rows.append(x.shape[0]) or mlp(self, L, x, nd))
    whole = next_token_logprobs(core, PROMPTS)  # the four prompts' 50 rows in one step
    assert max(rows) == 50
    rows.clear()
    monkeypatch.setattr(llama, "MLP_ROWS", 8)
    sliced = next_token_logprobs(core, PROMPTS)
    assert max(rows) == 50 and sorted(set(rows))[:2] == [2, 8]  # 50 rows -> 6 slices of 8 and one of 2, per layer
    assert {i: list(o.top) for i, o in sliced.items()} == {i: list(o.top) for i, o in whole.items()}
