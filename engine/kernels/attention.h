// One (sequence, KV head) task of paged decode attention, shared by decode_attention.cpp and the fused batch-1
// decode step (decode_step.cpp), so both produce bitwise the same outputs.
//
// The G = Hq / Hkv query heads sharing a KV head are computed together (GQA), so every K/V row is loaded once:
// scores [G, T] = q . k * scale (vec::dot2, fp32 accumulation), an exact softmax in fp32 (max-subtracted, two
// passes over the scores), then out [G, D] = sum_t p[g, t] * v_t in fp32, up to 8 heads' sums held in registers.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "paged_kv.h"
#include "vec.h"

namespace deploykit {
namespace attention {

using bf16 = at::BFloat16;
using namespace vec;

// Head sizes the attention kernels take: multiples of one 32-lane bf16 vector, up to MAX_HEAD_DIM.
constexpr int64_t HEAD_DIM_MULTIPLE = 32;
constexpr int64_t MAX_HEAD_DIM = 256;

// Cache geometry: kv [NB, bs, 2, Hkv, D] contiguous; token t of a sequence lives in block table[t / bs].
struct PagedKV {
  const bf16* data;
  int64_t block_size, kv_heads, head_dim;
  int64_t row() const { return 2 * kv_heads * head_dim; }  // elements between consecutive tokens of a block
};

// Per-thread buffers, grown on demand and reused across tasks.
struct Scratch {
  std::vector<float> scores, inv;
  std::vector<const bf16*> keys;
};

// Query heads whose output sums one register pass keeps (GT of 32 registers, with V and the broadcast p).
constexpr int64_t GT = 8;

// f(std::integral_constant<int, n>{}) for a runtime 1 <= n <= GT.
template <int N = 1, class F>
inline void with_heads(int64_t n, F&& f) {
  if constexpr (N < GT) {
    if (n != N) return with_heads<N + 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// q: the G query heads of KV head h (D apart); table: the sequence's block ids; end: context length including
// this token; window > 0: only the last `window` keys. out: G rows of D, D apart.
inline void attend(const bf16* q, const PagedKV& kv, const int32_t* table, int64_t end, int64_t window, int64_t h,
                   int64_t G, float scale, Scratch& s, bf16* out) {
  const int64_t D = kv.head_dim, bs = kv.block_size, row = kv.row(), chunks = D / 32;
  const int64_t t0 = window > 0 ? std::max<int64_t>(0, end - window) : 0, T = end - t0;  // visible keys
  // Each visible key's K row, found once (the loops below visit a key up to 1 + D / 16 times).
  s.keys.resize(T);
  paged::key_rows(kv.data, bs, row, h, D, table, t0, T, s.keys.data());
  const bf16* const* keys = s.keys.data();
  auto token = [&](int64_t i) { return keys[i]; };
  s.scores.resize(G * T);
  s.inv.resize(G);
  float* scores = s.scores.data();
  // scores[g, t], 16 keys at a time: per query head, the 16 keys' partial-sum vectors are summed across lanes by one
  // transposed reduction (vec::reduce16, ~3 ops a key) instead of one _mm512_reduce_add_ps each (~10); its
  // pairing is that reduction's tree, so every score is bitwise the same. The 16 K rows stay in L1 across heads.
  int64_t t = 0;  // the key loops' shared position
  for (; t + 16 <= T; t += 16) {
    const bf16* ks[16];
    for (int i = 0; i < 16; ++i) ks[i] = token(t + i);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          acc[i] = vec::dot2(acc[i], _mm512_loadu_si512(ks[i] + 32 * c), _mm512_loadu_si512(q + g * D + 32 * c));
      }
      _mm512_storeu_ps(scores + g * T + t, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
    }
  }
  // The last T % 16 keys one at a time: K row in registers, the G query rows from L1.
  for (; t < T; ++t) {
    const bf16* k = token(t);
    __m512i kc[MAX_HEAD_DIM / 32];
    for (int64_t c = 0; c < chunks; ++c) kc[c] = _mm512_loadu_si512(k + 32 * c);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) acc = vec::dot2(acc, kc[c], _mm512_loadu_si512(q + g * D + 32 * c));
      scores[g * T + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  // Softmax per query head: p = exp(s - max) in place, 1 / sum kept for the output.
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * T;
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
    s.inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // out[g] = sum_t p[g, t] * v_t / sum[g]: per 16 lanes of D, up to GT query heads' sums stay in registers over all
  // t (accumulating in memory stored and reloaded 7 x 4 vectors a token: ~2x this loop's time at G = 7, D = 64).
  // Same fmadd order over t as any other grouping, so the sums are bitwise the same.
  for (int64_t d = 0; d < D; d += 16)
    for (int64_t g = 0; g < G; g += GT) {
      const int64_t n = std::min<int64_t>(GT, G - g);
      with_heads(n, [&](auto gt) {
        constexpr int N = decltype(gt)::value;
        __m512 a[N];
        for (int j = 0; j < N; ++j) a[j] = _mm512_setzero_ps();
        const float* p = scores + g * T;
        for (int64_t t = 0; t < T; ++t) {
          const __m512 vv = load16(token(t) + kv.kv_heads * D + d);
          for (int j = 0; j < N; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * T + t]), vv, a[j]);
        }
        for (int j = 0; j < N; ++j) store16(out + (g + j) * D + d, _mm512_mul_ps(a[j], _mm512_set1_ps(s.inv[g + j])));
      });
    }
}

}  // namespace attention
}  // namespace deploykit
