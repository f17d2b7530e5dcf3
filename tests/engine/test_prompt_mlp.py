"""A prompt's MLP through tile panels (kernels/amx_slices.h, kernels.prompt_mlp): gate_up's SiLU epilogue writes
silu(gate) * up as the panels the down projection's A tiles read, instead of rows the down projection copies into tile
blocks first. Only where values are stored differs, so every row is the bits of gate_up_silu then linear (prompt rows)
for compact and quantized weights, any mix of them, any slicing of K and a long K taken k-outer, and a model's
prefill gives the same logits with and without it."""
from __future__ import annotations

import pytest
import torch

from engine import kernels, quant
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams
from tests.engine.conftest import record_logits
from tests.engine.test_quant import random_raw

pytestmark = [pytest.mark.usefixtures("quantized_kernels"),
              pytest.mark.skipif(not (kernels.status().get("compact_amx") and kernels.status().get("quant_prompt_amx")),
                                 reason="this CPU has no AMX (or the OS grants no tile state): prompts take no tile "
                                        "panels")]
ops = torch.ops.deploykit


def matrix(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """An [n, k] weight as the engine holds it: compact bf16, one GGUF format, or Q4_K and Q6_K parts (Q4_K_M's mix)."""
    if kind == "compact":  # compact whatever its share of escapes
        g = torch.Generator().manual_seed(seed)
        return ops.compact_pack(kernels.prepare_weight((torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()), 1.0)
    if kind == "mixed":
        return quant.pack([random_raw("Q4_K", n // 2, k, seed), random_raw("Q6_K", n - n // 2, k, seed + 1)])
    return quant.pack([random_raw(kind, n, k, seed)])


def layer(gate: str, down: str, hidden: int, inter: int):
    torch.manual_seed(0)
    return (matrix(gate, 2 * inter, hidden, 1), torch.randn(2 * inter), matrix(down, hidden, inter, 2),
            torch.randn(hidden))


def rows_of(panels: torch.Tensor, m: int) -> torch.Tensor:
    """[K/32, rows_pad, 32] panels -> the [m, K] rows they hold."""
    return panels.permute(1, 0, 2).reshape(panels.shape[1], -1)[:m]


@pytest.mark.parametrize("gate,down", [("compact", "compact"), ("Q4_0", "Q8_0"), ("mixed", "mixed"),
                                       ("compact", "Q4_0"), ("Q8_0", "compact")])
def test_a_prompts_mlp_through_panels_is_gate_up_silu_then_down_bit_for_bit(gate, down):
    gu, gub, dn, dnb = layer(gate, down, 512, 768)
    assert kernels.prompt_mlp_ok(gu, dn)
    x = (torch.randn(300, 512) * 2).bfloat16()
    try:  # K in slices of one segment (the default), whole K or two; compact pairs decoded once or again per block;
        # x streamed past L1 or not; plain epilogues' lines requested ahead or not
        for segments, once, stream, own in ((1, 4, True, True), (0, 1, False, True), (2, 64, True, False)):
            ops.set_amx_prompt_tiles(segments, stream, own)
            ops.set_compact_amx_decode_once(once)
            for m in (kernels.PANEL_MIN_M, 65, 120, 161, 250, 300):  # 0-31 rows in the last block's second half
                want = kernels.linear(kernels.gate_up_silu(x[:m], gu, gub), dn, dnb, prompt_from=0)
                assert torch.equal(kernels.prompt_mlp(x[:m], gu, gub, dn, dnb), want), (segments, once, m)
            want = kernels.linear(kernels.gate_up_silu(x[:100], gu, None), dn, None, prompt_from=0)
            assert torch.equal(kernels.prompt_mlp(x[:100], gu, None, dn, None), want)  # no biases
    finally:
        ops.set_amx_prompt_tiles(1, True)
        ops.set_compact_amx_decode_once(4)


@pytest.mark.parametrize("kind", ["compact", "Q4_0"])
@pytest.mark.parametrize("hidden,inter,rows", [(256, 4864, (96, 128, 200)), (4352, 128, (120, 250))],
                         ids=["long-k-down", "long-k-gate-up"])
def test_a_long_k_reads_or_writes_panels_k_outer_with_the_same_bits(kind, hidden, inter, rows):
    """The benchmark model's down projection has K = 4864: a chunk of its blocks does not stay in L2, so its k-slices
    go outermost (amx_slices.h k_outer) from 4 blocks on (96 rows, 3 blocks, decode each compact pair again per block
    instead); a hidden size past ~4,000 takes gate_up's k-slices outermost too, its SiLU rows going to panels there."""
    gu, gub, dn, dnb = layer(kind, kind, hidden, inter)
    x = torch.randn(max(rows), hidden).bfloat16()
    for m in rows:
        want = kernels.linear(kernels.gate_up_silu(x[:m], gu, gub), dn, dnb, prompt_from=0)
        assert torch.equal(kernels.prompt_mlp(x[:m], gu, gub, dn, dnb), want), m


@pytest.mark.parametrize("kind", ["compact", "Q4_0"])
def test_gate_up_panels_hold_its_rows_and_zeros_past_them(kind):
    gu, gub, _, _ = layer(kind, kind, 256, 512)
    x = torch.randn(70, 256).bfloat16()
    panels = (ops.compact_gate_up_silu_panels if kind == "compact" else ops.quant_prompt_gate_up_silu_panels)(x, gu,
                                                                                                            gub)
    assert panels.shape == (512 // 32, 96, 32)
    assert torch.equal(rows_of(panels, 70), kernels.gate_up_silu(x, gu, gub))
    assert not panels[:, 70:].any()  # the last block's A tiles read these rows


@pytest.mark.parametrize("gate,down,switch", [("Q4_0", "Q8_0", "set_quant_prompt_amx"),
                                              ("compact", "compact", "set_compact_amx")])
def test_switched_off_tile_paths_give_their_fallbacks_bits_through_panels_too(gate, down, switch):
    """set_quant_prompt_amx(False) sends a quantized prompt to the int8 kernels and set_compact_amx(False) a compact
    matrix to the AVX-512 kernels: the panel ops then give those paths' bits, as gate_up_silu and linear do."""
    x = torch.randn(100, 512).bfloat16()
    gu, gub, dn, dnb = layer(gate, down, 512, 768)
    try:
        assert getattr(ops, switch)(False) is False
        want = kernels.linear(kernels.gate_up_silu(x, gu, gub), dn, dnb, prompt_from=0)
        assert torch.equal(kernels.prompt_mlp(x, gu, gub, dn, dnb), want)
    finally:
        assert getattr(ops, switch)(True)
    if switch == "set_quant_prompt_amx":
        assert not torch.equal(kernels.prompt_mlp(x, gu, gub, dn, dnb), want)  # the int8 path's bits differ


def test_panels_are_refused_where_they_do_not_fit():
    gu, gub, dn, dnb = layer("compact", "compact", 256, 512)
    with pytest.raises(RuntimeError, match="more than 32"):
        ops.compact_gate_up_silu_panels(torch.randn(32, 256).bfloat16(), gu, gub)
    panels = ops.compact_gate_up_silu_panels(torch.randn(40, 256).bfloat16(), gu, gub)
    with pytest.raises(RuntimeError, match=r"x panels must be a contiguous bf16 \[K/32, rows rounded up to 32, 32\]"):
        ops.compact_linear_panels(panels, 80, dn, dnb)  # 80 rows do not fit 64
    with pytest.raises(RuntimeError, match="K=256"):
        ops.compact_linear_panels(panels, 40, matrix("compact", 256, 256, 3), None)  # 512 columns are not K = 256
    narrow = matrix("compact", 2 * 48, 256, 4)  # I = 48: not whole 32-column panels
    assert not kernels.prompt_mlp_ok(narrow, matrix("compact", 256, 48 + 16, 5))
    with pytest.raises(RuntimeError, match="whole 32-column panels"):
        ops.compact_gate_up_silu_panels(torch.randn(40, 256).bfloat16(), narrow, None)
    packed = kernels.prepare_weight(torch.randn(1024, 256).bfloat16())  # neither compact nor quantized
    assert not kernels.prompt_mlp_ok(packed, dn) and not kernels.prompt_mlp_ok(gu, kernels.prepare_weight(
        torch.randn(256, 512).bfloat16()))


def test_a_models_prefill_through_panels_gives_the_same_tokens_and_logits(tiny_model, monkeypatch):
    # No prefix cache: the second run must prefill its prompts itself rather than take the first run's KV.
    core = EngineCore(EngineConfig(tiny_model("qwen2", intermediate=192), dtype="bfloat16", max_model_len=256,
                                   compact_weights=True, prefix_caching=False))
    model = core.model
    assert model.prompt_mlp
    calls = []
    mlp = kernels.prompt_mlp
    monkeypatch.setattr(kernels, "prompt_mlp", lambda *a: calls.append(a[0].shape[0]) or mlp(*a))
    logits = record_logits(core)
    prompts = [list(range(3, 103)), [7] * 70 + list(range(200, 240))]  # 100 and 110 rows, then decode steps

    def greedy(panels: bool) -> list[list[int]]:
        model.prompt_mlp = panels
        for i, p in enumerate(prompts):
            core.add_request(f"{panels}{i}", p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[f"{panels}{i}"] for i in range(len(prompts))]

    with_panels = greedy(True)
    n = len(logits)
    assert sum(calls) == 210 * len(model.layers)  # every prompt row of every layer went through panels
    calls.clear()
    assert greedy(False) == with_panels and not calls
    assert len(logits) == 2 * n and all(torch.equal(a, b) for a, b in zip(logits[:n], logits[n:]))
