// The packed bf16 GEMV inner kernel, shared by linear_packed_avx512 (gemv_bf16.cpp) and the fused batch-1
// decode step (decode_step.cpp), so both produce bitwise the same outputs.
//
// Packed weights are [N/16, K/2, 16, 2] "VNNI" blocks: one 64-byte line holds the k-pair (2j, 2j+1) of 16
// output columns, so x pairs are broadcast and no horizontal reduction is needed. Every output column block
// is summed over k in the same order whatever the grouping, so results never depend on the thread count.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <atomic>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace deploykit {
namespace gemv {

using bf16 = at::BFloat16;

inline int32_t load_pair(const bf16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));  // x rows are only 2-byte aligned for odd row strides
  return v;
}

// Each of the G column-block streams is requested this far ahead: the hardware prefetcher restarts
// at every group of blocks, which costs most on small matrices (a 2 MiB qkv is ~80 us in total).
constexpr int64_t PACKED_PREFETCH_BYTES = 2048;

// out[m, 16*nb[g] + j] for G column blocks of 16 (block ids nb[0..G), any order) and MT x rows. PF: prefetch
// the weight streams ahead (off when these blocks were just read for other rows and sit in L1/L2).
template <int G, int MT, bool PF = true>
inline void packed_blocks(const bf16* x, int64_t ldx, const bf16* wp, int64_t Kh, const int64_t nb[G],
                          const float* bias, bf16* out, int64_t ldo) {
  __m512 acc[MT][G];
  const bf16* wb[G];
  for (int g = 0; g < G; ++g) wb[g] = wp + nb[g] * Kh * 32;
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < G; ++g) acc[m][g] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < Kh; ++kp) {
    __m512i wv[G];
    for (int g = 0; g < G; ++g) {
      const bf16* line = wb[g] + kp * 32;
      if (PF) _mm_prefetch(reinterpret_cast<const char*>(line) + PACKED_PREFETCH_BYTES, _MM_HINT_T0);
      wv[g] = _mm512_loadu_si512(line);
    }
    for (int m = 0; m < MT; ++m) {
      __m512i xb = _mm512_set1_epi32(load_pair(x + m * ldx + 2 * kp));
      for (int g = 0; g < G; ++g) acc[m][g] = vec::dot2(acc[m][g], wv[g], xb);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < G; ++g) {
      __m512 v = acc[m][g];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + nb[g] * 16));
      const __m256i h = vec::to_bf16(v);
      std::memcpy(out + m * ldo + nb[g] * 16, &h, sizeof(h));
    }
}

// G consecutive column blocks from nb0.
template <int G, int MT, bool PF = true>
inline void packed_block(const bf16* x, int64_t ldx, const bf16* wp, int64_t Kh, int64_t nb0, const float* bias,
                         bf16* out, int64_t ldo) {
  int64_t nb[G];
  for (int g = 0; g < G; ++g) nb[g] = nb0 + g;
  packed_blocks<G, MT, PF>(x, ldx, wp, Kh, nb, bias, out, ldo);
}

// How a core streams the column blocks of one call at M <= 4: a property of the CPU's memory system, not of the
// numbers (each block is one accumulation chain over k whatever the grouping, so both give bitwise the same
// outputs). Measured on the whole 24-layer step's matrices, 2 threads, M = 1 (benchmarks/decode_profile.py):
//   MANY: 8 block streams at a time, each prefetched 2 KiB ahead: what was tuned, and fastest, on a Xeon
//         (AVX-512F, 2 vCPUs), whose hardware prefetcher ramps up late on each of 97 short matrices a token.
//   ONE:  one block after another (one sequential 28 KiB stream at K = 896), no software prefetch. Zen 4: 14.3 ms
//         a token against 20.7 ms for MANY (50 against 35 GB/s); its L2 prefetcher follows one stream best and a
//         software prefetch only competes with it (quant_gemv.h found the same for the block-quantized formats).
// Picked at start-up by timing both (engine/kernels/streaming.py); MANY until then.
enum class Streams : int { MANY = 8, ONE = 1 };
inline std::atomic<int> streams{static_cast<int>(Streams::MANY)};
inline bool one_stream() { return streams.load(std::memory_order_relaxed) == static_cast<int>(Streams::ONE); }

// MT <= 4 x rows, column blocks [b0, b1), each weight line read once. MANY: 8 block streams at a time keep more
// DRAM requests in flight per core (4 from 3 rows on, where 8 x MT accumulators would not fit the 32 registers),
// then 4, then 1, so an equal split of blocks between threads stays equal (whole groups of 8 would leave one of 2
// threads a group short on the 56-block o_proj/down matrices, ~14 % of their time).
template <int MT>
inline void packed_range(const bf16* x, int64_t ldx, const bf16* wp, int64_t Kh, int64_t b0, int64_t b1,
                         const float* bias, bf16* out, int64_t ldo) {
  int64_t nb = b0;
  if (one_stream()) {
    for (; nb < b1; ++nb) packed_block<1, MT, false>(x, ldx, wp, Kh, nb, bias, out, ldo);
    return;
  }
  if constexpr (MT <= 2)
    for (; nb + 8 <= b1; nb += 8) packed_block<8, MT>(x, ldx, wp, Kh, nb, bias, out, ldo);
  for (; nb + 4 <= b1; nb += 4) packed_block<4, MT>(x, ldx, wp, Kh, nb, bias, out, ldo);
  for (; nb < b1; ++nb) packed_block<1, MT>(x, ldx, wp, Kh, nb, bias, out, ldo);
}

// Runs f(std::integral_constant<int, MT>{}) for the row count M = 1..MAX (MAX for any other M), so a kernel templated
// on MT is picked once per call from a runtime M.
template <int MAX = 4, int MT = 1, class F>
inline void with_rows(int64_t M, F&& f) {
  if constexpr (MT < MAX) {
    if (M != MT) return with_rows<MAX, MT + 1>(M, f);
  }
  f(std::integral_constant<int, MT>{});
}

// packed_range for a runtime M <= 4.
inline void packed_rows(int64_t M, const bf16* x, int64_t ldx, const bf16* wp, int64_t Kh, int64_t b0, int64_t b1,
                        const float* bias, bf16* out, int64_t ldo) {
  with_rows(M, [&](auto mt) { packed_range<decltype(mt)::value>(x, ldx, wp, Kh, b0, b1, bias, out, ldo); });
}

}  // namespace gemv
}  // namespace deploykit
