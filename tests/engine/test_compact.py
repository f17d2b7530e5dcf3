"""Compact bf16 weights (engine/kernels/compact_bf16.h): every weight held in 12 bits, losslessly. Unpacking gives
back the packed matrix bit for bit, special values and escaped weights included; the matmul agrees with the packed
kernels up to fp32 reassociation, in one order at every batch size they take (an AMX host runs them on its tiles
at every batch size, in the tiles' order); and a model loads its bf16 matrices compact by default and answers as it does without them."""
from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams
from tests.engine.conftest import NATIVE, record_logits
from tests.engine.test_kernels import assert_close

pytestmark = [pytest.mark.skipif(not NATIVE, reason="no native path here (a CPU without AVX-512, or kernels off)"),
              pytest.mark.usefixtures("native_kernels")]

ops = torch.ops.deploykit


def weights(n: int, k: int, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * scale).bfloat16()


def compact(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] as a compact blob whatever its share of escapes (prepare_weight keeps a matrix with many packed)."""
    blob = ops.compact_pack(kernels.prepare_weight(w), 1.0)
    assert kernels.is_compact(blob)
    return blob


def with_specials(w: torch.Tensor) -> torch.Tensor:
    """Values whose high byte is rare in a matrix of scale 0.02: they must come back exactly (escapes)."""
    w = w.clone()
    specials = [float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-38, 3.0e38, 65504.0, 1.0, -7.5, 2.0**-126]
    for i, v in enumerate(specials):
        w[i % w.shape[0], (5 * i + 3) % w.shape[1]] = v
    return w


@pytest.mark.parametrize("n,k", [(16, 32), (32, 64), (896, 896), (208, 4864)])
def test_unpack_gives_back_the_packed_matrix_bit_for_bit(n, k):
    packed = kernels.prepare_weight(with_specials(weights(n, k)))
    blob = compact(with_specials(weights(n, k)))
    assert torch.equal(kernels.compact_unpack(blob).view(torch.int16), packed.view(torch.int16))
    nn, kk, escaped = kernels.compact_info(blob)
    assert (nn, kk) == (n, k)
    if n * k >= 100_000:  # the specials are then too rare to own a code (a small matrix gives them its spare ones)
        assert escaped >= 9
    # 12 bits a weight plus the header, the escapes (8 bytes each) and a 64-byte-aligned end
    assert blob.numel() <= n * k * 1.5 + 256 + 8 * (n // 16 + 1) + 8 * escaped + 64


def test_rows_of_a_compact_matrix_are_its_rows_bit_for_bit():
    # A tied embedding is looked up in its compact lm_head: every row, escapes and special values included.
    w = with_specials(weights(208, 4864, seed=5))
    w[7, 11], w[200, 4863] = 1e4, float("nan")
    blob = compact(w)
    assert kernels.compact_info(blob)[2] >= 9
    ids = torch.tensor([0, 7, 15, 16, 200, 207, 7, 3])
    rows = kernels.compact_rows(blob, ids)
    assert rows.dtype == torch.bfloat16 and rows.shape == (8, 4864)
    assert torch.equal(rows.view(torch.int16), w[ids].view(torch.int16))
    assert kernels.compact_rows(blob, torch.tensor([], dtype=torch.long)).shape == (0, 4864)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kernels.compact_rows(blob, torch.tensor([208]))


def test_a_nan_weight_stays_nan():
    w = weights(32, 64)
    w[3, 10] = float("nan")
    back = kernels.compact_unpack(compact(w))
    assert torch.equal(back.view(torch.int16), kernels.prepare_weight(w).view(torch.int16))


def test_prepare_weight_compacts_a_typical_matrix_and_keeps_one_with_many_escapes_packed():
    assert kernels.is_compact(kernels.prepare_weight(weights(1152, 896), compact=True))
    # Log-uniform magnitudes over 60 powers of two: the 15 commonest high bytes cover a quarter of the weights.
    g = torch.Generator().manual_seed(1)
    w = (torch.rand(64, 256, generator=g) * 60 - 40).exp2() * torch.randn(64, 256, generator=g).sign()
    out = kernels.prepare_weight(w.bfloat16(), compact=True)
    assert ops.compact_pack(kernels.prepare_weight(w.bfloat16()), 1.0).numel() > 0  # it could, at a cost
    assert kernels.is_packed(out) and not kernels.is_compact(out)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 17, 33, 70, 130])
@pytest.mark.parametrize("n,k", [(1152, 896), (896, 4864), (48, 64), (80, 96)])
def test_compact_linear_is_close_to_fp32_and_row_invariant(m, n, k):
    g = torch.Generator().manual_seed(m * 31 + n + k)
    w = weights(n, k, seed=n + k, scale=k**-0.5)
    w[11, 7], w[12, 9], w[13, 1], w[14, k - 1] = 3.0e3, -1e-20, 1e-30, -2.0e4  # finite, and rare high bytes
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    packed, blob = kernels.prepare_weight(w), compact(w)
    if n * k >= 100_000:
        assert kernels.compact_info(blob)[2] >= 4  # the rare values are escapes, patched in every path
    got = kernels.linear(x, blob, bias)
    assert_close(got, x, w, bias)  # not the packed kernels' order: close, not bitwise
    # Every row count sums in one order, on AVX-512 (two fp32 chains a block) and on an AMX host's tiles (K % 32 == 0:
    # one row in place, up to 32 rows, decoded again per 32-row block or once for 4+): a row's output does not depend
    # on the batch it came in, which keeps greedy outputs the same with the prefix cache on and off.
    for i in {0, m // 2, m - 1}:
        assert torch.equal(got[i:i + 1], kernels.linear(x[i:i + 1], blob, bias)), f"row {i} of {m}"
    assert torch.equal(kernels.fallback_linear(x, blob, bias), kernels.fallback_linear(x, packed, bias))


@pytest.mark.skipif(not kernels.status()["compact_amx"], reason="compact matrices run on AMX tiles only on AMX CPUs")
@pytest.mark.parametrize("m", [1, 4, 40, 130, 300])
@pytest.mark.parametrize("k", [896, 4864])
def test_amx_tiles_on_compact_weights_decode_once_or_again_to_the_same_bits(m, k):
    # The tiles cut K into fixed segments (amx_tiles.h: 2 of 224 k-pairs at K = 896, 11 at 4864), each summed from
    # zero and added in fp32 in order. A prefill decodes each pair of column blocks once for a chunk of 4+ 32-row
    # blocks, a k-slice of whole segments at a time (one by default, all of K with slice_segments 0), else again for
    # every block; where K is so long that fewer than 4 blocks fit a chunk (K = 4864: 3), the k-slices go outermost
    # and each pair is decoded once per slice for up to 16 blocks (the default, 4, at m = 130 and 300). x streams past
    # L1 or not; the epilogue's output lines are requested ahead or not. Every way gives the same bits. The AVX-512
    # compact kernels (the switch off) sum in another order: close to the tiles, not bitwise.
    w, x = weights(208, k, seed=m), torch.randn(m, k).bfloat16()
    w[3, 5], w[40, k - 800], w[207, k - 1] = 1e4, -1e-25, 7e3  # escapes, patched into each decoded k-tile
    blob, bias = compact(w), torch.randn(208)
    outs = []
    try:
        for once in (1, 4, 1_000):
            ops.set_compact_amx_decode_once(once)
            for segments, stream, own in ((1, True, True), (1, True, False), (0, False, True), (2, True, False),
                                          (0, True, True)):
                ops.set_amx_prompt_tiles(segments, stream, own)
                outs.append(kernels.linear(x, blob, bias))
        assert ops.set_compact_amx(False) is False
        avx512 = kernels.linear(x, blob, bias)
    finally:
        ops.set_compact_amx_decode_once(4)
        ops.set_amx_prompt_tiles(1, True)
        assert ops.set_compact_amx(True) is True
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert_close(outs[0], x, w, bias)
    assert_close(avx512, x, w, bias)
    assert ops.compact_amx_enabled()
    with pytest.raises(RuntimeError, match="at least one 32-row block"):
        ops.set_compact_amx_decode_once(0)
    with pytest.raises(RuntimeError, match="0 \\(whole K\\) or more"):
        ops.set_amx_prompt_tiles(-1, True)


@pytest.mark.skipif(not kernels.status()["compact_amx"], reason="compact matrices run on AMX tiles only on AMX CPUs")
@pytest.mark.parametrize("m", [5, 33, 64, 130, 300])
@pytest.mark.parametrize("k", [256, 896, 2048, 4864])
def test_packed_and_compact_weights_give_a_row_the_same_bits_in_any_call_on_amx_tiles(m, k):
    # A model holds most matrices compact and keeps packed the few with many escapes, and a prompt's rows (in tile
    # blocks from 64 rows, k-slices of whole segments) must match the same rows decoded later (read in place, each
    # call all of K): both kinds, every path, one tdpbf16ps sequence and one order of segment sums.
    g = torch.Generator().manual_seed(m + k)
    w, x = weights(208, k, seed=m + k), torch.randn(m, k, generator=g).bfloat16()
    packed, blob, bias = kernels.prepare_weight(w), compact(w), torch.randn(208, generator=g)
    got = kernels.linear(x, packed, bias)
    assert torch.equal(got, kernels.linear(x, blob, bias))
    assert_close(got, x, w, bias)
    for i in {0, min(m // 2, m - 5), m - 5}:  # 5 rows: the smallest call on the tiles (kernels.AMX_MIN_M)
        assert torch.equal(got[i:i + 5], kernels.linear(x[i:i + 5], packed, bias)), f"rows {i}.. of {m}"
        assert torch.equal(got[i:i + 5], kernels.linear(x[i:i + 5], blob, bias)), f"rows {i}.. of {m}"
    threads = torch.get_num_threads()
    try:  # the packed prompt in k-slices of all of K or two segments, x streamed or not, its output lines requested
        # ahead or not, and on one thread
        for segments, stream, own, t in ((0, False, True, threads), (2, True, False, threads), (1, True, True, 1)):
            ops.set_amx_prompt_tiles(segments, stream, own)
            torch.set_num_threads(t)
            assert torch.equal(kernels.linear(x, packed, bias), got), (segments, stream, own, t)
    finally:
        ops.set_amx_prompt_tiles(1, True)
        torch.set_num_threads(threads)


@pytest.mark.skipif(not kernels.status()["compact_amx"], reason="compact matrices run on AMX tiles only on AMX CPUs")
@pytest.mark.parametrize("m", [1, 5, 32, 40, 130, 300])
@pytest.mark.parametrize("k", [896, 2048, 4864])
def test_gate_up_with_silu_in_the_tiles_gives_silu_mul_of_the_linear_bit_for_bit(m, k):
    # The MLP's gate_up [gate; up] with silu(gate) * up applied as the tiles store gate block j and up block j: each
    # row the bits silu_mul gives from the stored gate_up row, in every path (rows in place, decoded again or once per
    # chunk, k-slices outermost, and at K = 2048 and 300 rows a chunk of 8 blocks decoded once, then one of 2 decoded
    # again, after the last block's C tiles were held for the next), and the [m, 2I] intermediate never written.
    w, x = weights(416, k, seed=m), torch.randn(m, k).bfloat16()  # I = 208: 13 blocks of gate, 13 of up
    w[3, 5], w[300, k - 1] = 1e4, -7e3  # escapes in a gate block and in an up block
    blob = compact(w)
    assert kernels.gate_up_silu_ok(blob)
    # Each setting of set_amx_prompt_tiles too: with several segments a slice (0: all of K, 2), a block's deferred
    # SiLU rows add the sums of its earlier segments, and a segment ends inside a call that has rows pending.
    try:
        for once in (1, 4, 1_000):
            ops.set_compact_amx_decode_once(once)
            for segments, stream in ((1, True), (0, False), (2, True)):
                ops.set_amx_prompt_tiles(segments, stream)
                for bias in (None, torch.randn(416)):
                    want = kernels.silu_mul(kernels.linear(x, blob, bias))
                    got = kernels.gate_up_silu(x, blob, bias)
                    assert got.shape == (m, 208) and torch.equal(got, want), (once, segments, bias is None)
    finally:
        ops.set_compact_amx_decode_once(4)
        ops.set_amx_prompt_tiles(1, True)
    assert not kernels.gate_up_silu_ok(compact(weights(48, 64)))  # 3 blocks: gate and up do not split into blocks
    with pytest.raises(RuntimeError, match="whole 16-column blocks of gate and of up"):
        kernels.gate_up_silu(torch.randn(2, 64).bfloat16(), compact(weights(48, 64)))


@pytest.mark.parametrize("m", [5, 32, 37, 70])
@pytest.mark.parametrize("n", [48, 208])  # 3 and 13 blocks: a last group of one
def test_prefill_decoding_each_block_once_gives_the_tiles_bits(m, n):
    # From compact_decode_min_m rows on a pair of blocks is decoded once and tiles of 7 rows read it; below, tiles of
    # up to 8 rows decode the lines again. Both sum in the one order, so a prompt's logits do not depend on the path.
    w, x = weights(n, 4864, seed=m), torch.randn(m, 4864).bfloat16()
    w[3, 5], w[40, 4000] = 1e4, -1e-25  # escapes, patched into the decoded buffer as into the lines
    blob, bias = compact(w), torch.randn(n)
    threshold = int(ops.compact_decode_min_m())
    try:
        outs = []
        for start in (5, 10_000):
            ops.set_compact_decode_min_m(start)
            outs.append(kernels.linear(x, blob, bias))
    finally:
        ops.set_compact_decode_min_m(threshold)
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[0], x, w, bias)
    with pytest.raises(RuntimeError, match="5 rows or more"):
        ops.set_compact_decode_min_m(4)


@pytest.mark.parametrize("m", [1, 3])
def test_streaming_and_threads_never_change_a_bit(m):
    w, x = weights(1152, 896, seed=3), torch.randn(m, 896).bfloat16()
    blob = kernels.prepare_weight(w, compact=True)
    picked, threads = int(ops.gemv_streams()), torch.get_num_threads()
    try:
        outs = []
        for streams, t in ((8, 2), (1, 2), (1, 1), (8, 1)):
            ops.set_gemv_streams(streams)
            torch.set_num_threads(t)
            outs.append(kernels.linear(x, blob))
    finally:
        ops.set_gemv_streams(picked)
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_a_blob_that_is_not_compact_is_refused():
    blob = compact(weights(32, 64)).clone()
    blob[:4] = 0
    with pytest.raises(RuntimeError, match="not a compact bf16 blob"):
        kernels.linear(torch.randn(1, 64).bfloat16(), blob)
    with pytest.raises(RuntimeError, match="x has K=32"):
        kernels.linear(torch.randn(1, 32).bfloat16(), compact(weights(32, 64)))


def _greedy(model_dir: str, compact: bool) -> tuple[list[list[int]], list[torch.Tensor], EngineCore]:
    core = EngineCore(EngineConfig(model_dir, dtype="bfloat16", max_model_len=128, compact_weights=compact))
    logits = record_logits(core)
    prompts = [[5, 9, 200, 31, 7], list(range(40, 60))]
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))], logits, core


def test_a_bf16_model_loads_compact_and_answers_as_without(tiny_model):
    model_dir = tiny_model("qwen2")
    tokens, logits, core = _greedy(model_dir, True)
    ref_tokens, ref_logits, ref_core = _greedy(model_dir, False)
    model = core.model
    held = [w for L in model.layers for w in (L.qkv, L.o, L.gate_up, L.down)] + [model.lm_head]
    assert all(kernels.is_compact(w) for w in held)
    assert not any(kernels.is_compact(w) for L in ref_core.model.layers for w in (L.qkv, L.o, L.gate_up, L.down))
    compacted = sum(p.get("bfloat16 compact (12-bit, lossless)", 0) for p in model.weight_paths.values())
    assert kernels.is_compact(model.lm_head)  # this model's head is its own matrix
    assert compacted == 7 * len(model.layers) + 1  # q k v o gate up down, and the head
    dense = sum(2 * n * k for n, k, _ in map(kernels.compact_info, held))
    assert ref_core.model.weight_bytes - model.weight_bytes == dense - sum(w.numel() for w in held)
    # The same weights, summed in another order: logits differ by fp32 reassociation and bf16 rounding at most.
    assert len(logits) == len(ref_logits)
    for a, b in zip(logits, ref_logits):
        assert torch.allclose(a, b, rtol=0.02, atol=0.02)
    assert tokens == ref_tokens


def test_a_tied_embedding_is_held_once_compact_and_looked_up_there(tiny_model):
    # Small models tie the embedding to the lm_head, often the largest matrix (a 151,936-token vocabulary at hidden
    # 896 is 27 % of Qwen2.5-0.5B): held once, in 12 bits, and the embedding rows are read from that copy.
    model_dir = tiny_model("qwen2", tie_word_embeddings=True)
    tokens, logits, core = _greedy(model_dir, True)
    ref_tokens, ref_logits, ref_core = _greedy(model_dir, False)
    model = core.model
    assert kernels.is_compact(model.lm_head) and model.embed is None
    assert kernels.is_packed(ref_core.model.lm_head) and ref_core.model.embed is None
    paths = model.weight_paths
    compacted = sum(p.get("bfloat16 compact (12-bit, lossless)", 0) for p in paths.values())
    assert compacted == 7 * len(model.layers) + 1  # the tied table counts once, as the file holds it once
    n, k, _ = kernels.compact_info(model.lm_head)
    ids = torch.arange(0, n, 37)
    assert torch.equal(kernels.compact_rows(model.lm_head, ids),
                       kernels.unpack(ref_core.model.lm_head)[ids])
    for a, b in zip(logits, ref_logits):
        assert torch.allclose(a, b, rtol=0.02, atol=0.02)
    assert tokens == ref_tokens


@pytest.mark.skipif(not kernels.status()["compact_amx"], reason="compact matrices run on AMX tiles only on AMX CPUs")
def test_a_compact_model_on_amx_runs_gate_up_and_silu_as_one_op_with_the_same_outputs(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("qwen2"), dtype="bfloat16", max_model_len=128, compact_weights=True))
    assert core.model.gate_up_silu
    logits = record_logits(core)
    prompts = [[5, 9, 200, 31, 7], list(range(40, 100))]  # a prompt of 60 rows: the prefill path past 32 rows

    def greedy(fused: bool) -> list[list[int]]:
        core.model.gate_up_silu = fused
        for i, p in enumerate(prompts):
            core.add_request(f"{fused}{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[f"{fused}{i}"] for i in range(len(prompts))]

    fused = greedy(True)
    n = len(logits)
    assert greedy(False) == fused
    assert len(logits) == 2 * n and all(torch.equal(a, b) for a, b in zip(logits[:n], logits[n:]))
