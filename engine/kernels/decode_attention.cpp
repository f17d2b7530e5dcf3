// Decode attention straight from the paged KV cache: one query token per sequence, any context length.
//
// The PyTorch path gathers every sequence's blocks into a padded copy (index_select) and runs SDPA with
// an additive mask: ~100-250 us per layer at decode sizes, mostly dispatch and copying. Here each
// (sequence, KV head) task reads its blocks in place and computes the G = Hq / Hkv query heads that
// share that KV head together (GQA), so every K/V row is loaded once.
//
// Per task: scores [G, T] = q . k * scale (vec::dot2, fp32 accumulation), an exact softmax in fp32
// (max-subtracted, two passes over the scores), then out [G, D] = sum_t p[g, t] * v_t in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace deploykit {
namespace {

using bf16 = at::BFloat16;
using namespace vec;

constexpr int64_t MAX_HEAD_DIM = 256;


}  // namespace

// q [B, Hq, D] (rows may be strided, heads D apart), kv [NB, bs, 2, Hkv, D] contiguous, tables int32
// [B, W] (block ids, padded with anything), lens int32 [B] (context length including this token, <= W * bs)
// -> [B, Hq, D] bf16. window > 0: attend only to the last `window` tokens (sliding-window attention, as
// Mistral's: key j is visible to query i when i - window < j <= i).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                            const at::Tensor& lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be a bf16 [B, Hq, D] tensor with contiguous heads");
  TORCH_CHECK(kv.dim() == 5 && kv.size(2) == 2 && kv.scalar_type() == at::kBFloat16 && kv.is_contiguous(),
              "kv must be a contiguous bf16 [blocks, block_size, 2, Hkv, D] tensor");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv.size(0), bs = kv.size(1), Hkv = kv.size(3);
  TORCH_CHECK(kv.size(4) == D, "q and kv head_dim differ");
  TORCH_CHECK(D % 32 == 0 && D <= MAX_HEAD_DIM, "head_dim must be a multiple of 32 up to ", MAX_HEAD_DIM);
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kInt && tables.is_contiguous(),
              "tables must be a contiguous int32 [B, W] tensor");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == at::kInt && lens.is_contiguous(),
              "lens must be a contiguous int32 [B] tensor");
  const int64_t W = tables.size(1), G = Hq / Hkv;
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  // Validate every index before the parallel region (errors cannot leave it): a bad table would read
  // outside the cache.
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * bs, "context length ", lp[b], " of row ", b, " is outside [1, ", W * bs,
                "]");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * W + j] >= 0 && tp[b * W + j] < NB, "block id ", tp[b * W + j], " out of range");
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kvp = kv.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t qs0 = q.stride(0), row = 2 * Hkv * D;  // elements between consecutive tokens of a block
  const int64_t chunks = D / 32;
  const float fscale = (float)scale;

  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    std::vector<float> acc(G * D), inv(G);
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, end = lp[b];
      const int64_t t0 = window > 0 ? std::max<int64_t>(0, end - window) : 0, T = end - t0;  // visible keys
      const bf16* qh = qp + b * qs0 + h * G * D;  // G query heads, D apart
      const int32_t* tbl = tp + b * W;
      auto token = [&](int64_t i) {
        const int64_t t = t0 + i;
        return kvp + ((int64_t)tbl[t / bs] * bs + t % bs) * row + h * D;
      };
      scores.resize(G * T);
      // scores[g, t]: K row in registers, the G query rows from L1.
      for (int64_t t = 0; t < T; ++t) {
        const bf16* k = token(t);
        __m512i kc[MAX_HEAD_DIM / 32];
        for (int64_t c = 0; c < chunks; ++c) kc[c] = _mm512_loadu_si512(k + 32 * c);
        for (int64_t g = 0; g < G; ++g) {
          __m512 s = _mm512_setzero_ps();
          for (int64_t c = 0; c < chunks; ++c)
            s = vec::dot2(s, kc[c], _mm512_loadu_si512(qh + g * D + 32 * c));
          scores[g * T + t] = _mm512_reduce_add_ps(s) * fscale;
        }
      }
      // Softmax per query head: p = exp(s - max) in place, 1 / sum kept for the output.
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * T;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < T; t += 16) {
          const __mmask16 mk = tail_mask(T - t);
          mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, sg + t));
        }
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < T; t += 16) {
          const __mmask16 mk = tail_mask(T - t);
          const __m512 p = vec::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + t), m));
          _mm512_mask_storeu_ps(sg + t, mk, p);
          sum = _mm512_mask_add_ps(sum, mk, sum, p);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
      }
      // out[g] = sum_t p[g, t] * v_t / sum[g]
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < T; ++t) {
        const bf16* v = token(t) + Hkv * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 vv = load16(v + d);
          for (int64_t g = 0; g < G; ++g) {
            float* a = acc.data() + g * D + d;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * T + t]), vv, _mm512_loadu_ps(a)));
          }
        }
      }
      bf16* o = op + (b * Hq + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const __m512 iv = _mm512_set1_ps(inv[g]);
        for (int64_t d = 0; d < D; d += 16)
          store16(o + g * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + g * D + d), iv));
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("decode_attention(Tensor q, Tensor kv, Tensor tables, Tensor lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}

}  // namespace deploykit
