// Matrix-vector products on quantized weights (quant_layout.h) for CPUs with AVX2 but no AVX-512 (Zen 2 and 3,
// Haswell to Alder Lake): the same layout, the same int8 activations (quant_act.h) and, per output, the same int32
// sum of each 32-k unit and the same fp32 operations on it in the same order as quant_gemv.h, so by construction the
// outputs are those of the AVX-512 kernel bit for bit. tests/engine/test_quant.py holds both to one reference (on an
// AVX-512 host it forces this build with DEPLOYKIT_KERNELS=avx2); it does not compare the two bit for bit.
//
// A 64-byte line (16 rows x 4 k) is taken as two 32-byte halves, rows 0-7 and 8-15. Without vpdpbusd, a dot product
// of 4 codes and 4 broadcast activations is vpmaddubsw (u8 x s8 -> pairs summed to int16, saturating) and, once per
// run of lines, vpmaddwd against ones (-> int32). The int16 sums stay exact as long as no pair sum or partial sum passes
// 32767; with activations in [-127, 127]:
//   4-bit codes (Q4_0, Q4_1, Q4_K):  2 x 15 x 127 = 3,810 a pair; a unit's 8 products of pairs (4 lines, low and high
//                                    nibble) sum to at most 30,480, so a unit widens once;
//   5-bit codes (Q5_0, Q5_1, Q5_K):  7,874 a pair, 15,748 a line: widened every 2 lines;
//   6-bit codes (Q6_K):              16,002 a pair, per 16-k half of the unit (each has its own scale): every 2 lines;
//   Q8_0's codes (c = q + 128, up to 255) would saturate: the code goes back to the signed q (c ^ 0x80) and the
//                                    product is |q| x (x with q's sign), at most 2 x 128 x 127 = 32,512, widened per line.
// The high nibble is shifted down rather than dotted in place (16 x its code would pass 32767 a pair).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_act.h"
#include "quant_layout.h"
#include "quant_stream.h"

namespace deploykit {
namespace quant {

inline __m256 halves(const uint8_t* p) {  // 8 fp16 -> fp32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i bcast4(const int8_t* p) {  // 4 int8 activations in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }  // int16 -> int32
inline __m256 cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256 u8s(const uint8_t* p) {  // 8 u8 -> fp32
  return cvt(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256i s8s(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// Bit e of every byte of a b-line half (the Q5 formats' 5th bits of k-group e, quant_layout.h) moved to bit 4, the
// rest of the byte cleared: a 16-bit shift by at most 4 moves bit 4 of each byte within its byte.
[[gnu::always_inline]] inline __m256i fifth_bits(__m256i bline, int e) {
  const __m256i bit5 = _mm256_set1_epi8(0x10);
  if (e < 4) return _mm256_and_si256(_mm256_slli_epi16(bline, 4 - e), bit5);
  if (e == 4) return _mm256_and_si256(bline, bit5);
  return _mm256_and_si256(_mm256_srli_epi16(bline, e - 4), bit5);
}

// 8 fp32 -> 8 bf16 as vec.h's to_bf16 (and vcvtneps2bf16): nearest even, NaN quiet, denormal inputs a signed zero.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  const __m256i tiny = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F800000)), _mm256_setzero_si256());
  r = _mm256_blendv_epi8(r, _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int32_t>(0x80000000u))), tiny);
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(r, 16), _mm256_setzero_si256());  // per lane: 4 + 4 zeros
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));                       // lanes' low halves
}
inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// One unit's int32 sums for rows 8h .. 8h + 7 of a group (acc; Q6_K's second 16 k in accb), scaled into the fp32
// accumulators af as quant_gemv.h does, lane for lane, with those rows' scales from the chunk at ch.
template <int F, int MT>
[[gnu::always_inline]] inline void scale_unit(const Act* act, const uint8_t* ch, int u, int64_t unit, int h,
                                              const __m256i* acc, const __m256i* accb, __m256* af) {
  constexpr bool five = F == Q5_0 || F == Q5_1, offset = F == Q4_1 || F == Q5_1;
  if constexpr (F == Q8_0 || F == Q4_0 || F == Q5_0) {  // zero points 128, 8, 16: sum (c - z) q
    constexpr int z = F == Q8_0 ? 0 : F == Q4_0 ? 8 : 16;  // Q8_0's q is signed already
    const __m256 dw = halves(ch + (F == Q8_0 ? 1024 : F == Q4_0 ? 512 : 640) + u * 32 + 16 * h);
    for (int m = 0; m < MT; ++m) {
      const __m256i t = z ? _mm256_sub_epi32(acc[m], _mm256_set1_epi32(z * act[m].s32[unit])) : acc[m];
      af[m] = _mm256_fmadd_ps(cvt(t), _mm256_mul_ps(dw, _mm256_set1_ps(act[m].dh[unit])), af[m]);
    }
  } else if constexpr (offset) {  // d_w dh sum c q + m_w s, s = fp16(d sum q): Q8_1's terms
    const uint8_t* sc = ch + (five ? 640 : 512);
    const __m256 dw = halves(sc + u * 32 + 16 * h), mw = halves(sc + 64 + u * 32 + 16 * h);
    for (int m = 0; m < MT; ++m) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(act[m].dh[unit]));
      af[m] = _mm256_fmadd_ps(cvt(acc[m]), scale, af[m]);
      af[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(act[m].ms[unit]), af[m]);
    }
  } else if constexpr (F == Q4_K || F == Q5_K) {
    const uint8_t* s = ch + kscales_at(F);
    const __m256 scale = _mm256_mul_ps(halves(s + 16 * h), u8s(s + 64 + u * 16 + 8 * h));
    const __m256 mins = _mm256_mul_ps(halves(s + 32 + 16 * h), u8s(s + 192 + u * 16 + 8 * h));
    for (int m = 0; m < MT; ++m) {
      const float dx = act[m].d[unit];
      af[m] = _mm256_fmadd_ps(cvt(acc[m]), _mm256_mul_ps(scale, _mm256_set1_ps(dx)), af[m]);
      af[m] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(dx * (float)act[m].s32[unit]), af[m]);
    }
  } else {  // Q6_K: d * (sc_a * (dot_a - 32 sum_a) + sc_b * (dot_b - 32 sum_b)) per 16 k
    const __m256i sa = s8s(ch + 3072 + 2 * u * 16 + 8 * h), sb = s8s(ch + 3072 + (2 * u + 1) * 16 + 8 * h);
    const __m256 dw = halves(ch + 3072 + 256 + 16 * h);
    for (int m = 0; m < MT; ++m) {
      const __m256i ta = _mm256_sub_epi32(acc[m], _mm256_set1_epi32(32 * act[m].s16[2 * unit]));
      const __m256i tb = _mm256_sub_epi32(accb[m], _mm256_set1_epi32(32 * act[m].s16[2 * unit + 1]));
      const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(ta, sa), _mm256_mullo_epi32(tb, sb));
      af[m] = _mm256_fmadd_ps(cvt(t), _mm256_mul_ps(dw, _mm256_set1_ps(act[m].d[unit])), af[m]);
    }
  }
}

// One unit of a 16-row group for MT >= 2 rows of a 4-, 5- or 8-bit format, both halves in one pass over its lines:
// each activation broadcast serves 16 rows and each line is loaded once, where group() below takes one half a pass.
// The same int32 sums and fp32 steps per output, so the same bits. On a 2-vCPU Zen 3 (benchmarks/README.md, variants
// alternated in one process), time against one half a pass: 4 rows Q4_0 0.83-0.90, Q4_1 0.78, Q4_K 0.74, Q8_0 0.83;
// 16 rows Q4_0 0.79, Q8_0 0.74; 2 rows Q4_0 0.90-0.93; 1 row within the noise (the weight stream decides there, and
// group() keeps one half a pass). The 5-bit formats joined once their 5th bits came as a b-line (a shift and an AND
// a plane; expanding masks had spilled AVX2's 16 registers, 1.12x the time at 16 rows): with the b-line, Q5_0 and
// Q5_1 at 4 and 16 rows ran 1.2-1.6x the rate of masks one half a pass (benchmarks/README.md, session 33). Q6_K keeps
// one half a pass: its h-lines' registers spill (1.96x the time at 4 rows).
template <int F, int MT>
[[gnu::always_inline]] inline void both_halves(const Act* act, const uint8_t* ch, int u, int64_t unit,
                                               __m256 (*accf)[MT]) {
  static_assert(F != Q6_K);
  __m256i acc[2][MT];  // per half (rows 8h .. 8h + 7): int32 sums of code x q over the unit
  if constexpr (F == Q8_0) {
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_si256();
    for (int e = 0; e < 8; ++e) {
      __m256i w[2], aw[2];
      for (int h = 0; h < 2; ++h) {
        w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + u * 512 + e * 64 + 32 * h)),
                                _mm256_set1_epi8(static_cast<char>(0x80)));  // c - 128 = q, signed
        aw[h] = _mm256_abs_epi8(w[h]);
      }
      for (int m = 0; m < MT; ++m) {
        const __m256i x = bcast4(act[m].q + unit * 32 + 4 * e);
        for (int h = 0; h < 2; ++h)
          acc[h][m] = _mm256_add_epi32(acc[h][m], widen(_mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(x, w[h]))));
      }
    }
  } else {  // int16 pair sums widened every 4 lines (4-bit codes) or 2 (5-bit), the bounds above
    constexpr bool five = fifth_bit(F);
    constexpr int widen_every = five ? 2 : 4;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t* lines = ch + u * 256;
    __m256i pa[2][MT];
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MT; ++m) pa[h][m] = acc[h][m] = _mm256_setzero_si256();
#pragma GCC unroll 4  // so each plane's shift count is a constant
    for (int l = 0; l < 4; ++l) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + l * 64 + 32 * h));
        lo[h] = _mm256_and_si256(v, low4);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (five) {  // this half's b-line bytes, bit e the 5th bit of k-group e (quant_layout.h)
          const __m256i bline =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + fifth_at(F) + u * 64 + 32 * h));
          lo[h] = _mm256_or_si256(lo[h], fifth_bits(bline, l));
          hi[h] = _mm256_or_si256(hi[h], fifth_bits(bline, l + 4));
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m256i xl = bcast4(act[m].q + unit * 32 + 4 * l), xh = bcast4(act[m].q + unit * 32 + 16 + 4 * l);
        for (int h = 0; h < 2; ++h)
          pa[h][m] = _mm256_add_epi16(pa[h][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                                 _mm256_maddubs_epi16(hi[h], xh)));
      }
      if ((l + 1) % widen_every == 0)
        for (int h = 0; h < 2; ++h)
          for (int m = 0; m < MT; ++m) {
            acc[h][m] = _mm256_add_epi32(acc[h][m], widen(pa[h][m]));
            pa[h][m] = _mm256_setzero_si256();
          }
    }
  }
  for (int h = 0; h < 2; ++h) scale_unit<F, MT>(act, ch, u, unit, h, acc[h], nullptr, accf[h]);
}

// The fp32 sums of one 16-row group for MT activation rows (two halves of 8 rows), carried across its segments.
template <int MT>
struct Sums {
  __m256 v[2][MT];
  Sums() {
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MT; ++m) v[h][m] = _mm256_setzero_ps();
  }
};

// sums += the units of chunks [c0, c1) of one 16-row group, chunk c at base + c chunk_bytes (one segment of it,
// Part::segments): one half (8 rows) at a time inside each unit, so the int accumulators of one half and the fp32 ones
// of both fit AVX2's 16 registers at MT <= 2; from 2 rows, every format but Q6_K in one pass for both halves
// (both_halves).
template <int F, int MT, bool Ahead>
[[gnu::always_inline]] inline void span(const Act* act, const uint8_t* base, int64_t c0, int64_t c1, Sums<MT>& sums) {
  constexpr Info inf = info_of(F);
  constexpr bool five = fifth_bit(F);
  constexpr bool both = MT >= 2 && F != Q6_K;
  __m256 accf[2][MT];  // a local copy, kept in registers through the loop (sums itself may alias act)
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) accf[h][m] = sums.v[h][m];
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  const int64_t ahead = Ahead ? stream_ahead.bytes[F].load(std::memory_order_relaxed) : 0;
  const Hint hint = stream_ahead.hint.load(std::memory_order_relaxed);
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* ch = base + c * inf.chunk_bytes;
    for (int u = 0; u < inf.units; ++u) {
      if (ahead) request_ahead<F>(ch, u, ahead, hint);  // quant_stream.h
      const int64_t unit = c * inf.units + u;
      if constexpr (both) {
        both_halves<F, MT>(act, ch, u, unit, accf);
        continue;
      }
      for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7: bytes 32h .. 32h + 31 of every line
        __m256i acc[MT], accb[MT];   // int32 sums of code x q over the unit (Q6_K: accb is its second 16 k)
        for (int m = 0; m < MT; ++m) acc[m] = accb[m] = _mm256_setzero_si256();
        if constexpr (F == Q8_0) {
          for (int e = 0; e < 8; ++e) {
            const __m256i w = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + u * 512 + e * 64 + 32 * h)),
                _mm256_set1_epi8(static_cast<char>(0x80)));  // c - 128 = q, signed
            const __m256i aw = _mm256_abs_epi8(w);
            for (int m = 0; m < MT; ++m) {
              const __m256i x = _mm256_sign_epi8(bcast4(act[m].q + unit * 32 + 4 * e), w);
              acc[m] = _mm256_add_epi32(acc[m], widen(_mm256_maddubs_epi16(aw, x)));
            }
          }
        } else {
          constexpr int64_t unit_bytes = F == Q6_K ? 384 : 256;
          constexpr int widen_every = F == Q4_0 || F == Q4_1 || F == Q4_K ? 4 : 2;  // lines (the bounds above)
          const uint8_t* lines = ch + u * unit_bytes + 32 * h;
          __m256i pa[MT], pb[MT];  // int16 pair sums since the last widening: low nibbles (Q6_K: first 16 k), high
          for (int m = 0; m < MT; ++m) pa[m] = pb[m] = _mm256_setzero_si256();
          // Q5: this half's b-line bytes (rows 8h .. 8h + 7), bit e the 5th bit of k-group e.
          const __m256i bline = five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                           ch + fifth_at(F) + u * 64 + 32 * h))
                                     : _mm256_setzero_si256();
#pragma GCC unroll 4  // so each plane's shift count is a constant
          for (int l = 0; l < 4; ++l) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + l * 64));
            __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if constexpr (five) {  // k-group l in the low nibbles, l + 4 in the high ones
              lo = _mm256_or_si256(lo, fifth_bits(bline, l));
              hi = _mm256_or_si256(hi, fifth_bits(bline, l + 4));
            }
            if constexpr (F == Q6_K) {  // top 2 bits of k-group l in h-line 0, of l + 4 in h-line 1, bits 2l..2l+1
              const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 256));
              const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + 320));
              const int s = 4 - 2 * l;  // move bits 2l..2l+1 to 4..5
              const __m256i t0 = s >= 0 ? _mm256_slli_epi16(h0, s) : _mm256_srli_epi16(h0, -s);
              const __m256i t1 = s >= 0 ? _mm256_slli_epi16(h1, s) : _mm256_srli_epi16(h1, -s);
              lo = _mm256_or_si256(lo, _mm256_and_si256(t0, top2));
              hi = _mm256_or_si256(hi, _mm256_and_si256(t1, top2));
            }
            for (int m = 0; m < MT; ++m) {
              const __m256i dl = _mm256_maddubs_epi16(lo, bcast4(act[m].q + unit * 32 + 4 * l));
              const __m256i dh = _mm256_maddubs_epi16(hi, bcast4(act[m].q + unit * 32 + 16 + 4 * l));
              if constexpr (F == Q6_K) {
                pa[m] = _mm256_add_epi16(pa[m], dl);
                pb[m] = _mm256_add_epi16(pb[m], dh);
              } else {
                pa[m] = _mm256_add_epi16(pa[m], _mm256_add_epi16(dl, dh));
              }
            }
            if ((l + 1) % widen_every == 0)
              for (int m = 0; m < MT; ++m) {
                acc[m] = _mm256_add_epi32(acc[m], widen(pa[m]));
                if constexpr (F == Q6_K) accb[m] = _mm256_add_epi32(accb[m], widen(pb[m]));
                pa[m] = pb[m] = _mm256_setzero_si256();
              }
          }
        }
        scale_unit<F, MT>(act, ch, u, unit, h, acc, accb, accf[h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) sums.v[h][m] = accf[h][m];
}

// out[m, 16 gl .. 16 gl + 16) of part p: a group's sums plus its bias.
template <int MT, class Out>
inline void finish(const Sums<MT>& sums, const Part& p, int64_t gl, const float* bias, Out* out, int64_t ldo) {
  const int64_t col = p.row0 + 16 * gl;
  for (int h = 0; h < 2; ++h) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + col + 8 * h) : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m) store8(out + m * ldo + col + 8 * h, _mm256_add_ps(sums.v[h][m], b));
  }
}

}  // namespace quant
}  // namespace deploykit

#include "quant_rows.h"  // group() and rows(): a matrix's groups and panels, through span() and finish() above
