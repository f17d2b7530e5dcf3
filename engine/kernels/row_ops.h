// Per-row bf16 element-wise ops (fp32 inside), shared by the fused ops of decode_ops.cpp and the fused batch-1
// decode step (decode_step.cpp), so both produce bitwise the same outputs.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cmath>

#include "vec.h"

namespace deploykit {
namespace rows {

using bf16 = at::BFloat16;
using namespace vec;

// row[0:H] += delta, rounded to bf16 element by element (the residual stream is stored in bf16).
inline void add_(bf16* row, const bf16* delta, int64_t H) {
  int64_t k = 0;
  for (; k + 16 <= H; k += 16) store16(row + k, _mm512_add_ps(load16(row + k), load16(delta + k)));
  for (; k < H; ++k) row[k] = bf16(float(row[k]) + float(delta[k]));
}

// out[0:H] = row * rsqrt(mean(row^2) + eps) * w.
inline void rms_norm(const bf16* row, const bf16* w, int64_t H, float eps, bf16* out) {
  __m512 ss = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= H; k += 16) {
    const __m512 v = load16(row + k);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  float tail = 0.0f;
  for (; k < H; ++k) tail += float(row[k]) * float(row[k]);
  const float r = 1.0f / std::sqrt((_mm512_reduce_add_ps(ss) + tail) / (float)H + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (k = 0; k + 16 <= H; k += 16) store16(out + k, _mm512_mul_ps(_mm512_mul_ps(load16(row + k), rv), load16(w + k)));
  if (k < H) {
    const __mmask16 mk = tail_mask(H - k);
    store16_masked(out + k, _mm512_mul_ps(_mm512_mul_ps(load16_masked(row + k, mk), rv), load16_masked(w + k, mk)), mk);
  }
}

// out[0:n] = silu(gate) * up.
inline void silu_mul(const bf16* gate, const bf16* up, int64_t n, bf16* out) {
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 mk = k + 16 <= n ? (__mmask16)0xFFFF : tail_mask(n - k);
    store16_masked(out + k, vec::silu_mul(load16_masked(gate + k, mk), load16_masked(up + k, mk)), mk);
  }
}

// One head r[0:D] in place, HF rotate-half layout: r = r * cos + roll(r, D/2) * sin_signed.
inline void rotary(bf16* r, const bf16* c, const bf16* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t k = 0; k < half; k += 16) {
    const __mmask16 mk = k + 16 <= half ? (__mmask16)0xFFFF : tail_mask(half - k);
    const __m512 a = load16_masked(r + k, mk), b = load16_masked(r + half + k, mk);
    // out[:half] = a*cos[:half] + b*sin[:half] (sin[:half] = -sin); out[half:] = b*cos[half:] + a*sin[half:]
    const __m512 lo = _mm512_fmadd_ps(b, load16_masked(s + k, mk), _mm512_mul_ps(a, load16_masked(c + k, mk)));
    const __m512 hi =
        _mm512_fmadd_ps(a, load16_masked(s + half + k, mk), _mm512_mul_ps(b, load16_masked(c + half + k, mk)));
    store16_masked(r + k, lo, mk);
    store16_masked(r + half + k, hi, mk);
  }
}

}  // namespace rows
}  // namespace deploykit
