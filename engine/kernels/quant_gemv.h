// Matrix-vector products on quantized weights (quant_layout.h) with int8 activations (quant_act.h): vpdpbusd
// (AVX512-VNNI) accumulates exact int32 dot products of 32 k per unit, and each unit's int32 sums become fp32 once
// with the weight and activation scales. Shared by quant_linear (qlinear.cpp) and the fused decode step, so both
// give bitwise the same outputs: every output column is summed over k in the same order whatever the grouping,
// the row count or the thread split.
//
// Registers (AVX-512 has 32): MT rows of one 16-column group need 2 MT int32 accumulators (two chains) and MT fp32
// ones; the activations are read as embedded broadcasts (dot4).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "quant_act.h"
#include "quant_layout.h"
#include "quant_scale.h"
#include "quant_stream.h"
#include "vec.h"

namespace deploykit {
namespace quant {

// The 5-bit formats' fifth bits: plane | (bit e of every byte of the unit's b-line, moved to bit 4), the plane
// holding k-group e's 4-bit codes (quant_layout.h). With GFNI, one GF2P8AFFINEQB whose matrix keeps input bit e as
// output bit 4 and clears the rest, and an OR; without, a 16-bit shift (by at most 4: no bit of a neighbouring byte
// lands on bit 4) and a ternary AND-OR. Measured on Zen 4 at M = 1, one thread, Q5_0 in L3 (benchmarks/README.md,
// session 57), ns a 32-k unit of 16 rows: 8.4 with the 8 kmasks a unit the AVX-512 builds held before, 7.7 shifted,
// 7.0 GFNI (Q4_0 5.3). Written as asm so that the one library serves CPUs without GFNI (Skylake to Cooper Lake): the
// runtime switch below picks the path once per span, and GCC emits no GFNI instruction of its own. Outside the VNNI
// region below: quant_amx.h's decode, built without VNNI, inlines it too.
inline bool cpu_has_gfni() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c >> 8 & 1);  // CPUID.(7,0):ECX[8] GFNI
}
inline std::atomic<bool> fifth_gfni{cpu_has_gfni()};  // set_quant_gfni (qlinear.cpp) turns it off for the tests

template <bool Gfni>
[[gnu::always_inline]] inline __m512i or_fifth(__m512i plane, __m512i bline, int e) {
  if constexpr (Gfni) {
    const __m512i keep = _mm512_set1_epi64(static_cast<int64_t>(1ull << (e + 24)));  // matrix row of output bit 4
    __m512i bits;
    asm("vgf2p8affineqb $0, %2, %1, %0" : "=v"(bits) : "v"(bline), "v"(keep));
    return _mm512_or_si512(plane, bits);
  } else {
    const __m512i moved = e < 4 ? _mm512_slli_epi16(bline, 4 - e) : e > 4 ? _mm512_srli_epi16(bline, e - 4) : bline;
    return _mm512_ternarylogic_epi64(plane, moved, _mm512_set1_epi8(0x10), 0xF8);  // plane | (moved & 0x10)
  }
}

}  // namespace quant
}  // namespace deploykit

#pragma GCC push_options
#pragma GCC target("avx512vnni")
// GCC 12 warns inside its own _mm512_cvtph_ps / _mm512_reduce_* about an _mm256_undefined_* placeholder.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace deploykit {
namespace quant {

// One 16-row group at a time per core, for every format and row count, one sequential stream that the hardware
// prefetcher follows. Measured on Zen 4 at M = 1: an older kernel taking 2-8 neighbouring groups at once read DRAM
// at 20-36 against 38.9 GB/s for one; splitting a core's groups into 4 or 8 runs read side by side was 1.15x faster
// from L3 but tied from DRAM (Q4_0, the model's shapes) and made the batch-1 engine step slower, with the prefetch
// below or without it (benchmarks/decode_profile.py --gguf, Q4_0, variants alternated in one process, time a token
// over one stream 4 KiB ahead: 8 runs 1.14-1.22x, 4 runs 1.12-1.13x, 2 runs 1.05x; probe 29-52 GB/s).

// acc + w . (the 4 int8 at p, broadcast to every lane): vpdpbusd with its activations read as an embedded broadcast
// ({1to16}) rather than a separate vpbroadcastd per dot product, which GCC 12 does not fold by itself. Two fewer
// instructions per 64-byte line of a 4-bit format, one fewer for Q8_0, and the same int32 sums. Measured on Zen 4 at
// M = 1, Q4_0 at K = 896 (benchmarks/README.md): this loop against the previous one in one process, 47.4 against
// 42.8 GB/s with DRAM fast and 37.6 against 33.7 when slow; through quant_linear, builds alternated, one new run
// with DRAM fast at 55.5 against two old ones at 46.9 and 51.3 GB/s. Through quant_linear, Q8_0 and Q4_0 at K = 4864
// did not move (there the activations' L1 misses dominate; benchmarks/README.md).
using i32_alias = int32_t __attribute__((may_alias));
inline __m512i dot4(__m512i acc, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const i32_alias*>(p)));
  return acc;
}
inline __m512i bcast4(const int32_t* p) { return _mm512_set1_epi32(*p); }

inline void store16(at::BFloat16* p, __m512 v) { vec::store16(p, v); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// The fp32 sums of one 16-row group for MT activation rows, carried across its segments (quant_rows.h).
template <int MT>
struct Sums {
  __m512 v[MT];
  Sums() {
    for (int m = 0; m < MT; ++m) v[m] = _mm512_setzero_ps();
  }
};

// sums += the units of chunks [c0, c1) of one 16-row group, chunk c at base + c chunk_bytes (one segment of it,
// Part::segments). Ahead: request the weights ahead of the stream (quant_stream.h: how far, per format, and into
// which cache); a distance of 0 turns that off.
// Gfni: how the 5-bit formats' fifth bits are placed (or_fifth above).
template <int F, int MT, bool Ahead, bool Gfni>
[[gnu::always_inline]] inline void span_on(const Act* act, const uint8_t* base, int64_t c0, int64_t c1,
                                           Sums<MT>& sums) {
  constexpr Info inf = info_of(F);
  constexpr bool nibbles = F != Q8_0, five = fifth_bit(F);
  // 4-bit codes without a fifth or sixth bit: the high nibble is dotted where it lies (16 x its value, one ANDN
  // instead of a shift and an AND per line) and the unit's sum shifted back once, exactly (a multiple of 16: Q4_0's
  // chain starts at -128 sum q = 16 x -8 sum q; at most 4 x 4 x 240 x 128 + 128 x 32 x 127 per lane). In-cache (L3)
  // Q4_0 at M = 1 ran 1.05-1.10x faster on Zen 4, bitwise the same.
  constexpr bool hi16 = F == Q4_0 || F == Q4_1 || F == Q4_K;
  __m512 accf[MT];  // a local copy, kept in registers through the loop (sums itself may alias act)
  for (int m = 0; m < MT; ++m) accf[m] = sums.v[m];
  const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
  const int64_t ahead = Ahead ? stream_ahead.bytes[F].load(std::memory_order_relaxed) : 0;
  const Hint hint = stream_ahead.hint.load(std::memory_order_relaxed);
  for (int64_t c = c0; c < c1; ++c) {
    for (int u = 0; u < inf.units; ++u) {
      if (ahead) request_ahead<F>(base + c * inf.chunk_bytes, u, ahead, hint);
      const int64_t unit = c * inf.units + u;
      __m512i acc[MT], accb[MT];  // two chains; Q6_K: accb is the unit's second 16 k (its own scale)
      for (int m = 0; m < MT; ++m) acc[m] = accb[m] = _mm512_setzero_si512();
      if constexpr (!nibbles) {
        if constexpr (F == Q8_0)  // the chain starts at -128 sum q, so it ends at sum (c - 128) q (exact int32)
          for (int m = 0; m < MT; ++m) acc[m] = bcast4(act[m].z128 + unit);
        for (int e = 0; e < 8; ++e) {
          const __m512i w = _mm512_loadu_si512(base + c * inf.chunk_bytes + u * 512 + e * 64);
          for (int m = 0; m < MT; ++m) {  // even and odd lines on two chains: half the dependency latency
            if (e % 2 == 0)
              acc[m] = dot4(acc[m], w, act[m].q + unit * 32 + 4 * e);
            else
              accb[m] = dot4(accb[m], w, act[m].q + unit * 32 + 4 * e);
          }
        }
      } else {
        constexpr int64_t unit_bytes = F == Q6_K ? 384 : 256;
        if constexpr (F == Q5_0)  // the low chain starts at -16 sum q: with the high one, sum (c - 16) q
          for (int m = 0; m < MT; ++m) acc[m] = bcast4(act[m].z16 + unit);
        if constexpr (F == Q4_0)  // the high chain, summing 16 c q, starts at -128 sum q: shifted back, sum (c - 8) q
          for (int m = 0; m < MT; ++m) accb[m] = bcast4(act[m].z128 + unit);
        for (int l = 0; l < 4; ++l) {
          const uint8_t* lines = base + c * inf.chunk_bytes + u * unit_bytes;
          const __m512i v = _mm512_loadu_si512(lines + l * 64);
          __m512i lo = _mm512_and_si512(v, low4);
          __m512i hi = hi16 ? _mm512_andnot_si512(low4, v) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          if constexpr (five) {  // the unit's b-line: bit l of each byte is k-group l's fifth bit, l + 4 the high's
            const __m512i bline = _mm512_loadu_si512(base + c * inf.chunk_bytes + fifth_at(F) + u * 64);
            lo = or_fifth<Gfni>(lo, bline, l);
            hi = or_fifth<Gfni>(hi, bline, l + 4);
          }
          if constexpr (F == Q6_K) {  // top 2 bits of k-group l in h-line 0, of l + 4 in h-line 1, bits 2l..2l+1
            const __m512i h0 = _mm512_loadu_si512(lines + 256), h1 = _mm512_loadu_si512(lines + 320);
            const int s = 4 - 2 * l;  // move bits 2l..2l+1 to 4..5
            const __m512i t0 = s >= 0 ? _mm512_slli_epi16(h0, s) : _mm512_srli_epi16(h0, -s);
            const __m512i t1 = s >= 0 ? _mm512_slli_epi16(h1, s) : _mm512_srli_epi16(h1, -s);
            lo = _mm512_or_si512(lo, _mm512_and_si512(t0, top2));
            hi = _mm512_or_si512(hi, _mm512_and_si512(t1, top2));
          }
          for (int m = 0; m < MT; ++m) {  // low and high nibbles on two chains (Q6_K: its two 16-k scales)
            acc[m] = dot4(acc[m], lo, act[m].q + unit * 32 + 4 * l);
            accb[m] = dot4(accb[m], hi, act[m].q + unit * 32 + 16 + 4 * l);
          }
        }
      }
      // acc (+ accb) = sum over the unit of code * q (signed where a chain started at its offset); make Q6_K's
      // signed and scale it into accf. (Q5_0's offset was a subtraction here, 0.45 ns of its 8.4 a unit.)
      if constexpr (F != Q6_K)
        for (int m = 0; m < MT; ++m)
          acc[m] = _mm512_add_epi32(acc[m], hi16 ? _mm512_srai_epi32(accb[m], 4) : accb[m]);
      if constexpr (F == Q6_K)
        for (int m = 0; m < MT; ++m) {
          acc[m] = _mm512_sub_epi32(acc[m], _mm512_set1_epi32(32 * act[m].s16[2 * unit]));
          accb[m] = _mm512_sub_epi32(accb[m], _mm512_set1_epi32(32 * act[m].s16[2 * unit + 1]));
        }
      const UnitScale<F> scale(base + c * inf.chunk_bytes, u);
      for (int m = 0; m < MT; ++m) accf[m] = scale.apply(accf[m], acc[m], accb[m], ActScalars{act[m], unit});
    }
  }
  for (int m = 0; m < MT; ++m) sums.v[m] = accf[m];
}

template <int F, int MT, bool Ahead>
[[gnu::always_inline]] inline void span(const Act* act, const uint8_t* base, int64_t c0, int64_t c1, Sums<MT>& sums) {
  if constexpr (fifth_bit(F))
    if (fifth_gfni.load(std::memory_order_relaxed)) return span_on<F, MT, Ahead, true>(act, base, c0, c1, sums);
  span_on<F, MT, Ahead, false>(act, base, c0, c1, sums);
}

// out[m, 16 gl .. 16 gl + 16) of part p: a group's sums plus its bias.
template <int MT, class Out>
inline void finish(const Sums<MT>& sums, const Part& p, int64_t gl, const float* bias, Out* out, int64_t ldo) {
  const int64_t col = p.row0 + 16 * gl;
  const __m512 b = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) store16(out + m * ldo + col, _mm512_add_ps(sums.v[m], b));
}

}  // namespace quant
}  // namespace deploykit

#include "quant_rows.h"  // group() and rows(): a matrix's groups and panels, through span() and finish() above

#pragma GCC diagnostic pop
#pragma GCC pop_options
