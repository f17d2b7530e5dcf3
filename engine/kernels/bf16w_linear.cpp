// linear_bf16w: fp32 activations x [M, K] times bf16 weights packed as kernels.pack lays them out,
// [N/16, K/2, 16, 2] (a 64-byte line is k-pair j of 16 output columns), -> fp32 [M, N]; each weight is widened to
// fp32 in registers.
//
// Why: a CPU without bf16 units (AVX2, or AVX-512 without AVX512-BF16) runs a model in fp32, and held its bf16
// checkpoint's weights widened to fp32 in memory: twice the bytes to hold and, at decode, to read per token, for
// values that are exactly the checkpoint's bf16 ones. Held as bf16 and widened here, every product is the same fp32
// product, from half the bytes. PyTorch's fp32 GEMM (MKL) is also slow at the few rows of a decode step (on a
// 2-core Zen 3: 4.7 GB/s of weights at 4 rows against 14 at one).
//
// Widening: a 32-byte half line is 8 columns' (k 2j, k 2j + 1) pairs, one per 32-bit lane, so `lane << 16` is
// column c's weight at k 2j as fp32 and `lane & 0xFFFF0000` its weight at 2j + 1. Each is multiplied by the
// activation at that k, broadcast: outer products, 8 outputs a register, no horizontal sums. Every output is one FMA
// chain over k in order: the same operations in the same order whatever M is and however the rows and columns are
// tiled, so a row's output does not depend on its batch.
// Written with AVX2 and FMA only, in every build (build.py); tests/engine/test_bf16w_linear.py holds it to an fp64
// evaluation of the product and to itself across batch sizes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace deploykit {
namespace {

constexpr int64_t COLS = 16;  // output columns per packed line (kernels.pack)

// out[m, 16 g .. 16 g + 16 GR) for MT activation rows against GR packed column groups from g on: 2 GR MT
// accumulators (<= 8 of AVX2's 16 registers; the rest hold the widened line and the broadcasts). Each output is one
// FMA chain, two links a k-pair (even k, then odd), so a chain waits ~8 cycles a k-pair: tiles take two groups at
// once to keep enough chains in flight. No software prefetch: 2-4 KiB ahead (T0 or NTA) cost 20-30 % at 1-2 rows on
// a Zen 3, whose hardware prefetcher follows each thread's one stream.
template <int MT, int GR>
inline void tile(const at::BFloat16* w, int64_t K, int64_t g, const float* x, int64_t ldx, const float* bias,
                 float* out, int64_t ldo) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[GR][2][MT];
  for (int q = 0; q < GR; ++q)
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MT; ++m) acc[q][h][m] = _mm256_setzero_ps();
  const int64_t halves = COLS * K / 16;  // 32-byte half lines a group
  const auto* line = reinterpret_cast<const __m256i*>(w + g * COLS * K);
  for (int64_t j = 0; j < K / 2; ++j) {
    __m256 xe[MT], xo[MT];
    for (int m = 0; m < MT; ++m) {
      xe[m] = _mm256_broadcast_ss(x + m * ldx + 2 * j);
      xo[m] = _mm256_broadcast_ss(x + m * ldx + 2 * j + 1);
    }
    for (int q = 0; q < GR; ++q)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(line + q * halves + 2 * j + h);
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int m = 0; m < MT; ++m)
          acc[q][h][m] = _mm256_fmadd_ps(wo, xo[m], _mm256_fmadd_ps(we, xe[m], acc[q][h][m]));
      }
  }
  for (int q = 0; q < GR; ++q)
    for (int h = 0; h < 2; ++h) {
      const int64_t col = (g + q) * COLS + 8 * h;
      const __m256 b = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
      for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo + col, _mm256_add_ps(acc[q][h][m], b));
    }
}

// Groups [g0, g1) for M activation rows, two groups and two rows a tile: a group pair's weights come from memory for
// the first tile and from L1/L2 (K * 64 bytes: 56 KB at K = 896) for the rest. Measured on a 2-core Zen 3 with the
// weights in cache: 45-60 GMAC/s at 4-512 rows where one 4-row tile of one group took 36-39 (its 8 broadcasts a
// k-pair cost more than a second line's loads and widening); at 3 rows one 3-row tile was the faster.
void groups(const at::BFloat16* w, int64_t K, int64_t g0, int64_t g1, const float* x, int64_t ldx, int64_t M,
            const float* bias, float* out, int64_t ldo) {
  int64_t g = g0;
  if (M == 3) {  // measured: one 3-row tile beats a 2-row and a 1-row one
    for (; g < g1; ++g) tile<3, 1>(w, K, g, x, ldx, bias, out, ldo);
    return;
  }
  for (; g + 2 <= g1; g += 2)
    for (int64_t m = 0; m < M; m += 2) {
      if (M - m >= 2) tile<2, 2>(w, K, g, x + m * ldx, ldx, bias, out + m * ldo, ldo);
      else tile<1, 2>(w, K, g, x + m * ldx, ldx, bias, out + m * ldo, ldo);
    }
  if (g < g1)
    for (int64_t m = 0; m < M; m += 2) {
      if (M - m >= 2) tile<2, 1>(w, K, g, x + m * ldx, ldx, bias, out + m * ldo, ldo);
      else tile<1, 1>(w, K, g, x + m * ldx, ldx, bias, out + m * ldo, ldo);
    }
}

bool cpu_runs_it() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

}  // namespace

// x [M, K] fp32 with contiguous rows, w packed bf16 [N/16, K/2, 16, 2], bias fp32 [N] or None -> fp32 [M, N].
at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(cpu_runs_it(), "linear_bf16w needs AVX2 and FMA; this CPU lacks them");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == COLS && w.size(3) == 2 && w.is_contiguous() &&
                  w.scalar_type() == at::kBFloat16,
              "the weight must be packed: a contiguous bf16 [N/16, K/2, 16, 2] tensor");
  const int64_t G = w.size(0), N = G * COLS, K = w.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D fp32 tensor");
  TORCH_CHECK(x.size(1) == K, "x has K=", x.size(1), ", the weight has K=", K);
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const float* xp = x.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Threads take contiguous runs of groups: one weight stream each.
  at::parallel_for(0, G, M <= 4 ? 4 : 1, [&](int64_t g0, int64_t g1) { groups(wp, K, g0, g1, xp, ldx, M, bp, op, N); });
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) { m.def("linear_bf16w(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("linear_bf16w", &linear_bf16w); }

}  // namespace deploykit
