// The walk over a quantized matrix's 16-row groups that both GEMVs share: each group through group<F, MT, Ahead>
// of the ISA's kernel (quant_gemv.h on AVX512-VNNI, quant_gemv_avx2.h on AVX2), split where parts of different
// formats meet, with the format and the row count made compile-time. Included at the end of each kernel header, after
// its group(), so the dispatch is written once.
#pragma once

#include <algorithm>
#include <cstdint>

#include "quant_act.h"
#include "quant_layout.h"
#include "quant_stream.h"

namespace deploykit {
namespace quant {

template <int F, int MT, bool Ahead, class Out>
inline void part_range(const Act* act, const Part& p, int64_t g0, int64_t g1, int64_t K, const float* bias, Out* out,
                       int64_t ldo) {
  for (int64_t g = g0; g < g1; ++g) group<F, MT, Ahead>(act, p, g, K, bias, out, ldo);
}

template <int MT, bool Ahead, class Out>
inline void part_rows(const Act* act, const Part& p, int64_t g0, int64_t g1, int64_t K, const float* bias, Out* out,
                      int64_t ldo) {
  with_format(p.format, [&](auto f) { part_range<decltype(f)::value, MT, Ahead>(act, p, g0, g1, K, bias, out, ldo); });
}

template <int MT, class Out>
inline void part_rows(bool ahead, const Act* act, const Part& p, int64_t g0, int64_t g1, int64_t K, const float* bias,
                      Out* out, int64_t ldo) {
  if (ahead)
    part_rows<MT, true>(act, p, g0, g1, K, bias, out, ldo);
  else
    part_rows<MT, false>(act, p, g0, g1, K, bias, out, ldo);
}

// out[m, 16 b0 .. 16 b1) for M <= 4 activation rows: the 16-row groups [b0, b1) of the whole matrix, split where
// parts of different formats meet. ahead: these rows are all the call has, so the weights stream once and ahead
// (stream_ahead); a tile of a wider call passes false.
template <class Out>
inline void rows(int64_t M, const Act* act, const Matrix& w, int64_t b0, int64_t b1, const float* bias, Out* out,
                 int64_t ldo, bool ahead = true) {
  for (int i = 0; i < w.nparts; ++i) {
    const Part& p = w.parts[i];
    const int64_t p0 = p.row0 / 16, p1 = p0 + p.rows / 16;
    const int64_t lo = std::max(b0, p0), hi = std::min(b1, p1);
    if (lo >= hi) continue;
    switch (M) {
      case 1: part_rows<1>(ahead, act, p, lo - p0, hi - p0, w.K, bias, out, ldo); break;
      case 2: part_rows<2>(ahead, act, p, lo - p0, hi - p0, w.K, bias, out, ldo); break;
      case 3: part_rows<3>(ahead, act, p, lo - p0, hi - p0, w.K, bias, out, ldo); break;
      default: part_rows<4>(ahead, act, p, lo - p0, hi - p0, w.K, bias, out, ldo); break;
    }
  }
}

// out[m, 16 j .. 16 j + 16) and out[m, 16 (J + j) .. 16 (J + j) + 16) for j in [j0, j1) and M <= 4 rows of an
// interleaved matrix (quant_layout.h: two parts of J groups): group j of part 0 then group j of part 1, the next
// group in memory, so the weights stream as one run; the format and M made compile-time once for the run.
template <class Out>
inline void interleaved_rows(int64_t M, const Act* act, const Matrix& w, int64_t j0, int64_t j1, const float* bias,
                             Out* out, int64_t ldo) {
  with_format(w.parts[0].format, [&](auto f) {
    constexpr int F = decltype(f)::value;
    const auto run = [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
      for (int64_t j = j0; j < j1; ++j) {
        group<F, MT, true>(act, w.parts[0], j, w.K, bias, out, ldo);
        group<F, MT, true>(act, w.parts[1], j, w.K, bias, out, ldo);
      }
    };
    switch (M) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{}); break;
    }
  });
}

// The same for any M: more than 4 rows go in tiles of 4 over a pair of groups at a time, so the pair's weights are
// read from memory once and from L1/L2 for the later tiles. The first tile streams the pair ahead where requested
// lines go to L2 (quant_stream.h), where the later tiles find them too; non-temporal ones would be gone. Every row
// gets the bits rows() gives it alone (its int32 sums are exact, its fp32 steps its own). quant_linear's many-row
// path and the fused decode step's 5-16 rows run this.
template <class Out>
inline void tiled_rows(int64_t M, const Act* act, const Matrix& w, int64_t b0, int64_t b1, const float* bias,
                       Out* out, int64_t ldo) {
  if (M <= 4) {
    rows(M, act, w, b0, b1, bias, out, ldo);
    return;
  }
  const bool l2 = stream_ahead.hint.load(std::memory_order_relaxed) == Hint::L2;
  for (int64_t b = b0; b < b1; b += 2) {
    const int64_t e = std::min(b + 2, b1);
    for (int64_t m = 0; m < M; m += 4)
      rows(std::min<int64_t>(4, M - m), act + m, w, b, e, bias, out + m * ldo, ldo, l2 && m == 0);
  }
}

}  // namespace quant
}  // namespace deploykit
