"""Block-quantized weights held as they are: repacking GGUF blocks is lossless (every format decodes to what
llama.cpp's own dequantizer gives), quantize-on-load writes llama.cpp's bytes, the int8 kernels compute what their
PyTorch reference computes at every row count and through the fused decode step, and the planner and the engine
agree on which weights stay quantized and how many bytes they take."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from deploykit import quant as rule
from engine import kernels, quant
from engine.quant import FILE_BLOCK, Raw

pytestmark = pytest.mark.usefixtures("quantized_kernels")  # skips only where no build runs them (conftest)

FORMATS = list(FILE_BLOCK)
# Offsets of the fp16 scale fields in a block: random bytes there could be NaN or huge.
SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}


def random_raw(fmt: str, rows: int, cols: int, seed: int = 0) -> Raw:
    """Random blocks of `fmt` with sane scales: every bit pattern of the quants is a valid block."""
    rng = np.random.default_rng(seed)
    block, size = FILE_BLOCK[fmt]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in SCALES[fmt]:
        d = (rng.random((rows, cols // block)) * 0.02 + 0.001).astype(np.float16)
        data[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return Raw(fmt, torch.from_numpy(data.reshape(rows, -1)))


def dequantized(raw: Raw) -> torch.Tensor:
    """llama.cpp's own dequantizer (the gguf package) on the file bytes -> fp32 [rows, cols]."""
    from gguf import GGMLQuantizationType, quants
    return torch.from_numpy(quants.dequantize(raw.data.numpy(), GGMLQuantizationType[raw.type_name])).float()


def reference(x: torch.Tensor, raw: Raw, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times raw's weights (w, dequantized) as the kernels compute it, in fp64 after the activations are
    quantized as llama.cpp's x86 quantize_row_q8_0/q8_1 do: per 32, d = max|x| / 127, q = round-half-even(x * (127 /
    max|x|)) in fp32 (127 / max|x|, not 1 / d: they differ in the last bit, and a product near a half rounds either
    way); d is used rounded to fp16 (block_q8_0/q8_1's d), and Q4_1/Q5_1's offsets m_w are multiplied by Q8_1's
    s = fp16(d * sum q), not by fp16(d) * sum q. The K formats keep d in fp32 (llama.cpp pairs them with Q8_K)."""
    xb = x.float().reshape(x.shape[0], -1, 32)                                       # [M, B, 32]
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))  # (torch's 127 / t is
    q = torch.round(xb * inv)                                                          # 127 * (1 / t): two roundings)
    k_format = raw.type_name.endswith("_K")
    scale = d if k_format else d.half().float()
    y = (q * scale).reshape(x.shape).double() @ w.double().T
    if raw.type_name in ("Q4_1", "Q5_1"):
        s = q.sum(-1)                                                                  # [M, B]
        block = FILE_BLOCK[raw.type_name][1]
        m = torch.from_numpy(raw.data.numpy().reshape(w.shape[0], -1, block)[:, :, 2:4].copy().view(np.float16))
        y += ((d[..., 0] * s).half().float() - scale[..., 0] * s).double() @ m[..., 0].double().T
    return (y + bias.double() if bias is not None else y).float()


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_is_lossless_for_every_format(fmt):
    """GGUF blocks -> the kernels' layout -> rows back: exactly llama.cpp's values (rows from every group position,
    and a matrix of two formats, as q/k/v of a Q4_K_M file are)."""
    cols = 512
    raw = random_raw(fmt, 48, cols)
    blob = quant.pack([raw])
    assert quant.describe(blob) == [(fmt, 48)]
    ids = torch.tensor([0, 1, 15, 16, 31, 47])
    assert torch.equal(kernels.quant_rows(blob, ids, torch.float32), dequantized(raw)[ids])
    other = random_raw("Q8_0" if fmt != "Q8_0" else "Q6_K", 32, cols, seed=1)
    mixed = quant.pack([raw, other])
    assert quant.describe(mixed) == [(fmt, 48), (other.type_name, 32)]
    want = torch.cat([dequantized(raw), dequantized(other)])
    assert torch.equal(kernels.quant_rows(mixed, torch.arange(80), torch.float32), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gate_and_up_held_group_by_group_are_the_same_matrix(fmt):
    """gate_up's halves are held interleaved, 16-row group by group (quant.pack(interleave=True)), so the fused decode
    step reads gate block j and up block j as one stream: every row decoded and every product, at 1-4 rows (the
    GEMV), 5-40 (tiles; AMX-INT8 from 16 where the CPU has it), a prompt's rows and fp32 logits, is bitwise what the
    halves stored one after the other give. Halves of two formats or sizes are stored one after the other."""
    k = 768 if fmt.endswith("_K") else 320
    gate, up = random_raw(fmt, 48, k, 1), random_raw(fmt, 48, k, 2)
    plain, inter = quant.pack([gate, up]), quant.pack([gate, up], interleave=True)
    assert quant.interleaved(inter) and not quant.interleaved(plain)
    assert inter.numel() == plain.numel() and quant.describe(inter) == [(fmt, 48), (fmt, 48)]
    ids = torch.arange(96)
    assert torch.equal(kernels.quant_rows(inter, ids, torch.float32), kernels.quant_rows(plain, ids, torch.float32))
    torch.manual_seed(0)
    x, bias = torch.randn(40, k).bfloat16(), torch.randn(96)
    for m in (1, 2, 3, 4, 5, 16, 40):
        assert torch.equal(kernels.linear(x[:m], inter, bias), kernels.linear(x[:m], plain, bias)), m
    assert torch.equal(kernels.linear(x, inter, bias, prompt_from=0), kernels.linear(x, plain, bias, prompt_from=0))
    assert torch.equal(kernels.logits(x[:3], inter), kernels.logits(x[:3], plain))
    other = random_raw("Q8_0" if fmt != "Q8_0" else "Q4_0", 48, k, 3)
    assert not quant.interleaved(quant.pack([gate, other], interleave=True))
    assert not quant.interleaved(quant.pack([gate, random_raw(fmt, 32, k, 4)], interleave=True))
    with pytest.raises(RuntimeError, match="interleave takes two parts of one format"):
        kernels.quant_pack([gate.data, other.data], [quant.GGML_IDS[fmt], quant.GGML_IDS[other.type_name]], k, True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_segmented_panels_are_the_same_matrix(fmt):
    """Where a 16-row group outgrows L1, K is cut into segments stored panel by panel (quant_layout.h SEGMENT_AT), so
    the batch-1 GEMV keeps a segment's activations in L1: every row decoded and every product (1-4 rows over whole
    and partial panels, 5-40 in tiles, a prompt's rows, fp32 logits, a matrix of two formats, interleaved halves) is
    bitwise what the plain layout gives. Here 11 groups make panels of 4, 4 and 3, and the last segment is short."""
    k = 768 if fmt.endswith("_K") else 640  # 3 segments of 256 (K-quants: a chunk each; else 4, 4 and 2 chunks)
    raw, other = random_raw(fmt, 176, k, 1), random_raw("Q8_0" if fmt != "Q8_0" else "Q4_0", 32, k, 2)
    gate, up = random_raw(fmt, 48, k, 3), random_raw(fmt, 48, k, 4)
    torch.manual_seed(0)
    x = torch.randn(40, k).bfloat16()
    for parts, interleave in (([raw], False), ([raw, other], False), ([gate, up], True)):
        ids = [quant.GGML_IDS[p.type_name] for p in parts]
        plain = kernels.quant_pack([p.data for p in parts], ids, k, interleave, 0)
        seg = kernels.quant_pack([p.data for p in parts], ids, k, interleave, 256)
        assert kernels.quant_segments(plain) == (0, 0) and kernels.quant_segments(seg) == (256, 4)
        assert seg.numel() == plain.numel() and quant.describe(seg) == quant.describe(plain)
        assert quant.interleaved(seg) == interleave
        n = sum(p.rows for p in parts)
        ids = torch.arange(n)
        assert torch.equal(kernels.quant_rows(seg, ids, torch.float32), kernels.quant_rows(plain, ids, torch.float32))
        bias = torch.randn(n)
        for m in (1, 2, 3, 4, 5, 16, 40):
            assert torch.equal(kernels.linear(x[:m], seg, bias), kernels.linear(x[:m], plain, bias)), m
            assert torch.equal(kernels.linear(x[:m].float(), seg, bias), kernels.linear(x[:m].float(), plain, bias))
        assert torch.equal(kernels.linear(x, seg, bias, prompt_from=0), kernels.linear(x, plain, bias, prompt_from=0))
        assert torch.equal(kernels.logits(x[:3], seg), kernels.logits(x[:3], plain))
    with pytest.raises(RuntimeError, match="not a multiple of 256"):
        kernels.quant_pack([raw.data], [quant.GGML_IDS[fmt]], k, False, 320)


def test_long_groups_are_segmented_where_the_gemv_reads_them_faster():
    """Left to choose, the packer segments matrices whose 16-row groups pass 20 KiB (down at K = 4864 in Q4_0: 43 KiB)
    on AVX-512 CPUs whose quantized matmuls are not on AMX tiles, and nothing else."""
    status = kernels.status()
    want = (1024, 4) if status["variant"].startswith("avx512") and not status["quant_amx"] else (0, 0)
    assert kernels.quant_segments(quant.pack([random_raw("Q4_0", 32, 4864)])) == want
    assert kernels.quant_segments(quant.pack([random_raw("Q4_0", 32, 896)])) == (0, 0)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_quantize_on_load_writes_what_llama_cpps_quantizer_writes(fmt):
    from gguf import GGMLQuantizationType, quants
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]   # rows of very different scales
    w[3, :32] = 0                                                     # an all-zero block
    ours = quant.quantize(w, fmt).data.numpy()
    theirs = quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
    assert np.array_equal(ours, theirs)


def check_linear(fmt: str, m: int) -> None:
    """bf16 and fp32 activations, with a bias, out in the activations' dtype or fp32 (logits); 1-4 rows take the
    GEMV, more the tiled path."""
    torch.manual_seed(m)
    raw = random_raw(fmt, 96, 768 if fmt.endswith("_K") else 320)
    blob, w = quant.pack([raw]), dequantized(raw)
    x, bias = torch.randn(m, w.shape[1]), torch.randn(w.shape[0])
    want = reference(x, raw, w, bias)
    got = kernels.linear(x, blob, bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    xb = x.bfloat16()
    got_bf16 = kernels.linear(xb, blob, bias)
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.float(), reference(xb, raw, w, bias), rtol=1e-2, atol=1e-2)
    logits = kernels.logits(xb, blob)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference(xb, raw, w), rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16])
def test_linear_computes_the_reference_at_every_row_count(fmt, m):
    check_linear(fmt, m)


@pytest.mark.slow
def test_the_avx2_build_computes_the_reference_as_well():
    """The AVX2 build's int8 GEMV (CPUs without AVX-512: vpmaddubsw in place of vpdpbusd), forced with
    DEPLOYKIT_KERNELS=avx2 on a CPU that runs an AVX-512 build, meets the same reference in every format and at
    every row count, and reads segmented blobs bitwise as plain ones. On an AVX2 CPU it is the build every test in
    this file runs already."""
    import subprocess
    import sys
    if kernels.status()["variant"] == "avx2":
        pytest.skip("this CPU runs the AVX2 build: every test here holds it to the reference already")
    code = ("from engine import kernels\n"
            "from tests.engine.test_quant import FORMATS, check_linear, test_segmented_panels_are_the_same_matrix\n"
            "assert kernels.status()['variant'] == 'avx2' and kernels.quantized_ok(), kernels.status()\n"
            "for fmt in FORMATS:\n"
            "    for m in (1, 2, 3, 4, 5, 16):\n"
            "        check_linear(fmt, m)\n"
            "    test_segmented_panels_are_the_same_matrix(fmt)\n")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False,
                          env={**os.environ, "DEPLOYKIT_KERNELS": "avx2", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]


def test_q4_1_offsets_meet_the_activations_as_llama_cpps_q8_1_blocks():
    """Q4_1's offsets m_w are multiplied by Q8_1's s = fp16(d * sum q), as in llama.cpp, not by d or fp16(d) times
    sum q (they differ by up to 2^-12 of each block's term): codes 0 and m_w = 1 leave only those terms."""
    block = np.zeros((16, 8, 20), dtype=np.uint8)                                 # 16 rows x 8 blocks of 32
    block[:, :, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)          # d_w (times codes 0)
    block[:, :, 2:4] = np.array([1.0], dtype=np.float16).view(np.uint8)           # m_w
    raw = Raw("Q4_1", torch.from_numpy(block.reshape(16, -1)))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)) * 3.7
    got, want = kernels.linear(x, quant.pack([raw])), reference(x, raw, dequantized(raw))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    xb = x.reshape(3, 8, 32)
    unrounded = (xb.abs().amax(-1) / 127 * torch.round(xb * (127 / xb.abs().amax(-1, keepdim=True))).sum(-1)).sum(-1)
    assert not torch.allclose(got[:, 0], unrounded, rtol=1e-5, atol=0)            # the case tells them apart


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_bitwise_the_same_in_any_batch(fmt):
    """Each output row depends on its own activations only: a row computed alone equals it inside a batch of 2, 3, 4,
    7, 16 or 40, in every format (the fused decode step and the per-op path share this property; on AMX-INT8 CPUs 16
    rows and more run on tiles; the AVX2 build reads a unit's lines in one pass for both halves of a group from 2
    rows, in two passes for one row)."""
    raw = random_raw(fmt, 64, 512)
    blob = quant.pack([raw])
    x = torch.randn(40, 512).bfloat16()
    alone = torch.cat([kernels.linear(x[i:i + 1], blob) for i in range(40)])
    for m in (2, 3, 4, 7, 16, 40):
        assert torch.equal(kernels.linear(x[:m], blob), alone[:m]), m


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K"])
def test_rows_are_bitwise_the_same_on_any_number_of_threads(fmt):
    """Past 4 rows the threads take a matrix's column groups in runs as they come free (kernels/runs.h), so which
    thread computes which columns changes from call to call: on 1, 2 or 3 threads, every output is the same bits."""
    raw = random_raw(fmt, 16 * 23, 512)  # 23 groups: runs of odd length split the GEMV's group pairs
    blob = quant.pack([raw])
    x = torch.randn(40, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [kernels.linear(x[:m], blob) for m in (5, 16, 40)]
        for t in (2, 3):
            torch.set_num_threads(t)
            for _ in range(3):
                for m, want in zip((5, 16, 40), alone):
                    assert torch.equal(kernels.linear(x[:m], blob), want), f"{t} threads, {m} rows"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not kernels.status().get("quant_amx"),
                    reason="this CPU has no AMX-INT8 (or the OS grants no tile state): the tiles cannot run here")
@pytest.mark.parametrize("fmt", FORMATS + ["mixed"])
def test_amx_tiles_give_each_row_the_bits_of_the_gemv(fmt):
    """On AMX-INT8 CPUs, 16 rows and more take tiles (kernels/quant_amx.h): each unit's int32 dots summed by tdpbssd
    and the GEMV's fp32 steps, so every row equals the GEMV's result for that row alone, bitwise, in every format,
    for row counts that leave a partial 16-row block, with bf16 and fp32 activations, a bias and fp32 logits, and on a
    matrix whose parts mix formats (as Q4_K_M files do: Q4_K with Q6_K, which runs tiles of 16 k)."""
    ops = torch.ops.deploykit
    torch.manual_seed(0)
    if fmt == "mixed":
        raws, k = [random_raw("Q4_K", 32, 768, 1), random_raw("Q6_K", 48, 768, 2), random_raw("Q4_K", 16, 768, 3)], 768
    else:
        k = 768 if fmt.endswith("_K") else 320
        raws = [random_raw(fmt, 96, k)]
    blob, n = quant.pack(raws), sum(r.data.shape[0] for r in raws)
    bias = torch.randn(n)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(70, k) * 3).to(dtype)
        try:
            ops.set_quant_amx(False)
            alone = torch.cat([kernels.linear(x[i:i + 1], blob, bias) for i in range(70)])
            alone_logits = torch.cat([kernels.logits(x[i:i + 1], blob) for i in range(70)])
        finally:
            assert ops.set_quant_amx(True)
        for m in (16, 17, 33, 70):
            assert torch.equal(kernels.linear(x[:m], blob, bias), alone[:m]), (fmt, dtype, m)
        assert torch.equal(kernels.logits(x, blob), alone_logits), (fmt, dtype)


@pytest.mark.parametrize("fmt", ["Q5_0", "Q5_1", "Q5_K"])
def test_the_fifth_bits_give_the_same_results_with_gfni_or_without(fmt):
    """The 5-bit formats' fifth bits are placed with GFNI where the CPU has it and with shifts where it does not
    (kernels/quant_gemv.h or_fifth; one library serves both): every row count (the 1-4 row GEMV, the tiles of wider
    calls, AMX tiles where they run) gives bitwise the same result either way, and the right one."""
    ops = torch.ops.deploykit
    flags = Path("/proc/cpuinfo").read_text().split("\n\nprocessor")[0]
    gfni = ops.set_quant_gfni(True)  # the library asks CPUID; the AVX2 build has no such path
    if " gfni" in flags and kernels.status()["variant"].startswith("avx512"):
        assert gfni
    torch.manual_seed(0)
    k = 768 if fmt.endswith("_K") else 320
    raw = random_raw(fmt, 64, k)
    blob, bias = quant.pack([raw]), torch.randn(64)
    x = (torch.randn(20, k) * 3).to(torch.bfloat16)
    try:
        assert not ops.set_quant_gfni(False)
        shifted = {m: kernels.linear(x[:m], blob, bias) for m in (1, 3, 5, 20)}
    finally:
        assert ops.set_quant_gfni(True) == gfni
    for m, y in shifted.items():
        assert torch.equal(kernels.linear(x[:m], blob, bias), y), (fmt, m)
    check_linear(fmt, 3)


def test_the_prefetch_distance_never_changes_a_result():
    """The quantized kernels' prefetch distance (per format) and hint (where the lines go; both settable at run time
    for measuring) move bytes earlier, never the result, in the GEMV, the 4-row tiles of a wider call and the AMX
    tiles' decode; out-of-range distances, unknown formats and hints are refused with what is allowed, and a reset
    restores the defaults. On Intel CPUs every format streams 8 KiB ahead into L2 (PREFETCHT1 measured 1.2-1.5x
    faster a token there, PREFETCHNTA 1.6-2.6x slower). On AMD CPUs non-temporally: in the AVX-512 build none for Q4_0,
    which measured faster without it, 4 KiB for Q8_0 and the K formats; 4 KiB for all in the AVX2 build."""
    ops = torch.ops.deploykit
    ids = quant.GGML_IDS
    defaults = kernels.quant_stream_ahead()
    assert defaults == kernels.status()["quant_stream_ahead"]
    assert defaults == {f: int(ops.quant_stream_ahead(i)) for f, i in ids.items()}
    amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    assert kernels.quant_stream_hint() == kernels.status()["quant_stream_hint"] == ("nta" if amd else "l2")
    if not amd:  # quant_stream.h: Intel's L2 prefetcher wants the requests, its PREFETCHNTA slowed the stream down
        assert set(defaults.values()) == {8192}
    elif kernels.status()["variant"] == "avx2":  # streamed ahead in every format (quant_stream.h)
        assert set(defaults.values()) == {4096}
    else:
        assert defaults["Q4_0"] == 0 and defaults["Q8_0"] == defaults["Q4_K"] == defaults["Q6_K"] == 4096
    blobs = {f: quant.pack([random_raw(f, 256, 2048)]) for f in ("Q4_0", "Q4_K")}  # 16 groups of 16 rows each
    # (Q4_0: 18 KiB a group); 64 KiB ahead runs past the blob (a prefetch never faults), shorter distances land in
    # the next groups. 1 and 4 rows: the GEMV; 9: its 4-row tiles; 16: AMX tiles where the CPU has them.
    counts = (1, 4, 9, 16)
    x = torch.randn(max(counts), 2048).bfloat16()
    want = {f: [kernels.linear(x[:m], b) for m in counts] for f, b in blobs.items()}

    def same() -> bool:
        return all(torch.equal(kernels.linear(x[:m], b), w) for f, b in blobs.items() for m, w in zip(counts, want[f]))
    try:
        for hint in ("nta", "l2"):
            ops.set_quant_stream_hint(hint)
            assert kernels.quant_stream_hint() == hint
            for ahead in (0, 64, 8192, 65536):
                ops.set_quant_stream_ahead(ahead)
                assert set(kernels.quant_stream_ahead().values()) == {ahead}
                assert same(), (hint, ahead)
        ops.reset_quant_stream_ahead()
        assert kernels.quant_stream_hint() == ("nta" if amd else "l2")
        ops.set_quant_stream_ahead(128, ids["Q4_0"])  # one format only
        assert kernels.quant_stream_ahead() == {**defaults, "Q4_0": 128}
        assert same()
        for bad in (-64, 100, 65536 + 64):
            with pytest.raises(RuntimeError, match="multiple of 64 bytes up to 65536"):
                ops.set_quant_stream_ahead(bad)
        with pytest.raises(RuntimeError, match="not a quantized format's ggml type id: 1"):
            ops.set_quant_stream_ahead(64, 1)  # F16
        with pytest.raises(RuntimeError, match="not a quantized format's ggml type id: 0"):
            ops.quant_stream_ahead(0)
        for far in (ids["Q4_0"] + 2**32, -ids["Q4_0"]):  # not truncated to a known id
            with pytest.raises(RuntimeError, match=f"not a quantized format's ggml type id: {far}"):
                ops.set_quant_stream_ahead(64, far)
            with pytest.raises(RuntimeError, match=f"not a quantized format's ggml type id: {far}"):
                ops.quant_stream_ahead(far)
        with pytest.raises(RuntimeError, match='prefetch hint is "nta" or "l2", not "t0"'):
            ops.set_quant_stream_hint("t0")
        assert kernels.quant_stream_ahead() == {**defaults, "Q4_0": 128}
        assert kernels.quant_stream_hint() == ("nta" if amd else "l2")
    finally:
        ops.reset_quant_stream_ahead()
    assert kernels.quant_stream_ahead() == defaults


def test_what_the_planner_counts_is_what_the_engine_holds(smollm2):
    """SmolLM2's Q4_1 file: the plan's weight bytes are the bytes the loaded model holds, and both say which
    tensors took which path."""
    from deploykit import isa, memory
    from engine.config import EngineConfig
    from engine.core import EngineCore
    shape = memory.shape(type("S", (), {"source": smollm2, "revision": None, "architecture": None})())
    planned = shape.weight_bytes("bfloat16", "none", isa.quantized_kernels(isa.cpu_flags()))
    core = EngineCore(EngineConfig(smollm2, dtype="bfloat16", max_model_len=256))
    assert core.model.weight_bytes == planned
    assert core.model.weight_paths["Q4_1"] == {"quantized Q4_1": 210}
    assert core.model.weight_paths["Q8_0"] == {"quantized Q8_0": 1}  # the tied embedding / lm_head
    assert shape.held_formats("none", True) == ("Q4_1", "Q8_0")
    assert shape.weight_bytes("bfloat16", "dequantize", True) == shape.num_parameters * 2
    held = EngineCore(EngineConfig(smollm2, dtype="bfloat16", max_model_len=256, quantization="dequantize",
                                   compact_weights=False))
    assert held.model.weight_paths["Q4_1"] == {"bfloat16": 210}
    if kernels.status()["variant"] not in isa.FULL_VARIANTS:
        return  # compact bf16 is an AVX-512 build's (the AVX2 one holds the quantized-weight and fp32 ops only)
    # Compact bf16 (the default) holds the same matrices in 12 bits a weight: the plan's 16 bits are an upper bound.
    compact = EngineCore(EngineConfig(smollm2, dtype="bfloat16", max_model_len=256, quantization="dequantize"))
    assert compact.model.weight_paths["Q4_1"] == {"bfloat16 compact (12-bit, lossless)": 210}
    assert compact.model.weight_bytes < 0.85 * held.model.weight_bytes  # the tied embedding (21 %) stays 16-bit


@pytest.mark.parametrize("file, formats", [("Q4_K_M", ("Q4_K", "Q5_0", "Q6_K", "Q8_0")),
                                           ("Q5_K_M", ("Q5_1", "Q5_K", "Q6_K", "Q8_0"))])
def test_the_planner_counts_a_k_quant_mix_at_the_bytes_the_engine_holds(smollm2_requantized, file, formats):
    """llama.cpp's Q4_K_M and Q5_K_M mixes (SmolLM2 requantized): every format stays in its blocks, and the plan's
    weight bytes are the loaded model's, within 3 % of the file's (Q4_K's and Q5_K's u8 sub-scales take 0.125 bits a
    weight more than the file's 6-bit ones; measured: 1.003x for both files)."""
    from deploykit import isa, memory
    from engine.config import EngineConfig
    from engine.core import EngineCore
    path = smollm2_requantized[file]
    shape = memory.shape(type("S", (), {"source": path, "revision": None, "architecture": None})())
    assert shape.held_formats("none", True) == formats
    planned = shape.weight_bytes("float32", "none", isa.quantized_kernels(isa.cpu_flags()))
    core = EngineCore(EngineConfig(path, dtype="float32", max_model_len=256))
    assert core.model.weight_bytes == planned
    assert {p for paths in core.model.weight_paths.values() for p in paths if p.startswith("quantized")} == \
        {f"quantized {f}" for f in formats}
    import gguf
    in_file = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert in_file <= core.model.weight_bytes <= 1.03 * in_file, (core.model.weight_bytes, in_file)


def test_the_rule_needs_whole_groups_and_chunks():
    assert rule.fits("Q4_0", (64, 128)) and not rule.fits("Q4_0", (64, 96)) and not rule.fits("Q4_0", (40, 128))
    assert rule.fits("Q4_K", (16, 512)) and not rule.fits("Q4_K", (16, 384))
    assert rule.held_as("Q4_K", (16, 512), "none", native=False) is None          # no int8 kernels: dequantized
    assert rule.held_as("F16", (16, 512), "q8_0", native=True) == "Q8_0"         # a float matrix, quantized on load
    assert rule.held_as("F32", (512,), "q8_0", native=True) is None              # norms never
    assert rule.held_as("Q6_K", (16, 512), "dequantize", native=True) is None
