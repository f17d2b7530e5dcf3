// The greedy token of a row of fp32 logits, with torch.argmax's answer (the first maximum; a NaN counts as the
// maximum, the first NaN wins): argmax.cpp's op, and the fused decode steps over the columns each thread computed
// (AVX-512 in the bf16 step's builds, AVX2 in the fp32 step's AVX2 build).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

#ifdef __AVX512F__
#include "vec.h"
#endif

namespace deploykit {
namespace argmax {

#ifdef __AVX512F__
inline int64_t argmax_row(const float* x, int64_t V) {
  // Per lane: the best value so far and its index; a strictly greater value replaces it, so each lane keeps the
  // first of equal maxima. NaNs are only flagged here and found by a scalar scan (they never occur in practice).
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_set1_epi32(0), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const __m512 v = _mm512_mask_loadu_ps(best, vec::tail_mask(V - i), x + i);  // the tail repeats `best`: never strictly greater
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) {
    for (int64_t i = 0; i < V; ++i)
      if (x[i] != x[i]) return i;
  }
  // Across lanes: the largest value, then the smallest index holding it. A row of all -inf keeps index 0 in
  // every lane, which is torch's answer too.
  const float m = _mm512_reduce_max_ps(best);
  const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(top, at);
}
#else
inline int64_t argmax_row(const float* x, int64_t V) {
  // As above, 8 lanes a step; a tail of V % 8 values scanned one by one against lane 0's rule (strictly greater).
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  __m256 nan = _mm256_setzero_ps();
  const int64_t body = V / 8 * 8;
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
    idx = _mm256_add_epi32(idx, step);
  }
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t i = body; i < V; ++i) any_nan = any_nan || x[i] != x[i];
  if (any_nan) {
    for (int64_t i = 0; i < V; ++i)
      if (x[i] != x[i]) return i;
  }
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi), at);
  float m = bv[0];
  int64_t j = bi[0];
  for (int l = 1; l < 8; ++l)
    if (bv[l] > m || (bv[l] == m && bi[l] < j)) m = bv[l], j = bi[l];
  for (int64_t i = body; i < V; ++i)
    if (x[i] > m) m = x[i], j = i;
  return j;
}
#endif

// The best (value, index) of a row's pieces, merged in any order into torch.argmax's answer over the whole row.
struct Best {
  float v = -std::numeric_limits<float>::infinity();
  int64_t i = std::numeric_limits<int64_t>::max();
  void merge(float x, int64_t at) {
    const bool nan = x != x, had = v != v;
    if (had ? nan && at < i : nan || x > v || (x == v && at < i)) v = x, i = at;
  }
};

// The fused steps' greedy tokens: each of B rows' picks of nt threads (picks[t * B + b]) merged into tok[b]; true if
// some row's token is one of stops[0, num_stops). Every thread merges alike, so all of them agree on both.
inline bool merge_picks(const Best* picks, int nt, int64_t B, int64_t* tok, const int64_t* stops, int64_t num_stops) {
  bool stop = false;
  for (int64_t b = 0; b < B; ++b) {
    Best best;
    for (int t = 0; t < nt; ++t) best.merge(picks[t * B + b].v, picks[t * B + b].i);
    tok[b] = best.i;
    for (int64_t k = 0; k < num_stops; ++k) stop = stop || stops[k] == best.i;
  }
  return stop;
}

}  // namespace argmax
}  // namespace deploykit
