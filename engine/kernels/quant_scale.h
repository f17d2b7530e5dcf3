// The fp32 steps of one 32-k unit of a quantized matrix (quant_layout.h) for one 16-column group: the unit's exact
// int32 dot products with one activation row (quant_act.h) become fp32 with the weight and activation scales and are
// added into that row's 16 column sums. Both int8 kernels end every unit here: the VNNI GEMV (quant_gemv.h), which
// sums the int32 dots with vpdpbusd, and the AMX tiles (quant_amx.h), which sum the same products with tdpbssd. An
// int32 sum is exact whatever adds it, so with this one sequence of fp32 operations a row's output is bitwise the
// same whichever kernel ran it.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "quant_act.h"
#include "quant_layout.h"

namespace deploykit {
namespace quant {

inline __m512 halves(const uint8_t* p) {  // 16 fp16 -> fp32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }

// An activation row's scalars for unit `unit`: the block's fp16-rounded and fp32 scales, Q8_1's s, and d sum q.
struct ActScalars {
  const Act& a;
  int64_t unit;
  float dh() const { return a.dh[unit]; }
  float ms() const { return a.ms[unit]; }
  float d() const { return a.d[unit]; }
  float dsum() const { return a.d[unit] * (float)a.s32[unit]; }
};

// Unit u of the chunk at ch (one 16-row group's chunk). t: the unit's signed dot products, sum over its 32 k of
// value code x q (Q8_0 c - 128, Q4_0 c - 8, Q5_0 c - 16; the offset and K formats their unsigned codes, whose offsets
// come in here); Q6_K: t and tb are its first and second 16 k, each sum (c - 32) q, with their own sub-scales.
template <int F>
struct UnitScale {
  __m512 w0, w1;   // Q8_0/Q4_0/Q5_0 and Q6_K: d_w; Q4_1/Q5_1: d_w, m_w; Q4_K/Q5_K: d sc_j, dmin m_j
  __m512i sa, sb;  // Q6_K: the two 16-k sub-scales

  [[gnu::always_inline]] inline UnitScale(const uint8_t* ch, int u) {
    if constexpr (F == Q8_0 || F == Q4_0 || F == Q5_0) {
      w0 = halves(ch + (F == Q8_0 ? 1024 : F == Q4_0 ? 512 : 640) + u * 32);
    } else if constexpr (F == Q4_1 || F == Q5_1) {
      const uint8_t* sc = ch + (F == Q5_1 ? 640 : 512);
      w0 = halves(sc + u * 32);
      w1 = halves(sc + 64 + u * 32);
    } else if constexpr (F == Q4_K || F == Q5_K) {
      const auto u8s = [&](int64_t at) {
        return cvt(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + at))));
      };
      constexpr int64_t s = kscales_at(F);
      w0 = _mm512_mul_ps(halves(ch + s), u8s(s + 64 + u * 16));
      w1 = _mm512_mul_ps(halves(ch + s + 32), u8s(s + 192 + u * 16));
    } else {  // Q6_K
      const auto s8s = [&](int64_t at) {
        return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + at)));
      };
      sa = s8s(3072 + 2 * u * 16);
      sb = s8s(3072 + (2 * u + 1) * 16);
      w0 = halves(ch + 3072 + 256);
    }
  }

  // accf + this unit's term for one activation row, whose scalars for this unit x gives (ActScalars below, or the
  // AMX path's tables of the same values).
  template <class X>
  [[gnu::always_inline]] inline __m512 apply(__m512 accf, __m512i t, __m512i tb, const X& x) const {
    if constexpr (F == Q8_0 || F == Q4_0 || F == Q5_0) {
      return _mm512_fmadd_ps(cvt(t), _mm512_mul_ps(w0, _mm512_set1_ps(x.dh())), accf);
    } else if constexpr (F == Q4_1 || F == Q5_1) {  // d_w dh sum c q + m_w s, s = fp16(d sum q): Q8_1's terms
      accf = _mm512_fmadd_ps(cvt(t), _mm512_mul_ps(w0, _mm512_set1_ps(x.dh())), accf);
      return _mm512_fmadd_ps(w1, _mm512_set1_ps(x.ms()), accf);
    } else if constexpr (F == Q4_K || F == Q5_K) {
      accf = _mm512_fmadd_ps(cvt(t), _mm512_mul_ps(w0, _mm512_set1_ps(x.d())), accf);
      return _mm512_fnmadd_ps(w1, _mm512_set1_ps(x.dsum()), accf);
    } else {  // Q6_K: d (sc_a t + sc_b tb)
      const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(t, sa), _mm512_mullo_epi32(tb, sb));
      return _mm512_fmadd_ps(cvt(s), _mm512_mul_ps(w0, _mm512_set1_ps(x.d())), accf);
    }
  }
};

}  // namespace quant
}  // namespace deploykit
