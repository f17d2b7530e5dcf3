// The bf16-weight GEMV for up to FEW_ROWS fp32 activation rows: bf16 weights packed as kernels.pack lays them out,
// [N/16, K/2, 16, 2], widened to fp32 in registers (why and how: bf16w_linear.cpp). The per-op linear_bf16w and the
// fused fp32 decode step (decode_step_f32.cpp) both run groups() on their share of the column groups (through
// bf16w_blocked.h rows), so the two agree bitwise. AVX2 + FMA only; every build includes it.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>

namespace deploykit {
namespace bf16w {

constexpr int64_t COLS = 16;  // output columns per packed line (kernels.pack)
constexpr int64_t FEW_ROWS = 4;  // up to this many rows, groups(); beyond, bf16w_linear.cpp's blocked()

// A 32-byte half line (8 columns' k-pairs, one a lane) widened to fp32: the even k (low halves), the odd k (high).
inline __m256 even_k(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_k(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// out[m, 16 g .. 16 g + 16 GR) for MT activation rows against GR packed column groups from g on: 2 GR MT
// accumulators (<= 8 of AVX2's 16 registers; the rest hold the widened line and the broadcasts). Each output is one
// FMA chain, two links a k-pair (even k, then odd), so a chain waits ~8 cycles a k-pair: tiles take two groups at
// once to keep enough chains in flight. No software prefetch: 2-4 KiB ahead (T0 or NTA) cost 20-30 % at 1-2 rows on
// a Zen 3, whose hardware prefetcher follows each thread's one stream.
template <int MT, int GR>
inline void tile(const at::BFloat16* w, int64_t K, int64_t g, const float* x, int64_t ldx, const float* bias,
                 float* out, int64_t ldo) {
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
        const __m256 we = even_k(v), wo = odd_k(v);
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

// Groups [g0, g1) for M <= FEW_ROWS activation rows, two groups and two rows a tile: a group pair's weights come from
// memory for the first tile and from L1/L2 (K * 64 bytes: 56 KB at K = 896) for the rest. Measured on a 2-core Zen 3:
// one row reads the weights at the stream probe's rate; one 4-row tile of one group took 36-39 GMAC/s where these
// tiles took 45-60 (its 8 broadcasts a k-pair cost more than a second line's loads and widening); at 3 rows one
// 3-row tile was the faster.
inline void groups(const at::BFloat16* w, int64_t K, int64_t g0, int64_t g1, const float* x, int64_t ldx, int64_t M,
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

}  // namespace bf16w
}  // namespace deploykit
