// fp32 ops of the per-op decoder path: RMSNorm with the residual add, SiLU-and-mul, rotary, the per-head norm, and
// decode attention read in place from an fp32 paged KV cache.
//
// fp32 runs where a CPU lacks AVX-512 (the AVX2 build: quantized weights on its int8 GEMV, float matmuls on
// PyTorch), and wherever a user asks for it. At decode sizes each of these replaced a chain of 3-8 eager PyTorch
// kernels costing dispatch and an OpenMP region apiece; on a 2-core Zen 3 at a Q4_0 model's batch-1 step they took
// ~4-5 ms of ~20 beside the GEMVs, attention the largest part (SDPA after gathering the context with index_select).
// Written with AVX2 and FMA only, so every build (build.py) holds the same code and computes the same bits; the
// PyTorch compositions in engine/kernels/__init__.py are the reference the tests compare against.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "paged_kv.h"

namespace deploykit {
namespace {

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
void rms_norm(const float* row, const float* w, int64_t H, float eps, float* out) {
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

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              " must be a [M, H] fp32 tensor with contiguous rows");
}

void check_heads(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "x must be a [M, heads, D] fp32 tensor with contiguous head rows");
}

// Rows per parallel task: enough work that a task outweighs an OpenMP hand-off (~1 us).
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace

// h [M, H] (updated in place to h + delta when delta is given), w [H] -> rms_norm(h) * w [M, H].
at::Tensor add_rms_norm_f32(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& w,
                            double eps) {
  check_rows(h, "h");
  const int64_t M = h.size(0), H = h.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w must be a contiguous fp32 [H] tensor");
  const bool add = delta.has_value() && delta->defined();
  if (add) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->size(0) == M && delta->size(1) == H, "delta must have h's shape");
  }
  at::Tensor out = at::empty({M, H}, h.options());
  float* hp = h.data_ptr<float>();
  const float* dp = add ? delta->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldh = h.stride(0), ldd = add ? delta->stride(0) : 0;
  at::parallel_for(0, M, grain(H), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* row = hp + m * ldh;
      if (add)
        for (int64_t k = 0; k < H; ++k) row[k] += dp[m * ldd + k];  // vectorized by -O3; exact either way
      rms_norm(row, wp, H, (float)eps, op + m * H);
    }
  });
  return out;
}

// gate_up [M, 2I] (gate then up) -> silu(gate) * up [M, I], silu(x) = x / (1 + exp(-x)).
at::Tensor silu_mul_f32(const at::Tensor& gu) {
  check_rows(gu, "gate_up");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({M, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld = gu.stride(0);
  at::parallel_for(0, M, grain(I), [&](int64_t m0, int64_t m1) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t m = m0; m < m1; ++m) {
      const float *g = gp + m * ld, *u = g + I;
      float* o = op + m * I;
      auto silu = [&](__m256 x) {
        return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
      };
      int64_t k = 0;
      for (; k + 8 <= I; k += 8)
        _mm256_storeu_ps(o + k, _mm256_mul_ps(silu(_mm256_loadu_ps(g + k)), _mm256_loadu_ps(u + k)));
      if (k < I) {  // masked moves only for the tail: AMD cores run vmaskmovps stores as slow microcode
        const __m256i mk = tail_mask(I - k);
        const __m256 y = _mm256_mul_ps(silu(_mm256_maskload_ps(g + k, mk)), _mm256_maskload_ps(u + k, mk));
        _mm256_maskstore_ps(o + k, mk, y);
      }
    }
  });
  return out;
}

// In place on x [M, heads, D] (rows and heads may be strided views, D contiguous), HF rotate-half layout:
// x = x * cos + roll(x, D/2) * sin_signed, with cos, sin_signed [M, D] (rows of the tables).
void rotary_f32_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(x);
  const int64_t M = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == M && t->size(1) == D && t->scalar_type() == at::kFloat &&
                    t->stride(1) == 1,
                "cos/sin must be [M, D] fp32 with contiguous rows");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), lc = cos.stride(0), ls = sin.stride(0);
  at::parallel_for(0, M * NH, grain(D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / NH;
      float* r = xp + m * s0 + (i % NH) * s1;
      const float *c = cp + m * lc, *s = sp + m * ls;
      // out[:half] = a cos[:half] + b sin[:half] (sin[:half] = -sin); out[half:] = b cos[half:] + a sin[half:]
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
  });
}

// In place on x [M, heads, D]: each head row becomes rms_norm(row) * w[head], w [heads, D] (Qwen3's q/k norm).
void head_rms_norm_f32_(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_heads(x);
  const int64_t M = x.size(0), NH = x.size(1), D = x.size(2);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == NH && w.size(1) == D && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w must be a contiguous fp32 [heads, D] tensor");
  float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, M * NH, grain(D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* r = xp + (i / NH) * s0 + (i % NH) * s1;
      rms_norm(r, wp + (i % NH) * D, D, (float)eps, r);
    }
  });
}

namespace {

// Query heads whose output sums one register pass keeps (8 of 16 ymm registers, with V and the broadcast p).
constexpr int64_t GT = 8;

template <int N = 1, class F>
inline void with_heads(int64_t n, F&& f) {
  if constexpr (N < GT) {
    if (n != N) return with_heads<N + 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

struct Scratch {
  std::vector<float> scores, probs, inv;
  std::vector<const float*> keys;
};

// One (sequence, KV head) task: the G query heads sharing KV head h (q: G rows, D apart) against the sequence's
// visible keys. scores [G, T] = q . k * scale, an exact softmax (max-subtracted), out [G, D] = sum_t p v_t / sum.
void attend(const float* q, const float* kv, int64_t bs, int64_t Hkv, int64_t D, const int32_t* table, int64_t end,
            int64_t window, int64_t h, int64_t G, float scale, Scratch& s, float* out) {
  const int64_t row = 2 * Hkv * D, chunks = D / 8;
  const int64_t t0 = window > 0 ? std::max<int64_t>(0, end - window) : 0, T = end - t0;  // visible keys
  const int64_t Tp = (T + 7) / 8 * 8;  // a head's score row, padded to whole vectors
  s.keys.resize(T);
  paged::key_rows(kv, bs, row, h, D, table, t0, T, s.keys.data());
  const float* const* keys = s.keys.data();
  s.scores.resize(G * Tp);
  s.probs.resize(T * G);
  s.inv.resize(G);
  float* scores = s.scores.data();
  float* probs = s.probs.data();
  // scores [G, Tp], 8 keys at a time: the 8 K rows stay in L1 across the G heads, the 8 dot products are 8
  // independent FMA chains (one chain per key waits on FMA latency: with that, and scratch allocated per call, this
  // op took 67 us instead of 27 at 170 keys on one Zen 3 core), and one transposed reduction (hsum8) sums them.
  int64_t t = 0;
  for (; t + 8 <= T; t += 8)
    for (int64_t g = 0; g < G; ++g) {
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
  // Softmax per head: p = exp(s - max), written transposed to probs [T, G] for the output loop; 1 / sum kept.
  for (int64_t g = 0; g < G; ++g) {
    const float* sg = scores + g * Tp;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < Tp; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + i));
    const __m256 m = _mm256_set1_ps(hmax(mv));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < Tp; i += 8) {
      // exp(-inf) of a padding lane comes out ~1e-38 (exp8 clamps): masked to 0.
      const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m)),
                                     _mm256_castsi256_ps(tail_mask(T - i)));
      sum = _mm256_add_ps(sum, p);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, p);
      for (int64_t l = 0; l < std::min<int64_t>(8, T - i); ++l) probs[(i + l) * G + g] = lanes[l];
    }
    s.inv[g] = 1.0f / hsum(sum);
  }
  // out[g] = sum_t p[t, g] v_t / sum[g]: per 8 lanes of D, up to GT heads' sums stay in registers over all t, their
  // p one row of probs (one pointer: a row per head would spill the pointers).
  for (int64_t d = 0; d < D; d += 8)
    for (int64_t g = 0; g < G; g += GT)
      with_heads(std::min<int64_t>(GT, G - g), [&](auto gt) {
        constexpr int N = decltype(gt)::value;
        __m256 a[N];
        for (int j = 0; j < N; ++j) a[j] = _mm256_setzero_ps();
        const float* p = probs + g;
        for (int64_t i = 0; i < T; ++i, p += G) {
          const __m256 v = _mm256_loadu_ps(keys[i] + Hkv * D + d);
          for (int j = 0; j < N; ++j) a[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), v, a[j]);
        }
        for (int j = 0; j < N; ++j)
          _mm256_storeu_ps(out + (g + j) * D + d, _mm256_mul_ps(a[j], _mm256_set1_ps(s.inv[g + j])));
      });
}

}  // namespace

// q [B, Hq, D] (rows may be strided, heads D apart), kv [NB, bs, 2, Hkv, D] contiguous fp32, tables int32 [B, W]
// (block ids, padded with anything), lens int32 [B] (context length including this token, <= W * bs) -> [B, Hq, D].
// window > 0: only the last `window` keys (key j visible to query i when i - window < j <= i).
at::Tensor decode_attention_f32(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                                const at::Tensor& lens, double scale, int64_t window) {
  const paged::Call c = paged::check(q, kv, tables, lens, at::kFloat, "fp32", 8, MAX_HEAD_DIM);
  const int64_t B = c.B, Hq = c.Hq, D = c.D, bs = c.bs, Hkv = c.Hkv, W = c.W, G = c.G;
  const int32_t *tp = c.tables, *lp = c.lens;
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    static thread_local Scratch scratch;  // grown once per thread, not zero-filled anew on every call
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      attend(qp + b * qs0 + h * G * D, kp, bs, Hkv, D, tp + b * W, lp[b], window, h, G, (float)scale, scratch,
             op + (b * Hq + h * G) * D);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("add_rms_norm_f32(Tensor(a!) h, Tensor? delta, Tensor w, float eps) -> Tensor");
  m.def("silu_mul_f32(Tensor gate_up) -> Tensor");
  m.def("rotary_f32_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("head_rms_norm_f32_(Tensor(a!) x, Tensor w, float eps) -> ()");
  m.def("decode_attention_f32(Tensor q, Tensor kv, Tensor tables, Tensor lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("add_rms_norm_f32", &add_rms_norm_f32);
  m.impl("silu_mul_f32", &silu_mul_f32);
  m.impl("rotary_f32_", &rotary_f32_);
  m.impl("head_rms_norm_f32_", &head_rms_norm_f32_);
  m.impl("decode_attention_f32", &decode_attention_f32);
}

}  // namespace deploykit
