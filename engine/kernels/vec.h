// Small AVX-512 helpers shared by every kernel: bf16 <-> fp32, the bf16 pair dot product, 16 sums at once, and exp.
//
// The sources compile twice (engine/kernels/build.py): with -mavx512bf16 (vdpbf16ps, vcvtneps2bf16) and for
// plain AVX-512F (Skylake-SP to Ice Lake, or a hypervisor that hides the BF16 CPUID bit), where a bf16 is
// widened by a 16-bit shift and multiplied in fp32. Decode is bound by reading weights, so the plain build
// still streams bf16 weights at DRAM speed; only compute-bound prefill feels the 2 extra ops per FMA pair.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

namespace deploykit {
namespace vec {

using bf16 = at::BFloat16;

// bf16 is the top half of an fp32: 16 bf16 bit patterns widened to 16 fp32, exactly.
inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 load16(const bf16* p) { return widen(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load16_masked(const bf16* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }

// 16 fp32 -> 16 bf16 as vcvtneps2bf16 does it: round to nearest even, NaN stays a quiet NaN, denormal inputs
// become a signed zero.
inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  const __mmask16 tiny = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7F800000));  // zero exponent
  r = _mm512_mask_mov_epi32(r, tiny, _mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

// acc[i] += a[2i+1] * b[2i+1] + a[2i] * b[2i]: a and b hold 32 bf16 each, i.e. 16 (even, odd) pairs; the odd
// product first, as vdpbf16ps adds them (which also treats denormal inputs as zero; here they count, at ~1e-38).
// The plain build CSEs the widening of an operand that is reused across calls (a broadcast x pair, a
// weight line used for several rows), so the inner loops pay it once per load.
inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
#ifdef __AVX512BF16__
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, odd)), _mm512_castsi512_ps(_mm512_and_si512(b, odd)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
#endif
}

inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, to_bf16(v)); }
inline void store16_masked(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16(v)); }
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// Permute indices for one halving step of a 16-way transposed reduction: with h lanes per row
// in a and b, out lane j sums lanes (base + j%h) and (base + h + j%h) of concat(a, b).
struct HalvingIdx {
  __m512i lo, hi;
  explicit HalvingIdx(int h) {
    alignas(64) int32_t l[16], u[16];
    for (int j = 0; j < 16; ++j) {
      const int base = (j / h) * 2 * h;
      l[j] = base + j % h;
      u[j] = base + h + j % h;
    }
    lo = _mm512_load_si512(l);
    hi = _mm512_load_si512(u);
  }
};

// acc[r] holds 16 partial values of row r; returns lane r = op over acc[r]'s lanes for r < 16 (op: the sum, or any
// other pairwise vector op, e.g. _mm512_max_ps). Lanes are paired (j, j + 8), then (j, j + 4), (j, j + 2), (j, j + 1):
// the tree of GCC's _mm512_reduce_add_ps, so each lane of the sum is bitwise that reduction.
template <class Op>
inline __m512 reduce16(__m512 acc[16], Op op) {
  static const HalvingIdx idx[4] = {HalvingIdx(8), HalvingIdx(4), HalvingIdx(2), HalvingIdx(1)};
  for (int level = 0, n = 16; n > 1; ++level, n /= 2)
    for (int i = 0; i < n / 2; ++i) {
      const __m512 a = acc[2 * i], b = acc[2 * i + 1];
      acc[i] = op(_mm512_permutex2var_ps(a, idx[level].lo, b), _mm512_permutex2var_ps(a, idx[level].hi, b));
    }
  return acc[0];
}
inline __m512 reduce16(__m512 acc[16]) {
  return reduce16(acc, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// 2^t = 2^n * 2^f with n = round(t), f in [-0.5, 0.5], for t in [-126, 126] (2^n a normal float); 2^f by the
// polynomial c[0] + c[1] f + ... + c[N - 1] f^(N - 1), in Horner's order. The compiler has no vector exp.
template <int N>
inline __m512 exp2_poly(__m512 t, const float (&c)[N]) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(c[N - 1]);
  for (int i = N - 2; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^f: the Cephes exp2f polynomial, relative error ~2e-7 (bf16 resolves 4e-3).
inline constexpr float EXP2_CEPHES[7] = {1.0f, 6.931472028550421e-1f, 2.402264791363012e-1f, 5.550332471162809e-2f,
                                         9.618437357674640e-3f, 1.339887440266574e-3f, 1.535336188319500e-4f};
inline __m512 exp2_normal(__m512 t) { return exp2_poly(t, EXP2_CEPHES); }

// exp(x) = 2^(x log2(e)), the exponent clamped to [-126, 126] so 2^n stays a normal float: exp(x) for x < -87 comes
// out ~1e-38 instead of 0 and for x > 87 ~1e38 instead of inf, far outside anything a bf16 result can tell apart.
inline __m512 exp(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  return exp2_normal(_mm512_max_ps(_mm512_min_ps(t, _mm512_set1_ps(126.0f)), _mm512_set1_ps(-126.0f)));
}

// 2^t for t at most ~0, as a softmax takes it (a score less its row's max, already in units of log2: the scale and
// log2(e) folded into one FMA by the caller), for a result rounded to bf16: a degree-3 polynomial for 2^f, f in
// [-0.5, 0.5], fitted for the least maximum relative error (7.5e-5, against bf16's 2^-9 half step; exp2_normal's
// degree 6 gives 2e-7), so a P rounds to the same bf16 as the exact value's except within 7.5e-5 of a rounding
// boundary. Three FMAs fewer than exp2_normal: the exponential is the prefill attention's largest cost. One clamp
// and no multiply against exp; below -126 it gives ~1e-38, never a denormal (slow).
inline constexpr float EXP2_BF16[4] = {9.9992807e-1f, 6.9326099e-1f, 2.4261112e-1f, 5.5171619e-2f};
inline __m512 exp2_below(__m512 t) { return exp2_poly(_mm512_max_ps(t, _mm512_set1_ps(-126.0f)), EXP2_BF16); }

// silu(x) * up = x / (1 + exp(-x)) * up, through a reciprocal estimate and one Newton step (2^-28 relative): a zmm
// divide would make silu_mul divider-bound. One home for it: rows::silu_mul and the AMX tiles' fused gate_up epilogue
// (amx_tiles.h) give the same bits from the same bf16 gate and up.
inline __m512 silu_mul(__m512 x, __m512 up) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp(_mm512_sub_ps(_mm512_setzero_ps(), x)));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(_mm512_mul_ps(x, r), up);
}

}  // namespace vec
}  // namespace deploykit
