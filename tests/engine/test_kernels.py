"""Native matmul kernels agree with the pure-PyTorch path, are thread-count independent, and degrade loudly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deploykit import isa
from engine.kernels import build, loader
from tests.engine.conftest import NATIVE, attention_reference

ROOT = Path(__file__).resolve().parents[2]
VARIANT = loader.variant_for(isa.cpu_flags())
HAS_AMX = {"amx_tile", "amx_bf16"} <= isa.cpu_flags()
needs_bf16 = pytest.mark.skipif(not NATIVE, reason="CPU lacks AVX-512: native kernels never load here")


@pytest.fixture(scope="session")
def kernels(native_kernels):
    """engine.kernels with the native library loaded (a failed build fails the test on an AVX-512 CPU)."""
    return native_kernels


def bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference on the same bf16 inputs and the per-element error the kernels may show against it.

    bf16 x bf16 products are exact in fp32, so the only differences are (a) fp32 summation in another
    order: <= K * 2^-24 * sum|x*w| (a factor 2 above the classic recursive-summation bound), and (b) one
    final round-to-nearest to bf16: <= 2^-8 relative (8 significant bits).
    """
    xf, wf = x.float(), w.float()
    ref = F.linear(xf, wf, None if bias is None else bias.float())
    magnitude = F.linear(xf.abs(), wf.abs(), None if bias is None else bias.float().abs())
    summation = 2 * (w.shape[1] + 1) * 2.0**-24 * magnitude
    return ref, summation + 2.0**-8 * (ref.abs() + summation)


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref, tol = bound(x, w, bias)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    err = (y.float() - ref).abs()
    worst = (err - tol).argmax()
    assert bool((err <= tol).all()), f"error {err.flatten()[worst]:.3g} > tol {tol.flatten()[worst]:.3g}"


def make(m: int, k: int, n: int, with_bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 7919 + m * 131 + k * 17 + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    return x, w, b


# (K, N): packable model shapes, odd K/N, K not a multiple of 32, N not a multiple of 16.
SHAPES = [(896, 1152), (4864, 896), (64, 48), (96, 80), (33, 7), (130, 17), (1000, 33), (7, 64), (896, 151)]
PLAIN = [(896, 2048), (96, 80), (130, 17)]  # as a tied lm_head: never packed


@needs_bf16
@pytest.mark.parametrize("k,n", PLAIN)
def test_unprepared_weights_match_fp32_reference(kernels, k, n):
    """Weights the model keeps plain (tied embeddings) take the row / plain-AMX kernels by batch size."""
    for m in [*range(1, 18), 33, 64, 65]:
        x, w, b = make(m, k, n, with_bias=m % 3 == 0)
        assert_close(kernels.linear(x, w, b), x, w, b)


@needs_bf16
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.slow
def test_linear_matches_fp32_reference_for_all_small_batches(kernels, k, n, with_bias):
    for m in range(1, 18):
        x, w, b = make(m, k, n, with_bias)
        wp = kernels.prepare_weight(w)
        assert_close(kernels.linear(x, wp, b), x, w, b)


@needs_bf16
def test_packable_weights_are_packed_and_others_kept_plain(kernels):
    assert kernels.is_packed(kernels.prepare_weight(torch.zeros(64, 96, dtype=torch.bfloat16)))
    odd = torch.zeros(48, 33, dtype=torch.bfloat16)
    assert kernels.prepare_weight(odd).shape == odd.shape
    fp32 = torch.zeros(64, 96)
    assert kernels.prepare_weight(fp32).shape == fp32.shape


@needs_bf16
@pytest.mark.parametrize("op", ["linear_packed_avx512", "linear_packed_amx", "linear_rows", "linear_plain_amx"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 48, 100])
def test_each_native_kernel_at_every_batch_shape(kernels, op, m):
    """Every kernel, not only the one the dispatcher picks for m, including M tails of the AMX 32-row blocks."""
    if "amx" in op and not kernels.status()["amx"]:
        pytest.skip("no AMX on this CPU")
    for k, n in [(64, 32), (896, 1152), (160, 48), (96, 80)]:
        x, w, b = make(m, k, n, with_bias=m % 2 == 1)
        wt = kernels.pack(w) if "packed" in op else w
        assert_close(getattr(torch.ops.deploykit, op)(x, wt, b), x, w, b)


@needs_bf16
def test_leading_dims_and_non_contiguous_x(kernels):
    _, w, b = make(1, 896, 1152, True)
    wp = kernels.prepare_weight(w)
    wide = torch.randn(2, 5, 1000).bfloat16()
    x = wide[..., 50:946]  # [2, 5, 896], row stride 1000: passed to the kernel without a copy
    y = kernels.linear(x, wp, b)
    assert y.shape == (2, 5, 1152)
    assert_close(y.reshape(10, 1152), x.reshape(10, 896), w, b)
    xt = torch.randn(896, 3).bfloat16().t()  # [3, 896] with column stride 3: copied
    assert_close(kernels.linear(xt, wp, b), xt, w, b)
    xs = torch.randn(4, 2 * 896).bfloat16()[:, ::2]  # element stride 2
    assert_close(kernels.linear(xs, wp, None), xs, w, None)


@needs_bf16
def test_empty_batch_and_fp32_inputs_follow_f_linear(kernels):
    _, w, b = make(1, 96, 64, True)
    wp = kernels.prepare_weight(w)
    assert kernels.linear(torch.zeros(0, 96, dtype=torch.bfloat16), wp, b).shape == (0, 64)
    empty = torch.zeros(0, 96, dtype=torch.bfloat16)
    assert torch.ops.deploykit.linear_packed_avx512(empty, wp, b.float()).shape == (0, 64)  # the op itself, too
    x = torch.randn(3, 96)
    y = kernels.linear(x, kernels.prepare_weight(w.float()), b.float())
    torch.testing.assert_close(y, F.linear(x, w.float(), b.float()))


@needs_bf16
@pytest.mark.parametrize("m", [1, 4, 16, 64, 77])
def test_results_do_not_depend_on_thread_count(kernels, m):
    """Each output is computed by one thread in a fixed order, so results are bitwise identical."""
    x, w, b = make(m, 896, 1152, True)
    wp = kernels.prepare_weight(w)
    x2, w2, b2 = make(m, 130, 17, True)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append((kernels.linear(x, wp, b), kernels.linear(x2, w2, b2)))
    finally:
        torch.set_num_threads(before)
    for y, y2 in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(y2, outs[0][1])


@needs_bf16
def test_only_torchs_openmp_runtime_is_mapped(kernels):
    kernels.linear(*make(4, 96, 64, False)[:2])
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if any(r in line for r in ("libgomp", "libiomp", "libomp"))}
    assert len(runtimes) == 1 and Path(next(iter(runtimes))).parent == Path(torch.__file__).parent / "lib", runtimes


@needs_bf16
def test_stream_read_probe_reads_every_line(kernels):
    """The benchmark's roofline probe must really load all memory: a lone set bit anywhere is found."""
    t = torch.zeros(1 << 20, dtype=torch.int64)  # 8 MiB, spread over both threads' streams and the tail
    for index in (0, 12345, (1 << 20) - 1, 777_777):
        t.zero_()
        t[index] = 1 << (index % 63)
        for streams in (1, 3, 4, 8):  # the roofline takes the best stream count; each must read everything
            for ahead in (0, 4096):  # with its prefetch running past the end too
                assert torch.ops.deploykit.stream_read(t, streams, ahead) == 1 << (index % 63)
    with pytest.raises(RuntimeError, match="multiple of 64 bytes up to 65536, not 100"):
        torch.ops.deploykit.stream_read(t, 1, 100)


# Shapes of the streaming/batching bitwise checks: the model's qkv and down, and a block count no multiple of 8.
STREAM_SHAPES = [(896, 1152), (4864, 896), (96, 16 * 13)]


def each_streaming(kernels, m: int):
    """(K, N, x, packed w, bias, {streams: y}) per STREAM_SHAPES, y computed under each way the GEMV streams its
    weights (gemv.h Streams; the host's pick is restored)."""
    ops = torch.ops.deploykit
    picked = int(ops.gemv_streams())
    try:
        for k, n in STREAM_SHAPES:
            x, w, b = make(m, k, n, True)
            wp, bias = kernels.prepare_weight(w), kernels.prepare_bias(b)
            out = {}
            for streams in (8, 1):
                ops.set_gemv_streams(streams)
                out[streams] = ops.linear_packed_avx512(x, wp, bias)
            yield k, n, (x, w, b), (wp, bias), out
    finally:
        ops.set_gemv_streams(picked)


@needs_bf16
@pytest.mark.parametrize("m", [5, 8, 16, 17, 40])
def test_a_rows_output_does_not_depend_on_the_batch_it_is_in(kernels, m):
    """Every packed bf16 tiling (1-4 rows, 8-row passes over pairs of blocks for 5-16 rows, 4-row tiles above) sums
    each output over k in one fixed order, so a sequence decoded in a batch of m gets bitwise the logits it would get
    alone, under both ways of streaming the weights."""
    for k, n, (x, _, _), (wp, bias), out in each_streaming(kernels, m):
        alone = torch.cat([torch.ops.deploykit.linear_packed_avx512(x[i:i + 1], wp, bias) for i in range(m)])
        for streams, y in out.items():
            assert torch.equal(y, alone), f"K={k} N={n} streams={streams}"


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_streaming_never_changes_a_bit(kernels, m):
    """How the GEMV streams its column blocks is picked per host by timing (kernels/streaming.py), so the two ways
    must give bitwise the same outputs, also on a range whose block count is no multiple of 8 (the 8-stream path
    then runs groups of 4 and single blocks)."""
    for k, n, (x, w, b), _, out in each_streaming(kernels, m):
        assert torch.equal(out[8], out[1]), f"K={k} N={n}"
        assert_close(out[1], x, w, b)


@needs_bf16
def test_gemv_streaming_is_measured_or_forced_by_env(kernels, monkeypatch):
    from engine.kernels import streaming
    ops = torch.ops.deploykit
    picked = int(ops.gemv_streams())
    try:
        choice = streaming.calibrate(ops)
        assert choice.source == "measured" and set(choice.seconds) == {8, 1}
        assert all(0 < t < 1 for t in choice.seconds.values())
        assert int(ops.gemv_streams()) == choice.streams  # what it measured is what now runs
        faster = min(choice.seconds, key=choice.seconds.get)
        assert choice.streams in (faster, 8)  # one stream only when it won (by the margin); a tie keeps 8
        assert "measured over 119 MB" in choice.describe()
        for forced in ("1", "8"):
            monkeypatch.setenv(streaming.ENV, forced)
            choice = streaming.calibrate(ops)
            assert (choice.streams, choice.seconds, int(ops.gemv_streams())) == (int(forced), {}, int(forced))
        monkeypatch.setenv(streaming.ENV, "4")
        with pytest.raises(ValueError, match="DEPLOYKIT_GEMV_STREAMS='4': expected 8 or 1"):
            streaming.calibrate(ops)
        with pytest.raises(RuntimeError, match="gemv streams must be 8 or 1"):
            ops.set_gemv_streams(2)
    finally:
        ops.set_gemv_streams(picked)
    assert kernels.status()["gemv_streams"] == picked


def run_status(env_overrides: dict[str, str]) -> dict:
    env = {**os.environ, **env_overrides}
    out = subprocess.run([sys.executable, "-m", "engine.kernels", "status"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.slow
def test_missing_library_falls_back_and_says_how_to_fix(tmp_path):
    status = run_status({"DEPLOYKIT_KERNEL_DIR": str(tmp_path), "DEPLOYKIT_KERNELS": ""})
    assert status["fp32_ops"] is False and status["quantized"] is False  # no build loaded: nothing native at all
    if VARIANT is not None:
        assert status["path"] == "fallback"
        assert "python -m engine.kernels build" in status["reason"] and str(tmp_path) in status["reason"]
    else:
        assert status["path"] == "fallback" and "AVX-512" in status["reason"]


@pytest.mark.slow
def test_fallback_module_computes_f_linear(tmp_path):
    code = ("import torch, torch.nn.functional as F, engine.kernels as k\n"
            "x = torch.randn(3, 4, 96).bfloat16(); w = torch.randn(64, 96).bfloat16(); b = torch.randn(64).bfloat16()\n"
            "wp = k.prepare_weight(w)\n"
            "assert wp.shape == w.shape\n"
            "assert torch.equal(k.linear(x, wp, b), F.linear(x, w, b))\n"
            "assert k.LIMITS == {} and k.STEP_MAX_ROWS == 0  # no extension: no native limits, and no fused step\n"
            "assert not k.decode_attention_supported(torch.zeros(1, 2, 64, dtype=torch.bfloat16))\n"
            "assert not k.decode_attention_supported(torch.zeros(1, 2, 64)) and not k.fused(torch.zeros(1, 8))\n"
            "print(k.status()['path'])\n")
    env = {**os.environ, "DEPLOYKIT_KERNEL_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fallback"


@needs_bf16
@pytest.mark.slow
def test_stale_library_is_not_loaded(kernels, tmp_path):
    for variant in build.VARIANTS:
        shutil.copy(build.default_dir() / build.library_name(variant), tmp_path / build.library_name(variant))
    manifest = json.loads((build.default_dir() / build.MANIFEST_NAME).read_text())
    manifest["source_hash"] = "0" * 16
    (tmp_path / build.MANIFEST_NAME).write_text(json.dumps(manifest))
    status = run_status({"DEPLOYKIT_KERNEL_DIR": str(tmp_path), "DEPLOYKIT_KERNELS": ""})
    assert status["path"] == "fallback" and "stale" in status["reason"]


def test_every_kernel_source_counts_in_the_source_hash():
    """A header outside build.HEADERS could change without making the built library stale."""
    on_disk = {p.name for p in build.SOURCE_DIR.iterdir() if p.suffix in (".h", ".cpp")}
    assert on_disk == set(build.SOURCES + build.HEADERS)


def test_cpu_without_avx2_is_reported():
    native = loader.load(flags=frozenset({"sse4_2", "avx"}))  # Sandy Bridge: no build runs here
    assert not native.loaded and not native.full and "AVX2" in native.reason


def test_variant_follows_the_cpu_flags():
    base = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert loader.variant_for(frozenset(base)) == "avx512"  # Skylake-SP .. Ice Lake, or a hidden BF16 bit
    assert loader.variant_for(frozenset(base | {"avx512_bf16"})) == "avx512bf16"
    assert loader.variant_for(frozenset(base | {"avx512_bf16", "amx_tile", "amx_bf16"})) == "avx512bf16"
    assert loader.variant_for(frozenset({"avx2", "fma", "f16c"})) == "avx2"  # Zen 2/3, Haswell .. Alder Lake
    assert loader.variant_for(frozenset({"avx2", "fma", "f16c", "avx512f"})) == "avx2"  # no BW/VL/DQ for vec.h
    assert loader.variant_for(frozenset({"avx", "fma", "f16c"})) is None
    assert not isa.quantized_kernels(base) and isa.quantized_kernels(base | {"avx512_vnni"})  # Skylake-SP: no VNNI
    assert isa.quantized_kernels({"avx2"})  # a plan's flags (OF_INTEREST) go by the avx2 tier


@needs_bf16
@pytest.mark.slow
def test_widening_build_matches_the_bf16_build(kernels):
    """The plain AVX-512F library (forced with DEPLOYKIT_KERNELS=avx512, on any AVX-512 CPU) computes what the
    fallback computes, for the matmuls (packed, compact and plain), the fused ops and decode attention."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "import engine.kernels as k\n"
        "assert k.status()['path'] == 'native-avx512', k.status()\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(5, 256).bfloat16(); w = torch.randn(208, 256).bfloat16() / 16; b = torch.randn(208)\n"
        "ref = F.linear(x.float(), w.float(), b)\n"
        "assert k.is_compact(k.prepare_weight(w, compact=True))\n"
        "for m in (1, 5):\n"
        "    for wt in (k.prepare_weight(w), k.prepare_weight(w, compact=True), w):\n"
        "        y = k.linear(x[:m], wt, b.bfloat16()).float()\n"
        "        assert (y - ref[:m]).abs().max() < 0.05, (m, wt.dim(), (y - ref[:m]).abs().max())\n"
        "g = torch.randn(3, 512).bfloat16()\n"
        "assert torch.allclose(k.silu_mul(g).float(), k.fallback_silu_mul(g).float(), atol=2e-2, rtol=2e-2)\n"
        "v = torch.tensor([1.0, -2.5, 3.0e38, 3.4e38, float('nan'), float('inf'), -0.0, 1e-40, 1.00390625,\n"
        "                  1.01171875, -1.00390625, 65504.0, 1e-3, 7.0, 2.0 ** -126, -3.0])\n"
        "for wt in (k.prepare_weight(w[:16]), w[:16]):  # x = 0: the output is the fp32 bias rounded to bf16\n"
        "    out = k.linear(torch.zeros(1, 256).bfloat16(), wt, v)[0]\n"
        "    want = torch.where(v.abs() < 2.0 ** -126, v * 0, v).bfloat16()  # denormals -> signed 0, as the ISA\n"
        "    same = (out == want) | (out.isnan() & want.isnan())\n"
        "    assert bool(same.all()), (out, want)  # round to nearest even, NaN kept, overflow to inf\n"
        "h = torch.randn(3, 256).bfloat16(); d = torch.randn(3, 256).bfloat16(); nw = torch.randn(256).bfloat16()\n"
        "h2 = h.clone()\n"
        "got, ref = k.add_rms_norm(h, d, nw, 1e-6), k.fallback_add_rms_norm(h2, d, nw, 1e-6)\n"
        "assert torch.equal(h, h2) and torch.allclose(got.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)\n"
        "x = torch.randn(2, 6, 64).bfloat16(); c, sn = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16()\n"
        "x2 = x.clone(); k.rotary_(x[:, :4], c, sn); k.fallback_rotary_(x2[:, :4], c, sn)\n"
        "assert torch.equal(x, x2)\n"
        "x2 = x.clone(); k.head_rms_norm_(x[:, :4], x[0, 4:].repeat(2, 1), 1e-6)\n"
        "k.fallback_head_rms_norm_(x2[:, :4], x2[0, 4:].repeat(2, 1), 1e-6)\n"
        "assert torch.allclose(x.float(), x2.float(), rtol=2 ** -7, atol=1e-6)\n"
        "kv = torch.randn(40, 8, 2, 2, 64).bfloat16(); q = torch.randn(3, 8, 64).bfloat16()\n"
        "tables = torch.randperm(40)[:15].view(3, 5).int(); lens = torch.tensor([1, 19, 40], dtype=torch.int32)\n"
        "for window in (0, 7):\n"
        "    o = k.decode_attention(q, kv, tables, lens, 0.125, window).double()\n"
        "    for b, n in enumerate(lens.tolist()):\n"
        "        t0 = max(0, n - window) if window else 0\n"
        "        ctx = torch.stack([kv[tables[b, t // 8], t % 8] for t in range(t0, n)]).double()\n"
        "        kk, vv = (ctx[:, i].repeat_interleave(4, dim=1) for i in (0, 1))\n"
        "        p = (torch.einsum('hd,thd->ht', q[b].double(), kk) * 0.125).softmax(-1)\n"
        "        assert torch.allclose(o[b], torch.einsum('ht,thd->hd', p, vv), rtol=2 ** -7, atol=2 ** -7)\n"
        "print('ok')\n")
    env = {**os.environ, "DEPLOYKIT_KERNELS": "avx512"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@needs_bf16
@pytest.mark.parametrize("m,h", [(1, 896), (16, 896), (3, 100), (5, 17)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_reference_and_updates_the_residual(kernels, m, h, with_delta):
    g = torch.Generator().manual_seed(m * h)
    base = (torch.randn(m, h, generator=g) * 3).bfloat16()
    delta = torch.randn(m, h, generator=g).bfloat16() if with_delta else None
    w = torch.randn(h, generator=g).bfloat16()
    native, ref = base.clone(), base.clone()
    y = kernels.add_rms_norm(native, delta, w, 1e-6)
    y_ref = kernels.fallback_add_rms_norm(ref, delta, w, 1e-6)
    assert torch.equal(native, ref)  # the residual stream is updated in place, rounded to bf16 like h += delta
    # Independent fp64 check of the reference itself, within one bf16 rounding of the output.
    hf = ref.double()
    exact = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(y_ref.double(), exact, rtol=2 ** -7, atol=1e-6)
    assert torch.allclose(y.float(), y_ref.float(), rtol=2 ** -7, atol=1e-6)


@needs_bf16
@pytest.mark.parametrize("m,i", [(1, 4864), (16, 4864), (2, 37)])
def test_silu_mul_matches_reference_including_extremes(kernels, m, i):
    g = torch.Generator().manual_seed(i)
    gu = (torch.randn(m, 2 * i, generator=g) * 4).bfloat16()
    gu[0, :6] = torch.tensor([-200.0, 200.0, 0.0, -0.0, 1e-30, -88.0])  # saturating exp both ways, signed zero
    y = kernels.silu_mul(gu)
    gate, up = gu.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    assert torch.allclose(y.double(), exact, rtol=2 ** -7, atol=1e-30)
    # Equal to the PyTorch composition except where exp saturates (|silu| < 1e-30 there instead of 0).
    assert torch.allclose(y.float(), kernels.fallback_silu_mul(gu).float(), rtol=0, atol=1e-30)


@needs_bf16
@pytest.mark.parametrize("m,heads,d", [(1, 16, 64), (16, 16, 64), (2, 3, 80), (1, 2, 34)])
def test_rotary_in_place_on_a_strided_qkv_view(kernels, m, heads, d):
    g = torch.Generator().manual_seed(heads * d)
    qkv = torch.randn(m, heads + 2, d, generator=g).bfloat16()  # q/k heads first, then 2 untouched v heads
    cos, sin = torch.randn(m, d, generator=g).bfloat16(), torch.randn(m, d, generator=g).bfloat16()
    native, ref = qkv.clone(), qkv.clone()
    kernels.rotary_(native[:, :heads], cos, sin)
    kernels.fallback_rotary_(ref[:, :heads], cos, sin)
    assert torch.equal(native, ref)
    assert torch.equal(native[:, heads:], qkv[:, heads:])
    # fp64 from the definition: with the signed table sin = [-sin, sin], roll(x, D/2) * sin is HF's
    # rotate_half(x) * sin; the op is x * cos + (x's halves swapped) * sin.
    x, half = qkv[:, :heads].double(), d // 2
    exact = x * cos.double()[:, None] + torch.cat([x[..., half:], x[..., :half]], -1) * sin.double()[:, None]
    assert torch.allclose(native[:, :heads].double(), exact, rtol=2 ** -7, atol=2 ** -6)


@needs_bf16
@pytest.mark.parametrize("m,heads,d", [(1, 6, 128), (4, 18, 64), (2, 3, 40)])
def test_head_rms_norm_in_place_on_the_q_and_k_heads_of_a_qkv_view(kernels, m, heads, d):
    g = torch.Generator().manual_seed(heads * d + m)
    qkv = (torch.randn(m, heads + 2, d, generator=g) * 3).bfloat16()  # q/k heads first, then 2 untouched v heads
    w = torch.randn(heads, d, generator=g).bfloat16()                  # one weight row per head (Qwen3 q/k norm)
    native, ref = qkv.clone(), qkv.clone()
    kernels.head_rms_norm_(native[:, :heads], w, 1e-6)
    kernels.fallback_head_rms_norm_(ref[:, :heads], w, 1e-6)
    assert torch.equal(native[:, heads:], qkv[:, heads:])
    x = qkv[:, :heads].double()
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(native[:, :heads].double(), exact, rtol=2 ** -7, atol=1e-6)
    assert torch.allclose(native.float(), ref.float(), rtol=2 ** -7, atol=1e-6)


@needs_bf16
@pytest.mark.parametrize("heads,kv_heads,d,block,lens", [
    (14, 2, 64, 16, [1]), (14, 2, 64, 16, [17]), (8, 8, 128, 16, [1, 40, 100]),
    (32, 8, 128, 32, [5, 300, 64, 1000]), (4, 1, 32, 8, [9, 8, 7])])
def test_decode_attention_reads_scattered_blocks_in_place(kernels, heads, kv_heads, d, block, lens):
    g = torch.Generator().manual_seed(heads * d + len(lens))
    kv = torch.randn(200, block, 2, kv_heads, d, generator=g).bfloat16()
    width = max(-(-n // block) for n in lens)
    tables = torch.randperm(200, generator=g)[:len(lens) * width].view(len(lens), width).int()  # out of order
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d, generator=g).bfloat16()
    q, lens_t = qkv[:, :heads], torch.tensor(lens, dtype=torch.int32)                  # q: a strided view
    out = kernels.decode_attention(q, kv, tables, lens_t, d ** -0.5)
    exact = attention_reference(q, kv, tables, lens_t, d ** -0.5)
    assert out.shape == (len(lens), heads, d)
    assert torch.allclose(out.double(), exact, rtol=2 ** -7, atol=2 ** -7)
    for window in (1, 7, 64):  # sliding window: shorter than some contexts, longer than others
        out = kernels.decode_attention(q, kv, tables, lens_t, d ** -0.5, window)
        exact = attention_reference(q, kv, tables, lens_t, d ** -0.5, window)
        assert torch.allclose(out.double(), exact, rtol=2 ** -7, atol=2 ** -7), window


needs_amx = pytest.mark.skipif(not HAS_AMX, reason="the native prefill attention runs on AMX-BF16 tiles only")


@pytest.mark.skipif(not HAS_AMX, reason="decode attention's scores take AMX tiles only where the CPU has them")
@pytest.mark.parametrize("heads,kv_heads,d,block,lens,window", [
    (14, 2, 64, 16, [1, 15, 16, 17, 150, 1100], 0),  # groups of 16 from key 0; the last T % 16 one key at a time
    (14, 2, 64, 16, [150, 1100], 37),                 # a window that starts between multiples of 16: a lead
    (32, 2, 128, 32, [300], 0),                        # G = 16: every column of the tile
    (40, 2, 64, 16, [100], 0),                         # G = 20: more heads than a tile has columns
    (8, 8, 64, 8, [100], 0)])                          # blocks of 8 tokens: no 16 keys in one block
def test_decode_attention_scores_on_tiles(kernels, heads, kv_heads, d, block, lens, window):
    """On AMX the scores of 16 keys at a time and the weighted sum of V come from tiles (kernels/attention.h
    tile_scores, tile_pv; on by default): as close to the exact reference as the vector loops (the switch off); the
    vector loops' own bits where the tiles cannot take the heads; and a row's bits the same whatever blocks its keys
    sit in (the prefix cache's identity depends on it)."""
    assert kernels.status()["attention_tiles"]
    g = torch.Generator().manual_seed(heads * d + block)
    width = max(-(-n // block) for n in lens)
    nb = len(lens) * width + 8
    kv = torch.randn(nb, block, 2, kv_heads, d, generator=g).bfloat16()
    tables = torch.randperm(nb, generator=g)[:len(lens) * width].view(len(lens), width).int()
    # q at 4x: scores of std ~4 make the softmax peaked, so a key scored wrong moves the output past the tolerance
    q = (torch.randn(len(lens), heads, d, generator=g) * 4).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    try:
        torch.ops.deploykit.set_attention_tiles(False)
        vector = kernels.decode_attention(q, kv, tables, lens_t, d ** -0.5, window)
    finally:
        torch.ops.deploykit.set_attention_tiles(True)
    tiles = kernels.decode_attention(q, kv, tables, lens_t, d ** -0.5, window)
    exact = attention_reference(q, kv, tables, lens_t, d ** -0.5, window)
    for out in (tiles, vector):
        assert torch.allclose(out.double(), exact, rtol=2 ** -7, atol=2 ** -7)
    if heads // kv_heads > 16:
        assert torch.equal(tiles, vector)
    # The same keys in other blocks: every block moved, the table rewritten to match.
    moved = torch.randperm(nb, generator=g)
    kv2 = torch.empty_like(kv)
    kv2[moved] = kv
    again = kernels.decode_attention(q, kv2, moved[tables.long()].int(), lens_t, d ** -0.5, window)
    assert torch.equal(again, tiles)


def _prefill_case(g: torch.Generator, heads: int, kv_heads: int, d: int, block: int, end: int):
    """A cache of 200 blocks, one sequence's out-of-order table covering `end` tokens, and a strided q view."""
    kv = torch.randn(200, block, 2, kv_heads, d, generator=g).bfloat16()
    table = torch.randperm(200, generator=g)[:-(-end // block) + 2].int()  # padded past the end, as the runner does
    qkv = torch.randn(end, heads + 2 * kv_heads, d, generator=g).bfloat16()
    return kv, table, qkv[:, :heads]


@needs_amx
@pytest.mark.parametrize("heads,kv_heads,d,block,position,length", [
    (14, 2, 64, 16, 0, 1), (14, 2, 64, 16, 0, 37), (14, 2, 64, 16, 45, 100), (4, 1, 128, 32, 500, 64),
    (8, 8, 256, 16, 5, 33), (8, 2, 64, 16, 0, 300)])
def test_prefill_attention_matches_exact_causal_attention(kernels, heads, kv_heads, d, block, position, length):
    """Each query of a prompt chunk against every key up to its own position (and only the last `window` of them),
    read through the block table in place: the fp64 reference per query, to bf16's resolution."""
    g = torch.Generator().manual_seed(heads * d + position + length)
    end = position + length
    kv, table, q_all = _prefill_case(g, heads, kv_heads, d, block, end)
    q = q_all[position:]
    # The reference as decode attention sees it: query i is a sequence of its own with context position + i + 1.
    tables = table[None].expand(length, -1).contiguous()
    lens = torch.arange(position + 1, end + 1, dtype=torch.int32)
    for window in (0, 1, 7, 100):
        out = kernels.prefill_attention(q, kv, table, position, d ** -0.5, window)
        exact = attention_reference(q, kv, tables, lens, d ** -0.5, window)
        assert out.shape == (length, heads, d)
        assert torch.allclose(out.double(), exact, rtol=2 ** -7, atol=2 ** -7), window


@needs_amx
@pytest.mark.parametrize("window", [0, 50])
def test_prefill_attention_gives_a_query_the_same_bits_however_its_prompt_is_chunked(kernels, window):
    """Chunked prefill and prefix-cache hits compute a prompt's queries in pieces that start anywhere: each query's
    output must be bitwise the one it gets with the whole prompt in one call."""
    g = torch.Generator().manual_seed(window + 1)
    kv, table, q = _prefill_case(g, 14, 2, 64, 16, 333)
    whole = kernels.prefill_attention(q, kv, table, 0, 0.125, window)
    for cuts in ([1, 2, 17, 100, 333], [63, 64, 65, 333], [250, 333], [5, 77, 200, 201, 333]):
        start = 0
        for cut in cuts:
            part = kernels.prefill_attention(q[start:cut], kv, table, start, 0.125, window)
            assert torch.equal(part, whole[start:cut]), (cuts, start, cut)
            start = cut


@needs_amx
def test_prefill_attention_refuses_what_it_cannot_read(kernels):
    kv = torch.zeros(4, 16, 2, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(5, 4, 64, dtype=torch.bfloat16)
    i32 = torch.int32
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.prefill_attention(q, kv, torch.tensor([9], dtype=i32), 0, 1.0)
    with pytest.raises(RuntimeError, match="context length"):  # 5 queries from position 12 need 17 > 16 slots
        kernels.prefill_attention(q, kv, torch.tensor([0], dtype=i32), 12, 1.0)
    with pytest.raises(RuntimeError, match="scale must be > 0"):  # each row's max is taken before scaling
        kernels.prefill_attention(q, kv, torch.tensor([0], dtype=i32), 0, -1.0)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 64"):
        kernels.prefill_attention(torch.zeros(5, 4, 32, dtype=torch.bfloat16), kv[..., :32].contiguous(),
                                  torch.tensor([0], dtype=i32), 0, 1.0)
    assert not kernels.prefill_attention_supported(torch.zeros(5, 4, 32, dtype=torch.bfloat16))
    assert kernels.prefill_attention_supported(q)


@needs_bf16
def test_python_limits_are_the_extensions_own_checks(kernels):
    """kernels.LIMITS comes from the extension: a head size is 'supported' exactly when the kernel accepts it, and a
    weight is packed exactly when its shape fits the packed blocks."""
    lim, bf16 = kernels.LIMITS, torch.bfloat16
    assert set(lim) == {"step_max_rows", "step_max_tile_rows", "head_dim_multiple", "max_head_dim", "block_n",
                        "block_k"}
    assert kernels.STEP_MAX_ROWS == lim["step_max_rows"] >= 1
    mult, top = lim["head_dim_multiple"], lim["max_head_dim"]
    for d in (mult, top, top + mult, mult + mult // 2):
        q, kv = torch.zeros(1, 2, d, dtype=bf16), torch.zeros(1, 16, 2, 1, d, dtype=bf16)
        try:
            kernels.decode_attention(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
            accepted = True
        except RuntimeError as e:
            assert f"head_dim must be a multiple of {mult} up to {top}" in str(e)
            accepted = False
        assert kernels.decode_attention_supported(q) is accepted, d
    n, k = lim["block_n"], lim["block_k"]
    assert kernels.is_packed(kernels.prepare_weight(torch.zeros(2 * n, 2 * k, dtype=bf16)))
    for shape in ((2 * n + 1, 2 * k), (2 * n, 2 * k + 2)):
        assert not kernels.is_packed(kernels.prepare_weight(torch.zeros(*shape, dtype=bf16))), shape


@needs_bf16
def test_decode_attention_rejects_tables_that_point_outside_the_cache(kernels):
    kv = torch.zeros(4, 16, 2, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)

    def call(block: int, length: int):
        i32 = torch.int32
        return kernels.decode_attention(q, kv, torch.tensor([[block]], dtype=i32), torch.tensor([length], dtype=i32), 1.0)

    with pytest.raises(RuntimeError, match="out of range"):
        call(9, 3)
    with pytest.raises(RuntimeError, match="context length"):
        call(0, 17)


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 15, 16, 17, 1024, 49152, 151936])
def test_argmax_is_torch_argmax_on_ties_infinities_and_nans(f32_kernels, vocab):
    # The greedy token of every step: the native pass must give torch.argmax's index on everything logits hold
    # (the first of tied maxima, -inf from bans and grammars, a NaN from a broken model), tails included.
    from engine.sampling import _argmax_torch
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g) * 5
    x[1] = -torch.inf                                           # everything banned
    x[2, vocab // 3] = x[2, vocab - 1] = 1e4                    # a tie: the first
    x[3, vocab - 1] = 1e4                                       # the maximum in the tail
    x[4, ::2] = -torch.inf                                      # half banned
    x[5, vocab // 2] = torch.nan                                # NaN counts as the maximum
    x[6, -1] = x[6, vocab // 4] = torch.nan                     # the first NaN
    x[7] = 0.0
    x[7, vocab // 2:] = -0.0                                    # 0 and -0 tie
    x[8, vocab - 1] = torch.inf
    got = f32_kernels.argmax(x)  # every build: AVX-512 or AVX2 (argmax.h)
    assert got.dtype == torch.int64 and got.tolist() == x.argmax(-1).tolist()
    assert _argmax_torch(x).tolist() == x.argmax(-1).tolist()
    strided = torch.zeros(9, vocab + 5)[:, :vocab].copy_(x)     # rows apart in memory (a sliced batch)
    assert f32_kernels.argmax(strided).tolist() == x.argmax(-1).tolist()
