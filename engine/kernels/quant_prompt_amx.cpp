// A prompt's rows times a block-quantized matrix on AMX-BF16 tiles: each unit (32 k) of a 16-column group is decoded
// to bf16 (value = scale x code + offset, rounded once, as the "dequantized" path would hold it) once for the prompt's
// 32-row blocks, and every block runs its tiles on it (amx_slices.h, as compact weights do).
//
// Why not the AMX-INT8 tiles of quant_amx.h for prompts: every unit has its own weight and activation scales, so each
// 16 x 16 int32 C tile is folded into fp32 per unit, ~50 vector instructions next to one 16-cycle tdpbssd, and the
// fold cannot be shared between row blocks. Decoded to bf16, a unit is decoded once for all of a chunk's row blocks
// and the fp32 sums stay in the tiles over a segment of K (amx_tiles.h). A 512-token prefill of a Q4_0 file took
// 0.47 s there against 0.28-0.31 s for the same model's bf16 weights (issue 19 asks no slower).
//
// A prompt row gets the same tdpbf16ps sequence whatever rows share its call (1 row or a 4,096-token chunk), so a
// prompt computes the same bits however it is chunked or how much of it the prefix cache held. Decode rows keep the
// int8 GEMV (quant_linear): its rounding differs, which is why the prefix cache offers only blocks a prefill filled
// (kv_cache.py commit). The model says which rows are a prompt's (kernels.linear's `prompt_from`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <optional>

#include "op_args.h"
#include "quant_amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#include "amx_slices.h"
#define DEPLOYKIT_PROMPT_AMX 1
#endif

namespace deploykit {

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blob, const std::optional<at::Tensor>& bias,
                        bool float_out);  // qlinear.cpp

namespace {

using namespace quant;
using bf16 = at::BFloat16;

// On where the CPU has AMX-BF16 and the OS grants tile state (engine/kernels/__init__.py at load); runtime-settable
// so that tests compare both paths in one process.
std::atomic<bool> enabled{false};

#ifdef DEPLOYKIT_PROMPT_AMX

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Lane l of a 64-byte k-group (16 columns x 4 k, quant_layout.h) widened 16 bytes at a time is column 4i + l / 4.
inline __m512 spread(__m512 per_column, int i) {
  return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * i), _mm512_srli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2)), per_column);
}

// Unit u of the chunk at ch -> dst [16 k-pairs][16 columns][2] bf16, value = s q + o per column in fp32 (exact
// products; Q4_1/Q5_1/Q4_K/Q5_K round once at the add), then rounded to bf16: dequant_row's values, rounded.
template <int F>
[[gnu::always_inline]] inline void unit_bf16(const uint8_t* ch, int u, bf16* dst) {
  alignas(64) int8_t q[8 * 64];
  quant_amx::decode_unit<F>(ch, u, q);
  const UnitScale<F> us(ch, u);
  __m512 s[2], o = _mm512_setzero_ps();
  if constexpr (F == Q6_K) {  // its two 16-k halves: k-groups 0-3 and 4-7
    s[0] = _mm512_mul_ps(us.w0, _mm512_cvtepi32_ps(us.sa));
    s[1] = _mm512_mul_ps(us.w0, _mm512_cvtepi32_ps(us.sb));
  } else {
    s[0] = s[1] = us.w0;
    if constexpr (F == Q4_1 || F == Q5_1) o = us.w1;
    if constexpr (F == Q4_K || F == Q5_K) o = _mm512_sub_ps(_mm512_setzero_ps(), us.w1);
  }
  __m512 sl[2][4], ol[4];
  for (int i = 0; i < 4; ++i) {
    sl[0][i] = spread(s[0], i);
    sl[1][i] = spread(s[1], i);
    ol[i] = spread(o, i);
  }
  // Dwords (column c, k-pair j) of the converted k-group, 2c + j: k-pair row 0 takes the even ones, row 1 the odd.
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int e = 0; e < 8; ++e) {
    const int h = e / 4;
    __m512 f[4];
    for (int i = 0; i < 4; ++i) {
      const __m512 v = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 64 * e + 16 * i))));
      f[i] = _mm512_fmadd_ps(v, sl[h][i], ol[i]);
    }
    const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
    _mm512_store_si512(dst + (2 * e) * 32, _mm512_permutex2var_epi32(lo, even, hi));
    _mm512_store_si512(dst + (2 * e + 1) * 32, _mm512_permutex2var_epi32(lo, odd, hi));
  }
}

// Every chunk's pairs are decoded once (there is no decode-as-you-go path); a long K (the down projection: 3 blocks a
// chunk) takes the k-slices outermost from 4 blocks, as compact matrices do.
constexpr int64_t OUTER_MIN = 4;

// A quantized matrix as an amx_slices source: column block nb is 16-row group nb of the blob.
struct Source {
  const Matrix& w;
  int64_t K;
  void slice(int64_t nb, int64_t k0, int64_t kn, bf16* dst) {
    const Part& p = part_of(w, nb);
    const int64_t g = nb - p.row0 / 16;
    with_format(p.format, [&](auto f) {
      constexpr int F = decltype(f)::value;
      constexpr Info inf = info_of(F);
      for (int64_t v = k0 / 16; v < (k0 + kn) / 16; ++v)
        unit_bf16<F>(p.at(g, v / inf.units), (int)(v % inf.units), dst + (v - k0 / 16) * 512);
    });
  }
  // The chunks that slice() reads: a 16-row group's chunks hold their scales, so they are one range (in a segmented
  // part, up to the end of the first chunk's segment: the rest is not requested ahead).
  void bytes(int64_t nb, int64_t k0, int64_t kn, const char*& begin, const char*& end) const {
    const Part& p = part_of(w, nb);
    const int64_t g = nb - p.row0 / 16;
    with_format(p.format, [&](auto f) {
      constexpr Info inf = info_of(decltype(f)::value);
      const int64_t c0 = k0 / 16 / inf.units, c1 = ((k0 + kn) / 16 + inf.units - 1) / inf.units;
      const int64_t stop = std::min(c1, (c0 / p.seg + 1) * p.seg);
      begin = reinterpret_cast<const char*>(p.at(g, c0));
      end = reinterpret_cast<const char*>(p.at(g, c0) + (stop - c0) * inf.chunk_bytes);
    });
  }
  void again(int64_t, const amx_slices::XTiles&, int64_t, const int64_t*, int, const float*, bf16*,
             const amx_slices::Pairs&) {
    TORCH_CHECK(false, "quantized prompt rows decode each slice once");  // blocked(_tiles) get once = 1
  }
};

#pragma GCC diagnostic pop

#endif

}  // namespace

// x [M, K] bf16, blob [N, K] quantized, bias [N] or None, prompt_from in [0, M] -> [M, N] bf16: rows before
// prompt_from as quant_linear computes them (decode rows), the rest decoded to bf16 on AMX tiles (prompt rows);
// every row as quant_linear computes it while the path is switched off.
at::Tensor quant_prompt_linear(const at::Tensor& x, const at::Tensor& blob, const std::optional<at::Tensor>& bias,
                               int64_t prompt_from) {
  const Matrix w = matrix(blob);
  const int64_t M = x.size(0);
  TORCH_CHECK(prompt_from >= 0 && prompt_from <= M, "prompt_from must lie in [0, ", M, "], got ", prompt_from);
  if (!enabled.load()) return quant_linear(x, blob, bias, false);  // switched off: every row as a decode row
  const op_args::Operands args = op_args::operands(x, w.K, w.N, bias);
  if (prompt_from > 0) args.out.narrow(0, 0, prompt_from).copy_(quant_linear(x.narrow(0, 0, prompt_from), blob, bias,
                                                                              false));
#ifdef DEPLOYKIT_PROMPT_AMX
  if (prompt_from < M) {
    const at::Tensor xp = x.narrow(0, prompt_from, M - prompt_from);
    Source src{w, w.K};
    amx_slices::blocked(M - prompt_from, xp, src, amx_slices::Pairs{w.N / 16, false}, 1, OUTER_MIN, args.b,
                        args.o + prompt_from * w.N);
  }
#endif
  return args.out;
}

at::Tensor silu_mul(const at::Tensor& gu);  // decode_ops.cpp

// x [M, K] bf16 prompt rows, a quantized gate_up blob [2I, K] (gate rows, then up rows; I % 16 == 0), bias [2I] or
// None -> silu(x W_gate^T + b_gate) * (x W_up^T + b_up) [M, I] bf16: the tiles' epilogue pairs gate block j with up
// block j (amx_tiles.h), bit for bit silu_mul of quant_prompt_linear's rows, without the [M, 2I] intermediate.
at::Tensor quant_prompt_gate_up_silu(const at::Tensor& x, const at::Tensor& blob,
                                     const std::optional<at::Tensor>& bias) {
  const Matrix w = matrix(blob);
  TORCH_CHECK(w.N % 32 == 0, "gate_up needs whole 16-column blocks of gate and of up, got N=", w.N);
  if (!enabled.load()) return silu_mul(quant_linear(x, blob, bias, false));
  [[maybe_unused]] const op_args::Operands args = op_args::operands(x, w.K, w.N, bias);  // checks x and the bias
  at::Tensor out = at::empty({x.size(0), w.N / 2}, x.options());
#ifdef DEPLOYKIT_PROMPT_AMX
  if (x.size(0) > 0) {
    Source src{w, w.K};
    amx_slices::blocked(x.size(0), x, src, amx_slices::Pairs{w.N / 16, true}, 1, OUTER_MIN, args.b,
                        out.data_ptr<bf16>());
  }
#endif
  return out;
}

// A prompt's MLP in panels, as compact_amx.cpp's compact_gate_up_silu_panels and compact_linear_panels: every row a
// prompt's (M > 32), gate_up + SiLU written as panels (amx_slices.h panels_for) with each value the bits
// quant_prompt_gate_up_silu gives it, and a matrix reading panels as its A tiles with each row the bits
// quant_prompt_linear gives it (prompt_from 0), without copying x into tile blocks.
at::Tensor quant_prompt_gate_up_silu_panels(const at::Tensor& x, const at::Tensor& blob,
                                            const std::optional<at::Tensor>& bias) {
#ifdef DEPLOYKIT_PROMPT_AMX
  const Matrix w = matrix(blob);
  TORCH_CHECK(w.N % 64 == 0, "panels of gate_up's output need whole 32-column panels of gate and of up, got N=", w.N);
  op_args::check_x(x, w.K);
  const int64_t M = x.size(0);
  TORCH_CHECK(M > 32, "panels are for a prompt's rows (more than 32), got ", M);
  // Switched off (set_quant_prompt_amx): the int8 rows gate_up_silu gives then, as panels.
  if (!enabled.load()) return amx_slices::panels_of(quant_prompt_gate_up_silu(x, blob, bias));
  const at::Tensor b = op_args::float_bias(bias, w.N);
  at::Tensor out = amx_slices::panels_for(M, w.N / 2, x.options());
  Source src{w, w.K};
  amx_slices::blocked(M, x, src, amx_slices::Pairs{w.N / 16, true, out.size(1) * 32}, 1, OUTER_MIN,
                      b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<bf16>());
  return out;
#else
  TORCH_CHECK(false, "this kernel library was built without AMX");
#endif
}

at::Tensor quant_prompt_linear_panels(const at::Tensor& xp, int64_t M, const at::Tensor& blob,
                                      const std::optional<at::Tensor>& bias) {
#ifdef DEPLOYKIT_PROMPT_AMX
  const Matrix w = matrix(blob);
  TORCH_CHECK(M > 32, "panels are for a prompt's rows (more than 32), got ", M);
  const int64_t rows_pad = amx_slices::panel_rows(xp, M, w.K);
  if (!enabled.load()) return quant_prompt_linear(amx_slices::rows_of(xp, M), blob, bias, 0);  // switched off: int8
  const at::Tensor b = op_args::float_bias(bias, w.N);
  at::Tensor out = at::empty({M, w.N}, xp.options());
  Source src{w, w.K};
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  amx_slices::blocked_tiles(M, amx_slices::XTiles{xp.data_ptr<bf16>(), rows_pad}, src,
                            amx_slices::Pairs{w.N / 16, false}, 1, OUTER_MIN, bp, out.data_ptr<bf16>());
  return out;
#else
  TORCH_CHECK(false, "this kernel library was built without AMX");
#endif
}

// Turns the prompt path on (where the build has AMX-BF16 code and the OS grants tile state) or off; true if now on.
bool set_quant_prompt_amx(bool on) {
#ifdef DEPLOYKIT_PROMPT_AMX
  enabled.store(on && amx_init());
#else
  (void)on;
#endif
  return enabled.load();
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("set_quant_prompt_amx(bool on) -> bool", &set_quant_prompt_amx);
  m.def("quant_prompt_linear(Tensor x, Tensor blob, Tensor? bias, int prompt_from) -> Tensor");
  m.def("quant_prompt_gate_up_silu(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
  m.def("quant_prompt_gate_up_silu_panels(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
  m.def("quant_prompt_linear_panels(Tensor xp, int M, Tensor blob, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("quant_prompt_linear", &quant_prompt_linear);
  m.impl("quant_prompt_gate_up_silu", &quant_prompt_gate_up_silu);
  m.impl("quant_prompt_gate_up_silu_panels", &quant_prompt_gate_up_silu_panels);
  m.impl("quant_prompt_linear_panels", &quant_prompt_linear_panels);
}

}  // namespace deploykit
