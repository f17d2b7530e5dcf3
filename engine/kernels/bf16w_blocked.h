// The bf16-weight GEMM for more than FEW_ROWS fp32 activation rows (why and how: bf16w_linear.cpp), and rows(),
// which picks it or bf16w_rows.h's GEMV by the row count. The per-op linear_bf16w and the fused fp32 decode step
// (decode_step_f32.cpp, up to 16 rows) both run rows() on their share of the column groups, so the two agree bitwise.
// AVX2 + FMA only; every build includes it.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "bf16w_rows.h"

namespace deploykit {
namespace bf16w {

// The blocked path. Measured on a 2-core Zen 3 (AVX2 FMA peak 44.6 GMAC/s a core): the model's 96 matrices cycled
// from memory, 2 threads, against groups(): 16 rows 44-47 against 35-38 GMAC/s, 64 rows 64-66 against 43-45, 5-12
// rows 1.1-1.2x, 4 rows the same (memory-bound, so groups() keeps them); one thread with the weights in cache, 41-42
// GMAC/s at 64-512 rows (MKL's fp32 GEMM on fp32 weights: 29-38).
constexpr int64_t KC = 128;  // k per widened chunk: [KC, 16] fp32 = 8 KiB, in L1 beside the rows' activations
constexpr int64_t MC = 64;   // rows per block: a chunk is widened once per group per block
constexpr int MR = 6;        // rows per register tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast

// buf [kn, 16] fp32 = group g's weights at k0 .. k0 + kn (k0 and kn even): half line h of k-pair j holds columns
// 8h .. 8h + 7 at k 2j (low halves) and 2j + 1 (high halves).
inline void widen(const at::BFloat16* w, int64_t K, int64_t g, int64_t k0, int64_t kn, float* buf) {
  const auto* line = reinterpret_cast<const __m256i*>(w + g * COLS * K + k0 * COLS);
  for (int64_t j = 0; j < kn / 2; ++j)
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(line + 2 * j + h);
      _mm256_store_ps(buf + 2 * j * COLS + 8 * h, even_k(v));
      _mm256_store_ps(buf + (2 * j + 1) * COLS + 8 * h, odd_k(v));
    }
}

// out[m, 0 .. 16) for MT rows over one chunk buf [kn, 16], row m's activation at k being x[m * ldx + k * xk] (x's rows
// in place: ldx, 1; a packed tile: 1, MT): the chains resume from part [MT, 16] (or from 0 at the first chunk), go on
// in k order, and end in part again, or, at the last chunk, in out with the bias added as tile() does, so the result
// is tile()'s bit for bit.
template <int MT>
inline void micro(const float* buf, int64_t kn, const float* x, int64_t ldx, int64_t xk, float* part, float* out,
                  int64_t ldo, bool first, bool last, const float* bias) {
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = first ? _mm256_setzero_ps() : _mm256_load_ps(part + m * COLS + 8 * h);
#pragma GCC unroll 4  // measured: 41-42 GMAC/s a core against 38-40 rolled
  for (int64_t k = 0; k < kn; ++k) {
    const __m256 w0 = _mm256_load_ps(buf + COLS * k), w1 = _mm256_load_ps(buf + COLS * k + 8);
    for (int m = 0; m < MT; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k * xk);
      acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m)
      if (last) _mm256_storeu_ps(out + m * ldo + 8 * h, _mm256_add_ps(acc[m][h], b));
      else _mm256_store_ps(part + m * COLS + 8 * h, acc[m][h]);
  }
}

// A block's rows in tiles of at most MR rows, as even as they go (16 rows as 6 + 5 + 5, not 6 + 6 + 4: a thin tile
// has fewer chains to hide the FMA latency; 0-5 % faster at 8-64 rows): the first `big` tiles take small + 1 rows.
struct Tiles {
  int64_t n, small, big;
  explicit Tiles(int64_t rows) : n((rows + MR - 1) / MR), small(rows / n), big(n - (n * (small + 1) - rows)) {}
  int64_t rows(int64_t t) const { return t < big ? small + 1 : small; }
};

// x [M, K] (rows ldx apart) -> xp [M * K], what blocked() reads when given it: per block of MC rows, per tile, the
// tile's rows k-major ([K, mt]: the mt activations of a k side by side), so a tile's broadcasts walk one stream.
inline void pack(const float* x, int64_t ldx, int64_t M, int64_t K, float* xp) {
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const Tiles tl(std::min(MC, M - m0));
    for (int64_t t = 0, m = m0; t < tl.n; m += tl.rows(t), ++t) {
      const int64_t mt = tl.rows(t);
      float* d = xp + m * K;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t i = 0; i < mt; ++i) d[k * mt + i] = x[(m + i) * ldx + k];
    }
  }
}

// Groups [g0, g1) for M > FEW_ROWS rows: per block of MC rows, per group, per chunk of KC k: widen the chunk, then
// run the block's rows over it in Tiles, their activations read from x in place or, where the caller packed them,
// from xp (pack() of these M rows). Two things keep the tiles fed (measured on a 2-core Zen 3, the model's 96
// matrices cycled from memory, 2 threads: 16 rows 46-47 -> 52-53 GMAC/s, 64 rows 58-61 -> 64-66, 512 rows 61-64 ->
// 66-70):
//   - the chains' partial sums between chunks stay in `part`, a [MC, 16] buffer in L1, and reach out only at the
//     last chunk: out's rows lie N * 4 bytes apart (N a multiple of 128 in these models), which maps a block's 64
//     rows onto a few of L1's 64 sets, so partial sums kept in out came back from L2 at every chunk;
//   - the next chunk (in memory order: past the group, the next group's first) is prefetched a few lines before each
//     tile rather than all 64 at once, which stalled on the core's outstanding-miss buffers; without any prefetch the
//     widening waits on memory at each chunk (8 rows 26 against 30 GMAC/s). A prefetch past the tensor is harmless.
// A prompt's rows come packed (linear_bf16w): read in place, a tile's activations are MR streams ldx apart that come
// back from L2 for every group; packed, one. Measured on a 2-core Zen 3, 2 threads, the benchmark model's 2,048-token
// prefill in one process, 8 alternating pairs: 0.953x the time, the packing included. The fused decode step's 5-16
// rows are read in place (the same products in the same order either way: packing changes no bit).
inline void blocked(const at::BFloat16* w, int64_t K, int64_t g0, int64_t g1, const float* x, int64_t ldx, int64_t M,
                    const float* bias, float* out, int64_t ldo, const float* xp = nullptr) {
  alignas(64) float buf[KC * COLS];
  alignas(64) float part[MC * COLS];
  constexpr int64_t chunk_bytes = KC * COLS * 2, lines = chunk_bytes / 64;
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t rows = std::min(MC, M - m0);
    const Tiles tl(rows);
    const int64_t per_tile = (lines + tl.n - 1) / tl.n * 64;  // prefetched bytes before each tile
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = std::min(KC, K - k0);
        const bool first = k0 == 0, last = k0 + kn == K;
        widen(w, K, g, k0, kn, buf);
        const char* next = reinterpret_cast<const char*>(w + (g * K + k0 + kn) * COLS);
        int64_t fetched = 0;
        const float* bg = bias ? bias + g * COLS : nullptr;
        const float* xb = x + m0 * ldx + k0;
        float* ob = out + m0 * ldo + g * COLS;
        for (int64_t t = 0, m = 0; t < tl.n; ++t) {
          for (const int64_t e = std::min(fetched + per_tile, chunk_bytes); fetched < e; fetched += 64)
            _mm_prefetch(next + fetched, _MM_HINT_T0);
          const int64_t mt = tl.rows(t);
          float* pt = part + m * COLS;
          float* ot = ob + m * ldo;
          if (xp) {  // the tile's [K, mt] from k0 on
            const float* xt = xp + (m0 + m) * K + k0 * mt;
            switch (mt) {
              case 1: micro<1>(buf, kn, xt, 1, 1, pt, ot, ldo, first, last, bg); break;
              case 2: micro<2>(buf, kn, xt, 1, 2, pt, ot, ldo, first, last, bg); break;
              case 3: micro<3>(buf, kn, xt, 1, 3, pt, ot, ldo, first, last, bg); break;
              case 4: micro<4>(buf, kn, xt, 1, 4, pt, ot, ldo, first, last, bg); break;
              case 5: micro<5>(buf, kn, xt, 1, 5, pt, ot, ldo, first, last, bg); break;
              default: micro<MR>(buf, kn, xt, 1, MR, pt, ot, ldo, first, last, bg); break;
            }
          } else {
            const float* xt = xb + m * ldx;
            switch (mt) {
              case 1: micro<1>(buf, kn, xt, ldx, 1, pt, ot, ldo, first, last, bg); break;
              case 2: micro<2>(buf, kn, xt, ldx, 1, pt, ot, ldo, first, last, bg); break;
              case 3: micro<3>(buf, kn, xt, ldx, 1, pt, ot, ldo, first, last, bg); break;
              case 4: micro<4>(buf, kn, xt, ldx, 1, pt, ot, ldo, first, last, bg); break;
              case 5: micro<5>(buf, kn, xt, ldx, 1, pt, ot, ldo, first, last, bg); break;
              default: micro<MR>(buf, kn, xt, ldx, 1, pt, ot, ldo, first, last, bg); break;
            }
          }
          m += mt;
        }
      }
  }
}

// out[:, 16 g0 .. 16 g1) for M rows of x: up to FEW_ROWS rows stream the weights once (groups), more take the blocked
// GEMM. Both keep each output's FMA chain in k order, so a row's result does not depend on M.
inline void rows(const at::BFloat16* w, int64_t K, int64_t g0, int64_t g1, const float* x, int64_t ldx, int64_t M,
                 const float* bias, float* out, int64_t ldo) {
  if (M <= FEW_ROWS) groups(w, K, g0, g1, x, ldx, M, bias, out, ldo);
  else blocked(w, K, g0, g1, x, ldx, M, bias, out, ldo);
}

}  // namespace bf16w
}  // namespace deploykit
