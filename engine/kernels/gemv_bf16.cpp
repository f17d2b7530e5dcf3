// bf16 matrix-vector kernels for batch-1 / small-batch decode: vdpbf16ps, or its AVX-512F widening (vec.h).
//
// Two weight layouts are served:
//   plain  [N, K]            row dot products, any K (masked tail); used for weights the model
//                            cannot repack (e.g. an lm_head tied to the embedding table).
//   packed [N/16, K/2, 16, 2] "VNNI" blocks: one 64-byte line holds the k-pair (2j, 2j+1) of
//                            16 output columns, so x pairs are broadcast and no horizontal
//                            reduction is needed. It is also the AMX B-tile layout (amx_bf16.cpp).
// Every output element is produced by exactly one thread with a fixed operation order, so
// results are bitwise identical for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "gemv.h"
#include "op_args.h"
#include "vec.h"

namespace deploykit {
namespace {

using bf16 = at::BFloat16;
using vec::dot2;
using vec::reduce16;
using vec::to_bf16;
using gemv::packed_block;

// `prefetch`: the next block of R contiguous rows (or nullptr); one of its lines is requested into
// L2 per line loaded here (a block of long rows exceeds L1). R rows of a few KiB are R short
// streams the hardware prefetcher ramps up on too late, costing ~30 % of bandwidth.
template <int R>
inline void rows_accumulate(const bf16* x, const bf16* wr, int64_t K, __m512 acc[R], const char* prefetch) {
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (prefetch)
      for (int r = 0; r < R; ++r) _mm_prefetch(prefetch + (k / 32 * R + r) * 64, _MM_HINT_T1);
    const __m512i xv = _mm512_loadu_si512(x + k);
    for (int r = 0; r < R; ++r)
      acc[r] = dot2(acc[r], _mm512_loadu_si512(wr + r * K + k), xv);
  }
  if (k < K) {
    // Zero-filled lanes contribute 0 * 0; never reads past the row end.
    const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + k);
    for (int r = 0; r < R; ++r)
      acc[r] = dot2(acc[r], _mm512_maskz_loadu_epi16(mask, wr + r * K + k), xv);
  }
}

// out[m, n0:n0+16] for all M x rows; the 16 weight rows stay in L1/L2 across x rows.
inline void rows_block16(const bf16* x, int64_t ldx, int64_t M, const bf16* w, int64_t N, int64_t K, int64_t n0,
                         const float* bias, bf16* out, int64_t ldo) {
  const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  // Later x rows find the block in L1/L2; only the first pass fetches the next block.
  const char* next = n0 + 32 <= N ? reinterpret_cast<const char*>(w + (n0 + 16) * K) : nullptr;
  for (int64_t m = 0; m < M; ++m) {
    __m512 acc[16];
    rows_accumulate<16>(x + m * ldx, w + n0 * K, K, acc, m == 0 ? next : nullptr);
    const __m256i h = to_bf16(_mm512_add_ps(reduce16(acc), bv));
    std::memcpy(out + m * ldo + n0, &h, sizeof(h));
  }
}

// Single-row tail of rows_block16 for N % 16 leftovers.
inline void rows_single(const bf16* x, int64_t ldx, int64_t M, const bf16* w, int64_t K, int64_t n,
                        const float* bias, bf16* out, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    __m512 acc[1];
    rows_accumulate<1>(x + m * ldx, w + n * K, K, acc, nullptr);
    out[m * ldo + n] = bf16(_mm512_reduce_add_ps(acc[0]) + (bias ? bias[n] : 0.0f));
  }
}

// M > TALL_MAX_M rows (prefill; fewer take packed_range or packed_tall) in tiles of 4 over the same G blocks: the
// first tile streams them from memory (prefetching ahead), the later ones find them in L1/L2.
template <int G>
inline void packed_all_m(const bf16* x, int64_t ldx, int64_t M, const bf16* wp, int64_t Kh,
                         int64_t nb0, const float* bias, bf16* out, int64_t ldo) {
  packed_block<G, 4, true>(x, ldx, wp, Kh, nb0, bias, out, ldo);
  int64_t m = 4;
  for (; m + 4 <= M; m += 4) packed_block<G, 4, false>(x + m * ldx, ldx, wp, Kh, nb0, bias, out + m * ldo, ldo);
  switch (M - m) {
    case 3: packed_block<G, 3, false>(x + m * ldx, ldx, wp, Kh, nb0, bias, out + m * ldo, ldo); break;
    case 2: packed_block<G, 2, false>(x + m * ldx, ldx, wp, Kh, nb0, bias, out + m * ldo, ldo); break;
    case 1: packed_block<G, 1, false>(x + m * ldx, ldx, wp, Kh, nb0, bias, out + m * ldo, ldo); break;
    default: break;
  }
}

// 5 <= M <= TALL_MAX_M rows (the per-op decode of 5-16 sequences). packed_all_m's 4-row tiles re-read a group of
// blocks from L2 for every tile after the first, and only the first tile streams from DRAM, so the later tiles'
// compute never overlaps the memory stream (0.26-0.28 TFLOP/s at M = 16 on Zen 4, 0.45 at M = 512). Here a group
// of two column blocks is computed in passes of up to 8 rows (2 x 8 accumulators, one broadcast of x per two dot
// products: one block at a time for all 16 rows would need one per dot product and peaks at 0.35), and every pass
// requests its share of the *next* group's lines into L2, so the DRAM stream runs under all of the compute.
// Each output is still one chain over k, so the results are bitwise those of any other tiling.
constexpr int64_t TALL_MAX_M = 16;
constexpr int TALL_ROWS = 8;  // rows per pass

// out[m, n0 .. n0 + 32) for MT x rows from the two blocks at wb; `next` (or nullptr): lines to request, `per` an
// iteration.
template <int MT>
inline void tall_pass(const bf16* x, int64_t ldx, const bf16* wb, int64_t Kh, const char* next, int per,
                      const float* bias, int64_t n0, bf16* out, int64_t ldo) {
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const bf16* wb1 = wb + Kh * 32;
  for (int64_t kp = 0; kp < Kh; ++kp) {
    if (next)
      for (int i = 0; i < per; ++i) _mm_prefetch(next + (kp * per + i) * 64, _MM_HINT_T1);
    const __m512i w0 = _mm512_loadu_si512(wb + kp * 32), w1 = _mm512_loadu_si512(wb1 + kp * 32);
    for (int m = 0; m < MT; ++m) {
      const __m512i xb = _mm512_set1_epi32(gemv::load_pair(x + m * ldx + 2 * kp));
      acc[m][0] = dot2(acc[m][0], w0, xb);
      acc[m][1] = dot2(acc[m][1], w1, xb);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < 2; ++g) {
      __m512 v = acc[m][g];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + 16 * g));
      const __m256i h = to_bf16(v);
      std::memcpy(out + m * ldo + n0 + 16 * g, &h, sizeof(h));
    }
}

// tall_pass for a runtime 1 <= MT <= TALL_ROWS.
template <int MT = 1>
inline void tall_pass_rows(int64_t rows, const bf16* x, int64_t ldx, const bf16* wb, int64_t Kh, const char* next,
                           int per, const float* bias, int64_t n0, bf16* out, int64_t ldo) {
  if constexpr (MT < TALL_ROWS) {
    if (rows != MT) return tall_pass_rows<MT + 1>(rows, x, ldx, wb, Kh, next, per, bias, n0, out, ldo);
  }
  tall_pass<MT>(x, ldx, wb, Kh, next, per, bias, n0, out, ldo);
}

// Column blocks [b0, b1) for all M rows: pairs of blocks, then a last single block (4-row tiles, packed_all_m).
inline void packed_tall(int64_t M, const bf16* x, int64_t ldx, const bf16* wp, int64_t Kh, int64_t b0, int64_t b1,
                        const float* bias, bf16* out, int64_t ldo) {
  const int64_t passes = (M + TALL_ROWS - 1) / TALL_ROWS;
  const int per = static_cast<int>(2 / passes);  // the next group's 2 Kh lines over passes x Kh iterations
  const int64_t group_bytes = 2 * Kh * 64;
  int64_t nb = b0;
  for (; nb + 2 <= b1; nb += 2) {
    const bf16* wb = wp + nb * Kh * 32;
    const char* next = nb + 4 <= b1 ? reinterpret_cast<const char*>(wb) + group_bytes : nullptr;
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t m0 = p * TALL_ROWS, rows = std::min<int64_t>(TALL_ROWS, M - m0);
      tall_pass_rows(rows, x + m0 * ldx, ldx, wb, Kh, next ? next + p * Kh * per * 64 : nullptr, per, bias,
                     nb * 16, out + m0 * ldo, ldo);
    }
  }
  if (nb < b1) packed_all_m<1>(x, ldx, M, wp, Kh, nb, bias, out, ldo);
}

}  // namespace

// x [M, K] (row stride free), w [N, K] contiguous -> [M, N] bf16.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  op_args::check_plain(w);
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  const op_args::Operands args = op_args::operands(x, K, N, bias);
  const bf16 *xp = args.x, *wp = w.data_ptr<bf16>();
  const float* bp = args.b;
  bf16* op = args.o;
  const int64_t ldx = args.ldx, nblocks = N / 16;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) rows_block16(xp, ldx, M, wp, N, K, blk * 16, bp, op, N);
  });
  for (int64_t n = nblocks * 16; n < N; ++n) rows_single(xp, ldx, M, wp, K, n, bp, op, N);
  return args.out;
}

// x [M, K], wp [N/16, K/2, 16, 2] -> [M, N] bf16 via broadcast x pairs (vec::dot2).
at::Tensor linear_packed_avx512(const at::Tensor& x, const at::Tensor& wp,
                                const std::optional<at::Tensor>& bias) {
  op_args::check_packed(wp);
  const int64_t NB = wp.size(0), Kh = wp.size(1), N = NB * 16, K = Kh * 2, M = x.size(0);
  const op_args::Operands args = op_args::operands(x, K, N, bias);
  const at::Tensor& out = args.out;
  const bf16 *xp = args.x, *w = wp.data_ptr<bf16>();
  const float* bp = args.b;
  bf16* op = args.o;
  const int64_t ldx = args.ldx;
  if (M == 0) return out;
  if (M <= 4) {
    // Each weight line read once for all rows; each thread gets an equal contiguous range of blocks
    // (at::parallel_for splits [0, NB) evenly).
    at::parallel_for(0, NB, 8,
                     [&](int64_t b0, int64_t b1) { gemv::packed_rows(M, xp, ldx, w, Kh, b0, b1, bp, op, N); });
    return out;
  }
  if (M <= TALL_MAX_M) {
    // Whole pairs of blocks per thread (an odd count leaves the last block to the last thread).
    at::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      packed_tall(M, xp, ldx, w, Kh, 2 * p0, std::min(NB, 2 * p1), bp, op, N);
    });
    return out;
  }
  constexpr int64_t G = 4;  // 4 column blocks x 4 rows = 16 accumulators
  const int64_t groups = NB / G;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) packed_all_m<G>(xp, ldx, M, w, Kh, g * G, bp, op, N);
  });
  for (int64_t nb = groups * G; nb < NB; ++nb) packed_all_m<1>(xp, ldx, M, w, Kh, nb, bp, op, N);
  return out;
}

// How M <= 4 GEMVs stream their column blocks (gemv.h Streams): 8 or 1; the choice never changes a result.
void set_gemv_streams(int64_t n) {
  TORCH_CHECK(n == static_cast<int>(gemv::Streams::MANY) || n == static_cast<int>(gemv::Streams::ONE),
              "gemv streams must be 8 or 1, not ", n);
  gemv::streams.store(static_cast<int>(n));
}

int64_t gemv_streams() { return gemv::streams.load(); }

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("set_gemv_streams(int n) -> ()", &set_gemv_streams);
  m.def("gemv_streams() -> int", &gemv_streams);
  m.def("linear_rows(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_packed_avx512(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_packed_avx512", &linear_packed_avx512);
}

}  // namespace deploykit
