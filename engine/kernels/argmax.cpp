// argmax_rows: the greedy token of each row of fp32 logits in one pass, with torch.argmax's answer (the first
// maximum; a NaN counts as the maximum, the first NaN wins).
//
// Why native: greedy decoding takes an argmax every step, and after a step has streamed the weights through the
// caches the ~12 small PyTorch ops of the two-level argmax (engine/sampling.py `_argmax`) cost ~150 us a token
// (measured on Zen 4, a 1,024-token vocabulary), 2-3 % of a 4-bit batch-1 step; this op, call included, takes 14 us
// there. The PyTorch argmax stays the reference the tests compare against.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "vec.h"

namespace deploykit {
namespace {

int64_t argmax_row(const float* x, int64_t V) {
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

}  // namespace

// x [R, V] fp32 with contiguous rows -> int64 [R].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows takes [R, V] fp32 logits with contiguous rows");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) <= std::numeric_limits<int32_t>::max(), "argmax_rows: bad vocabulary size");
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) o[r] = argmax_row(p + r * ld, V);
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("argmax_rows", &argmax_rows); }

}  // namespace deploykit
