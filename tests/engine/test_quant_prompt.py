"""A prompt's rows times a quantized matrix on AMX-BF16 tiles (kernels/quant_prompt_amx.cpp): each unit decoded to
the bf16 value of llama.cpp's own dequantizer, and summed by the same tile sequence as bf16 weights, so a prompt row
is the same bits in a 1-row or a 300-row call (the prefix cache's on/off identity rests on it) and equals what the
bf16 weights' AMX path gives it. Decode rows before `prompt_from` keep the int8 kernels' bits."""
from __future__ import annotations

import pytest
import torch

from engine import kernels, quant
from tests.engine.test_quant import FORMATS, dequantized, random_raw

pytestmark = [pytest.mark.usefixtures("quantized_kernels"),
              pytest.mark.skipif(not kernels.status().get("quant_prompt_amx"),
                                 reason="this CPU has no AMX (or the OS grants no tile state): prompt rows of "
                                        "quantized matrices stay on the int8 kernels")]
ROWS = 300


def matrix(fmt: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(blob, the llama.cpp-dequantized weights in bf16, K): one format, or Q4_K and Q6_K parts as Q4_K_M mixes them."""
    if fmt == "mixed":
        raws, k = [random_raw("Q4_K", 32, 768, 1), random_raw("Q6_K", 48, 768, 2), random_raw("Q4_K", 16, 768, 3)], 768
    else:
        k = 768 if fmt.endswith("_K") else 320
        raws = [random_raw(fmt, 96, k)]
    return quant.pack(raws), torch.cat([dequantized(r) for r in raws]).bfloat16(), k


@pytest.mark.parametrize("fmt", FORMATS + ["mixed"])
def test_prompt_rows_are_the_bits_of_the_dequantized_weights_on_tiles_in_any_chunk(fmt):
    ops = torch.ops.deploykit
    torch.manual_seed(0)
    blob, w, k = matrix(fmt)
    bias = torch.randn(w.shape[0])
    x = (torch.randn(ROWS, k) * 3).bfloat16()
    # The bf16 weights' own AMX path (compact or packed: 300 rows run tiles either way).
    want = kernels.linear(x, kernels.prepare_weight(w, compact=True), bias)
    for m in (1, 5, 16, 33, 70, ROWS):
        assert torch.equal(kernels.linear(x[:m], blob, bias, prompt_from=0), want[:m]), (fmt, m)
    try:  # K in k-slices of one segment (the default), two, or all of K; x streamed past L1 or not; the output lines
        # requested ahead or not: the same bits
        for segments, stream, own in ((0, False, True), (2, True, False), (1, False, True), (1, True, False)):
            ops.set_amx_prompt_tiles(segments, stream, own)
            assert torch.equal(kernels.linear(x, blob, bias, prompt_from=0), want), (fmt, segments, stream, own)
    finally:
        ops.set_amx_prompt_tiles(1, True)
    int8 = kernels.linear(x[:70], blob, bias)  # no prompt rows: the int8 kernels
    assert not torch.equal(int8, want[:70])
    mixed = kernels.linear(x[:70], blob, bias, prompt_from=7)  # 7 decode rows, then a 63-row prompt chunk
    assert torch.equal(mixed[:7], int8[:7]) and torch.equal(mixed[7:], want[7:70])
    assert torch.equal(kernels.linear(x[:70], blob, bias, prompt_from=70), int8)
    try:
        assert ops.set_quant_prompt_amx(False) is False
        assert torch.equal(kernels.linear(x[:70], blob, bias, prompt_from=0), int8)  # switched off: int8 for all
    finally:
        assert ops.set_quant_prompt_amx(True)


def test_prompt_from_outside_the_rows_is_refused():
    blob, w, k = matrix("Q4_0")
    with pytest.raises(RuntimeError, match=r"prompt_from must lie in \[0, 4\], got 5"):
        torch.ops.deploykit.quant_prompt_linear(torch.zeros(4, k, dtype=torch.bfloat16), blob, None, 5)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "mixed"])
def test_a_prompts_gate_up_with_silu_in_the_tiles_is_silu_mul_of_its_rows_bit_for_bit(fmt):
    """gate_up_silu on a quantized [gate; up] matrix: gate block j beside up block j in the tiles' epilogue, never
    writing the [M, 2I] intermediate, and the same bits as silu_mul of the prompt rows' linear."""
    ops = torch.ops.deploykit
    torch.manual_seed(1)
    blob, w, k = matrix(fmt)
    assert kernels.prompt_gate_up_silu_ok(blob)
    bias = torch.randn(w.shape[0])
    x = (torch.randn(ROWS, k) * 3).bfloat16()
    try:
        for segments, stream in ((1, True), (0, False), (2, True)):
            ops.set_amx_prompt_tiles(segments, stream)
            for m in (1, 33, ROWS):
                want = kernels.silu_mul(kernels.linear(x[:m], blob, bias, prompt_from=0))
                assert torch.equal(kernels.gate_up_silu(x[:m], blob, bias), want), (fmt, m, segments)
    finally:
        ops.set_amx_prompt_tiles(1, True)
    try:
        ops.set_quant_prompt_amx(False)
        int8 = kernels.silu_mul(kernels.linear(x[:33], blob, bias))
        assert torch.equal(kernels.gate_up_silu(x[:33], blob, bias), int8)
    finally:
        assert ops.set_quant_prompt_amx(True)
