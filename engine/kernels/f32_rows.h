// The fp32 row operations of a decoder layer, in AVX2 + FMA: RMSNorm, SiLU-and-mul, rotary, and one (sequence, KV
// head) decode attention task over an fp32 paged KV cache. The per-op fp32 ops (f32_ops.cpp) and the fused fp32 decode
// step (decode_step_f32.cpp) both call these, so the two paths compute the same bits. Every build includes it
// (AVX-512 implies AVX2 and FMA).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "paged_kv.h"

namespace deploykit {
namespace f32 {

constexpr int64_t MAX_HEAD_DIM = 256;

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// Lane i of the result = sum(a[i]) for 8 vectors (3 hadd levels and one cross-half add instead of 8 hsums).
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);  // [0 1 2 3 | 0 1 2 3], [4..7 | 4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// Lanes [0, n) set, for the tail of a row (maskload/maskstore read and write nothing outside it).
inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(n, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp(x) = 2^n * 2^f, n = round(x log2 e), f in [-0.5, 0.5]: the Cephes exp2f polynomial (relative error ~2e-7),
// t clamped to [-126, 126] so 2^n stays a normal float (exp(-100) comes out ~1e-38, not 0).
inline __m256 exp8(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  t = _mm256_max_ps(_mm256_min_ps(t, _mm256_set1_ps(126.0f)), _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// row[0:H] -> out = row * rsqrt(mean(row^2) + eps) * w (out may be row).
inline void rms_norm(const float* row, const float* w, int64_t H, float eps, float* out) {
  __m256 ss = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= H; k += 8) ss = _mm256_fmadd_ps(_mm256_loadu_ps(row + k), _mm256_loadu_ps(row + k), ss);
  float sum = hsum(ss);
  for (int64_t j = k; j < H; ++j) sum += row[j] * row[j];
  const float r = 1.0f / std::sqrt(sum / (float)H + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (k = 0; k + 8 <= H; k += 8)
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + k), rv), _mm256_loadu_ps(w + k)));
  for (; k < H; ++k) out[k] = row[k] * r * w[k];
}

// h[0:n] += d (vectorized by -O3; exact either way).
inline void add_(float* h, const float* d, int64_t n) {
  for (int64_t k = 0; k < n; ++k) h[k] += d[k];
}

inline __m256 silu8(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// o[0:n] = silu(g) * u, silu(x) = x / (1 + exp(-x)); lane by lane, so any split of a row gives the same bits.
inline void silu_mul(const float* g, const float* u, int64_t n, float* o) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    _mm256_storeu_ps(o + k, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + k)), _mm256_loadu_ps(u + k)));
  if (k < n) {  // masked moves only for the tail: AMD cores run vmaskmovps stores as slow microcode
    const __m256i mk = tail_mask(n - k);
    _mm256_maskstore_ps(o + k, mk, _mm256_mul_ps(silu8(_mm256_maskload_ps(g + k, mk)), _mm256_maskload_ps(u + k, mk)));
  }
}

// One head row r[0:D] in place, HF rotate-half layout: r = r * c + roll(r, D/2) * s, c and s the position's cos and
// signed sin rows [D]. out[:half] = a c[:half] + b s[:half] (s[:half] = -sin); out[half:] = b c[half:] + a s[half:].
inline void rotary(float* r, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  int64_t k = 0;
  for (; k + 8 <= half; k += 8) {
    const __m256 a = _mm256_loadu_ps(r + k), b = _mm256_loadu_ps(r + half + k);
    _mm256_storeu_ps(r + k, _mm256_fmadd_ps(b, _mm256_loadu_ps(s + k), _mm256_mul_ps(a, _mm256_loadu_ps(c + k))));
    const __m256 bc = _mm256_mul_ps(b, _mm256_loadu_ps(c + half + k));
    _mm256_storeu_ps(r + half + k, _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + k), bc));
  }
  for (; k < half; ++k) {  // the same arithmetic, one lane at a time (std::fma rounds once, as vfmadd does)
    const float a = r[k], b = r[half + k];
    r[k] = std::fma(b, s[k], a * c[k]);
    r[half + k] = std::fma(a, s[half + k], b * c[half + k]);
  }
}

// The decode attention task's loops (below), measured on a 2-vCPU Zen 3 against the loops as they were (one register
// pass per 8 lanes of D, no software prefetch), bitwise the same, a standalone copy over a 24-layer cache from DRAM:
// 16 sequences x 1,050 keys 0.73-0.76x the time, 16 x 170 keys 0.81-0.85x, 1 x 1,050 keys 0.71x.
constexpr int64_t KEYS_AHEAD = 16;    // keys whose K lines the score loop requests ahead (spread over its G heads)
constexpr int64_t VALUES_AHEAD = 16;  // keys whose V line the output loop requests ahead
constexpr int64_t GT = 8;             // query heads a register pass over one 8-lane slice of D keeps (8 + V + p)
constexpr int64_t GT2 = 7;            // ... over a 16-lane slice (2 x 7 sums + p; V read from L1 by each FMA)

template <int64_t MAX, int N = 1, class F>
inline void with_heads(int64_t n, F&& f) {
  if constexpr (N < MAX) {
    if (n != N) return with_heads<MAX, N + 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// r[j] lane l -> r[l] lane j: an 8 x 8 transpose in registers.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

inline void request(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

struct Scratch {
  std::vector<float> scores, probs, inv;
  std::vector<const float*> keys;
};

// One (sequence, KV head) task: the G query heads sharing KV head h (q: G rows, D apart) against the sequence's
// visible keys. scores [G, T] = q . k * scale, an exact softmax (max-subtracted), out [G, D] = sum_t p v_t / sum.
// A key's row holds its K and V for every KV head (1 KB at 2 heads x 64 fp32): a task reads a quarter of each row,
// rows 1 KB apart and blocks wherever the table puts them, which the hardware prefetchers do not follow; the loops
// request the lines they read next themselves.
inline void attend(const float* q, const float* kv, int64_t bs, int64_t Hkv, int64_t D, const int32_t* table,
                   int64_t end, int64_t window, int64_t h, int64_t G, float scale, Scratch& s, float* out) {
  const int64_t row = 2 * Hkv * D, chunks = D / 8;
  const int64_t t0 = window > 0 ? std::max<int64_t>(0, end - window) : 0, T = end - t0;  // visible keys
  const int64_t Tp = (T + 7) / 8 * 8;  // a head's score row, padded to whole vectors
  const int64_t GP = G == 1 ? 1 : (G + 7) / 8 * 8;  // a row of probs: G rounded up to whole vectors
  s.keys.resize(T);
  paged::key_rows(kv, bs, row, h, D, table, t0, T, s.keys.data());
  const float* const* keys = s.keys.data();
  s.scores.resize(G * Tp);
  s.probs.resize(G == 1 ? 0 : Tp * GP);
  s.inv.resize(G);
  float* scores = s.scores.data();
  float* probs = G == 1 ? scores : s.probs.data();  // one head: its p row is already [T, 1]
  // scores [G, Tp], 8 keys at a time: the 8 K rows stay in L1 across the G heads, the 8 dot products are 8
  // independent FMA chains (one chain per key waits on FMA latency: with that, and scratch allocated per call, this
  // op took 67 us instead of 27 at 170 keys on one Zen 3 core), and one transposed reduction (hsum8) sums them. The
  // K lines of the 8 keys KEYS_AHEAD on are requested a few per head: all at once, they filled the core's miss
  // buffers and the loads behind them waited (this loop at 1,050 keys, us a task: none 46-52, at once 49-53, spread
  // 38-41).
  const int64_t lines = (D + 15) / 16, ahead = 8 * lines;  // K lines a key, lines of 8 keys
  int64_t t = 0;
  for (; t + 8 <= T; t += 8)
    for (int64_t g = 0; g < G; ++g) {
      if (t + KEYS_AHEAD + 8 <= T)
        for (int64_t e = g * ahead / G; e < (g + 1) * ahead / G; ++e)
          request(keys[t + KEYS_AHEAD + e / lines] + 16 * (e % lines));
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + 8 * c);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(keys[t + i] + 8 * c), qv, acc[i]);
      }
      _mm256_storeu_ps(scores + g * Tp + t, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
    }
  for (; t < Tp; ++t)  // the last T % 8 keys one at a time; the padding scores -inf
    for (int64_t g = 0; g < G; ++g) {
      if (t >= T) {
        scores[g * Tp + t] = -INFINITY;
        continue;
      }
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(keys[t] + 8 * c), _mm256_loadu_ps(q + g * D + 8 * c), acc);
      scores[g * Tp + t] = hsum(acc) * scale;
    }
  // Softmax per head: p = exp(s - max) in place of its scores, 1 / sum kept. Then, past one head, probs [Tp, GP] = p
  // transposed, 8 keys x 8 heads at a time (heads past G give 0), for the output loop (one store a lane had cost ~6 %
  // of a task).
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * Tp;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < Tp; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + i));
    const __m256 m = _mm256_set1_ps(hmax(mv));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < Tp; i += 8) {
      // exp(-inf) of a padding lane comes out ~1e-38 (exp8 clamps): masked to 0.
      const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m)),
                                     _mm256_castsi256_ps(tail_mask(T - i)));
      sum = _mm256_add_ps(sum, p);
      _mm256_storeu_ps(sg + i, p);
    }
    s.inv[g] = 1.0f / hsum(sum);
  }
  for (int64_t g0 = 0; g0 < G && G > 1; g0 += 8)
    for (int64_t i = 0; i < Tp; i += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = g0 + j < G ? _mm256_loadu_ps(scores + (g0 + j) * Tp + i) : _mm256_setzero_ps();
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(probs + (i + j) * GP + g0, r[j]);
    }
  // out[g] = sum_t p[t, g] v_t / sum[g]: per 16 lanes of D (one V line), up to GT2 heads' sums stay in registers over
  // all t, their p one row of probs (one pointer: a row per head would spill the pointers). A pass reads each V line
  // once (per 8 lanes, two passes read each line), and requests the line VALUES_AHEAD keys on.
  int64_t d = 0;
  const int64_t passes = (G + GT2 - 1) / GT2, per = (G + passes - 1) / passes;  // heads a pass, as even as they go
  for (; d + 16 <= D; d += 16)
    for (int64_t g = 0; g < G; g += per)
      with_heads<GT2>(std::min<int64_t>(per, G - g), [&](auto gt) {
        constexpr int N = decltype(gt)::value;
        __m256 a[N][2];
        for (int j = 0; j < N; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
        const float* p = probs + g;
        const int64_t vd = Hkv * D + d;  // this slice of the V row, from a key's K row
        for (int64_t i = 0; i < T; ++i, p += GP) {
          if (i + VALUES_AHEAD < T) request(keys[i + VALUES_AHEAD] + vd);
          const float* v = keys[i] + vd;
          for (int j = 0; j < N; ++j) {
            const __m256 pj = _mm256_broadcast_ss(p + j);
            a[j][0] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v), a[j][0]);
            a[j][1] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8), a[j][1]);
          }
        }
        for (int j = 0; j < N; ++j)
          for (int e = 0; e < 2; ++e)
            _mm256_storeu_ps(out + (g + j) * D + d + 8 * e, _mm256_mul_ps(a[j][e], _mm256_set1_ps(s.inv[g + j])));
      });
  for (; d < D; d += 8)  // D % 16 == 8: the last 8 lanes
    for (int64_t g = 0; g < G; g += GT)
      with_heads<GT>(std::min<int64_t>(GT, G - g), [&](auto gt) {
        constexpr int N = decltype(gt)::value;
        __m256 a[N];
        for (int j = 0; j < N; ++j) a[j] = _mm256_setzero_ps();
        const float* p = probs + g;
        for (int64_t i = 0; i < T; ++i, p += GP) {
          const __m256 v = _mm256_loadu_ps(keys[i] + Hkv * D + d);
          for (int j = 0; j < N; ++j) a[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), v, a[j]);
        }
        for (int j = 0; j < N; ++j)
          _mm256_storeu_ps(out + (g + j) * D + d, _mm256_mul_ps(a[j], _mm256_set1_ps(s.inv[g + j])));
      });
}

}  // namespace f32
}  // namespace deploykit
