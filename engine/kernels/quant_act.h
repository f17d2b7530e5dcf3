// Activations quantized on the fly for the int8 dot products of quantized weights (quant_gemv.h).
//
// Per block of 32: d = max|x| / 127, q = round(x / d) (nearest even) in [-127, 127], as llama.cpp's Q8_0
// activations; and the sums of q per 16 and per 32, which turn the unsigned weight codes back into signed values
// (sum (c - 128) q = sum c q - 128 sum q) and carry the Q4_1/Q4_K offsets. A row of K values takes 1.5 K bytes.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "vec.h"

namespace deploykit {
namespace quant {

struct Act {  // one row
  int8_t* q;     // [K], 64-byte aligned
  float* d;      // [K / 32] scales
  int32_t* s16;  // [K / 16] sums of q
  int32_t* s32;  // [K / 32]
};

inline __m512 load_f32(const at::BFloat16* p) { return vec::load16(p); }
inline __m512 load_f32(const float* p) { return _mm512_loadu_ps(p); }

// x [K] (K a multiple of 32) -> a. (GCC 12 warns inside its own _mm512_reduce_* about _mm256_undefined_si256.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <class T>
inline void quantize(const T* x, int64_t K, const Act& a) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 lo = load_f32(x + 32 * b), hi = load_f32(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;  // llama.cpp's id, to the bit
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q + 32 * b), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q + 32 * b + 16), _mm512_cvtsepi32_epi8(qhi));
    a.d[b] = d;
    a.s16[2 * b] = _mm512_reduce_add_epi32(qlo);
    a.s16[2 * b + 1] = _mm512_reduce_add_epi32(qhi);
    a.s32[b] = a.s16[2 * b] + a.s16[2 * b + 1];
  }
}
#pragma GCC diagnostic pop

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
    return Act{reinterpret_cast<int8_t*>(base), reinterpret_cast<float*>(base + K_),
               reinterpret_cast<int32_t*>(base + K_ + K_ / 8), reinterpret_cast<int32_t*>(base + K_ + K_ / 8 + K_ / 4)};
  }

 private:
  int64_t row_bytes() const { return K_ + K_ / 8 + K_ / 4 + K_ / 8; }  // q, d, s16, s32: multiples of 64
  uint8_t* aligned() {
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bytes_.data()) + 63) & ~uintptr_t{63});
  }
  int64_t K_ = 0, rows_ = 0;
  std::vector<uint8_t> bytes_;
};

}  // namespace quant
}  // namespace deploykit
