"""The fp32 element-wise ops and decode attention (engine/kernels/f32_ops.cpp), which every kernel build holds: the
per-op decoder path of fp32 models and of quantized weights on AVX2 CPUs runs on them. Each is held to an fp64
evaluation of its definition and to the PyTorch composition it replaces."""
from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import attention_reference

# fp32 results: a handful of roundings from the fp64 value (exp's polynomial adds ~2e-7 relative).
RTOL = 1e-5


def close(y: torch.Tensor, exact: torch.Tensor, atol: float = 1e-6) -> None:
    assert y.dtype == torch.float32 and y.shape == exact.shape
    err = (y.double() - exact).abs() - (atol + RTOL * exact.abs())
    assert bool((err <= 0).all()), f"worst excess {err.max().item():.3g} at {divmod(int(err.argmax()), y.shape[-1])}"


@pytest.mark.parametrize("m,h,with_delta", [(1, 896, True), (16, 896, True), (3, 37, False), (2, 4, True)])
def test_add_rms_norm_updates_the_residual_and_normalizes(f32_kernels, m, h, with_delta):
    g = torch.Generator().manual_seed(m * h)
    hidden = torch.randn(m, h, generator=g) * 5
    delta = torch.randn(m, h, generator=g) if with_delta else None
    w = torch.randn(h, generator=g)
    native, ref = hidden.clone(), hidden.clone()
    y = f32_kernels.add_rms_norm(native, delta, w, 1e-6)
    y_ref = f32_kernels.fallback_add_rms_norm(ref, delta, w, 1e-6)
    assert torch.equal(native, ref)  # the residual add is one fp32 addition per element either way
    x = ref.double()
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    close(y, exact)
    close(y_ref, exact)


def test_add_rms_norm_reads_strided_rows(f32_kernels):
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 1000, generator=g)
    h, w = wide[:, :896], torch.randn(896, generator=g)  # rows 1000 apart
    y = f32_kernels.add_rms_norm(h, None, w, 1e-5)
    close(y, f32_kernels.fallback_add_rms_norm(h.clone(), None, w, 1e-5).double())


@pytest.mark.parametrize("m,i", [(1, 4864), (16, 4864), (2, 37), (1, 3)])
def test_silu_mul_matches_its_definition_including_extremes(f32_kernels, m, i):
    g = torch.Generator().manual_seed(i + m)
    gu = torch.randn(m, 2 * i, generator=g) * 4
    gu[0, :3] = torch.tensor([-200.0, 200.0, -0.0])  # exp saturating both ways, a signed zero
    y = f32_kernels.silu_mul(gu)
    gate, up = gu.double().chunk(2, dim=-1)
    close(y, gate * torch.sigmoid(gate) * up, atol=1e-30)
    close(f32_kernels.fallback_silu_mul(gu), gate * torch.sigmoid(gate) * up, atol=1e-30)


@pytest.mark.parametrize("m,heads,d", [(1, 16, 64), (16, 16, 64), (2, 3, 80), (1, 2, 34), (3, 4, 16)])
def test_rotary_in_place_on_a_strided_qkv_view(f32_kernels, m, heads, d):
    g = torch.Generator().manual_seed(heads * d + m)
    qkv = torch.randn(m, heads + 2, d, generator=g)  # q/k heads first, then 2 v heads the op must not touch
    cos, sin = torch.randn(m, d, generator=g), torch.randn(m, d, generator=g)
    native, ref = qkv.clone(), qkv.clone()
    f32_kernels.rotary_(native[:, :heads], cos, sin)
    f32_kernels.fallback_rotary_(ref[:, :heads], cos, sin)
    assert torch.equal(native[:, heads:], qkv[:, heads:])
    x, half = qkv[:, :heads].double(), d // 2
    exact = x * cos.double()[:, None] + torch.cat([x[..., half:], x[..., :half]], -1) * sin.double()[:, None]
    close(native[:, :heads], exact)
    close(ref[:, :heads], exact)


@pytest.mark.parametrize("m,heads,d", [(1, 6, 128), (4, 18, 64), (2, 3, 40), (1, 2, 12)])
def test_head_rms_norm_in_place_on_the_q_and_k_heads_of_a_qkv_view(f32_kernels, m, heads, d):
    g = torch.Generator().manual_seed(heads * d + m)
    qkv = torch.randn(m, heads + 2, d, generator=g) * 3
    w = torch.randn(heads, d, generator=g)  # one weight row per head (Qwen3's q/k norm)
    native = qkv.clone()
    f32_kernels.head_rms_norm_(native[:, :heads], w, 1e-6)
    assert torch.equal(native[:, heads:], qkv[:, heads:])
    x = qkv[:, :heads].double()
    close(native[:, :heads], x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double())


@pytest.mark.parametrize("heads,kv_heads,d,block,lens", [
    (14, 2, 64, 16, [1]), (14, 2, 64, 16, [17]), (8, 8, 128, 16, [1, 40, 100]), (32, 8, 128, 32, [5, 300, 64, 1000]),
    (4, 1, 32, 8, [9, 8, 7]), (18, 2, 16, 16, [23, 3]), (2, 2, 256, 16, [33]), (10, 1, 8, 4, [13]),
    (16, 2, 40, 16, [70, 2]), (32, 2, 64, 16, [129, 31])])  # 16-lane slices and an 8-lane tail; heads in 3 passes
def test_decode_attention_reads_scattered_blocks_in_place(f32_kernels, heads, kv_heads, d, block, lens):
    g = torch.Generator().manual_seed(heads * d + len(lens))
    kv = torch.randn(200, block, 2, kv_heads, d, generator=g)
    width = max(-(-n // block) for n in lens)
    tables = torch.randperm(200, generator=g)[:len(lens) * width].view(len(lens), width).int()  # out of order
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d, generator=g) * 2
    q, lens_t = qkv[:, :heads], torch.tensor(lens, dtype=torch.int32)                  # q: a strided view
    assert f32_kernels.decode_attention_supported(q)
    for window in (0, 1, 7, 64):  # no window; windows shorter than some contexts, longer than others
        out = f32_kernels.decode_attention(q, kv, tables, lens_t, d ** -0.5, window)
        close(out, attention_reference(q, kv, tables, lens_t, d ** -0.5, window))


def test_a_sequences_attention_does_not_depend_on_the_batch_it_is_in(f32_kernels):
    """Each (sequence, KV head) is its own task: batching never changes a sequence's bits (PyTorch's padded SDPA
    did, which could move a greedy token)."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(64, 16, 2, 2, 64, generator=g)
    tables = torch.randperm(64, generator=g)[:48].view(4, 12).int()
    lens = torch.tensor([190, 7, 64, 101], dtype=torch.int32)
    q = torch.randn(4, 14, 64, generator=g)
    batched = f32_kernels.decode_attention(q, kv, tables, lens, 0.125)
    for b in range(4):
        alone = f32_kernels.decode_attention(q[b:b + 1], kv, tables[b:b + 1, :-(-int(lens[b]) // 16)].contiguous(),
                                             lens[b:b + 1], 0.125)
        assert torch.equal(alone[0], batched[b]), b


def test_fp32_head_sizes_are_the_kernels_own_checks(f32_kernels):
    """decode_attention_supported says yes exactly when the kernel accepts the head size."""
    for d in (8, 16, 24, 256, 264, 12, 4):
        q, kv = torch.zeros(1, 2, d), torch.zeros(1, 16, 2, 1, d)
        try:
            f32_kernels.decode_attention(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                         1.0)
            accepted = True
        except RuntimeError as e:
            assert "head_dim must be a multiple of 8 up to 256" in str(e)
            accepted = False
        assert f32_kernels.decode_attention_supported(q) is accepted, d


def test_decode_attention_rejects_tables_that_point_outside_the_cache(f32_kernels):
    kv, q = torch.zeros(4, 16, 2, 2, 64), torch.zeros(1, 4, 64)

    def call(block: int, length: int):
        tables, lens = torch.tensor([[block]], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
        return f32_kernels.decode_attention(q, kv, tables, lens, 1.0)

    with pytest.raises(RuntimeError, match="out of range"):
        call(9, 3)
    with pytest.raises(RuntimeError, match="context length"):
        call(0, 17)
    with pytest.raises(RuntimeError, match="context length"):
        call(0, 0)


def test_the_fp32_fused_step_takes_these_heads_and_status_says_what_runs(f32_kernels):
    """Small fp32 decode steps run as one native call (decode_step_f32.cpp, on these same row ops: test_decode_step_f32
    holds the two paths to the same bits), larger ones per op. `python -m engine.kernels status` (and the start-up
    log) says the fp32 ops are native."""
    assert f32_kernels.decode_step_supported(torch.zeros(1, 14, 64), 4864)
    assert not f32_kernels.decode_step_supported(torch.zeros(1, 14, 64), 4872)  # I not in whole 16-column groups
    assert f32_kernels.STEP_F32_MAX_ROWS == 16
    assert f32_kernels.status()["fp32_ops"] is True
