// Activations quantized on the fly for the int8 dot products of quantized weights (quant_gemv.h).
//
// Per block of 32, as llama.cpp's Q8_0 / Q8_1 activations (ggml-cpu's x86 quantize_row_q8_0/q8_1): d = max|x| / 127,
// q = round(x * (127 / max|x|)) (nearest even) in [-127, 127]; the block's scale is kept as llama.cpp stores it,
// rounded to fp16 (dh), and Q8_1's s = fp16(d * sum q), which carries the Q4_1/Q5_1 offsets, is kept as well (ms).
// Products with Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 weights use dh and ms, so they round where llama.cpp rounds: measured on
// SmolLM2-135M Q4_1 (tests/engine/test_smollm2.py), this is what brings our argmax to llama.cpp's on the same file.
// The K formats use the fp32 d (llama.cpp pairs them with Q8_K, whose scale is fp32 per 256; ours is finer).
// Also the sums of q per 16 and per 32, which turn the unsigned weight codes back into signed values
// (sum (c - 128) q = sum c q - 128 sum q) and carry the Q4_K offsets. A row of K values takes 2 K bytes.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include "vec.h"
#endif

namespace deploykit {
namespace quant {

struct Act {  // one row
  int8_t* q;     // [K], 64-byte aligned
  float* d;      // [K / 32] scales, fp32
  float* dh;     // [K / 32] the scales rounded to fp16 (Q8_0/Q8_1's d)
  float* ms;     // [K / 32] fp16(d * sum q) (Q8_1's s)
  int32_t* s16;  // [K / 16] sums of q
  int32_t* s32;  // [K / 32]
  int32_t* z128;  // [K / 32] -128 s32: where the chain of Q8_0's codes c q starts, so it ends at sum (c - 128) q
                  // (Q4_0's high-nibble chain, 16 c q, starts there too: shifted back, sum (c - 8) q with the low one)
  int32_t* z16;   // [K / 32] -16 s32: where Q5_0's low chain starts, so with the high one it ends at sum (c - 16) q
};

#ifdef __AVX512F__
inline __m512 load_f32(const at::BFloat16* p) { return vec::load16(p); }
inline __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }

// x rounded to the nearest fp16 (even on ties), back in fp32; beyond fp16's range (an s of a block of activations
// over ~2048) x stays as it is, where llama.cpp would store inf. (AVX-512F's conversion: the scalar F16C one is not
// enabled by the build's -mavx512f.)
inline float fp16(float x) {
  if (!(std::fabs(x) < 65504.0f)) return x;
  const __m256i h = _mm512_cvtps_ph(_mm512_set1_ps(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_cvtss_f32(_mm512_cvtph_ps(h));
}

// x [K] (K a multiple of 32) -> a. (GCC 12 warns inside its own _mm512_reduce_* about _mm256_undefined_si256.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <class T>
inline void quantize(const T* x, int64_t K, const Act& a) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 lo = load_f32(x + 32 * b), hi = load_f32(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;  // llama.cpp's d and id, to the bit
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q + 32 * b), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q + 32 * b + 16), _mm512_cvtsepi32_epi8(qhi));
    a.d[b] = d;
    a.s16[2 * b] = _mm512_reduce_add_epi32(qlo);
    a.s16[2 * b + 1] = _mm512_reduce_add_epi32(qhi);
    a.s32[b] = a.s16[2 * b] + a.s16[2 * b + 1];
    a.z128[b] = -128 * a.s32[b];
    a.z16[b] = -16 * a.s32[b];
    a.dh[b] = fp16(d);
    a.ms[b] = fp16(d * (float)a.s32[b]);
  }
}
#pragma GCC diagnostic pop
#else
// The AVX2 build (quant_gemv_avx2.h: CPUs without AVX-512) quantizes the same way, 8 lanes at a time, to the same
// bytes and sums: max, the products and the conversions round per element, and the sums are exact integers.
inline __m256 load_f32(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }

// F16C's conversion, with the same rounding and the same pass-through beyond fp16's range as the AVX-512 fp16().
inline float fp16(float x) {
  if (!(std::fabs(x) < 65504.0f)) return x;
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// x [K] (K a multiple of 32) -> a.
template <class T>
inline void quantize(const T* x, int64_t K, const Act& a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the two in-lane packs below
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load_f32(x + 32 * b + 8 * i);
    const __m256 m01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
    const __m256 m23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
    const float amax = max8(_mm256_max_ps(m01, m23));
    const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;  // llama.cpp's d and id, to the bit
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    // [-127, 127] already, so the saturating packs are exact; they interleave 4-value pieces across the lanes.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q + 32 * b), _mm256_permutevar8x32_epi32(bytes, order));
    a.d[b] = d;
    a.s16[2 * b] = sum8(_mm256_add_epi32(q[0], q[1]));
    a.s16[2 * b + 1] = sum8(_mm256_add_epi32(q[2], q[3]));
    a.s32[b] = a.s16[2 * b] + a.s16[2 * b + 1];
    a.z128[b] = -128 * a.s32[b];
    a.z16[b] = -16 * a.s32[b];
    a.dh[b] = fp16(d);
    a.ms[b] = fp16(d * (float)a.s32[b]);
  }
}
#endif

// Room for `rows` quantized rows of up to K values each (one per x row a kernel call takes).
class ActBuffer {
 public:
  ActBuffer() = default;
  ActBuffer(int64_t rows, int64_t K) { reserve(rows, K); }

  void reserve(int64_t rows, int64_t K) {
    K_ = (K + 63) / 64 * 64;
    rows_ = rows;
    bytes_.resize(rows * row_bytes() + 64);
  }

  Act row(int64_t m) {
    uint8_t* base = aligned() + m * row_bytes();
    const int64_t f = K_ / 8;  // bytes of one float or int32 per 32 values
    return Act{reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + K_),
               reinterpret_cast<float*>(base + K_ + f), reinterpret_cast<float*>(base + K_ + 2 * f),
               reinterpret_cast<int32_t*>(base + K_ + 3 * f), reinterpret_cast<int32_t*>(base + K_ + 5 * f),
               reinterpret_cast<int32_t*>(base + K_ + 6 * f), reinterpret_cast<int32_t*>(base + K_ + 7 * f)};
  }

 private:
  // q, then per 32 values d, dh, ms, s16 (two), s32, z128 and z16
  int64_t row_bytes() const { return (K_ + 8 * (K_ / 8) + 63) / 64 * 64; }
  uint8_t* aligned() {
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bytes_.data()) + 63) & ~uintptr_t{63});
  }
  int64_t K_ = 0, rows_ = 0;
  std::vector<uint8_t> bytes_;
};

}  // namespace quant
}  // namespace deploykit
