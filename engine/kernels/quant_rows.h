// The walk over a quantized matrix's 16-row groups that both GEMVs share: each group, or each whole panel of a
// segmented part (quant_layout.h), through span<F, MT, Ahead> and finish() of the ISA's kernel (quant_gemv.h on
// AVX512-VNNI, quant_gemv_avx2.h on AVX2), split where parts of different formats meet, with the format and the row
// count made compile-time. Included at the end of each kernel header, after its span(), so the walk is written once.
#pragma once

#include <algorithm>
#include <cstdint>

#include "quant_act.h"
#include "quant_layout.h"
#include "quant_stream.h"

namespace deploykit {
namespace quant {

// out[m, 16 gl .. 16 gl + 16) of part p for MT activation rows: one 16-row group, segment by segment.
template <int F, int MT, bool Ahead, class Out>
inline void group(const Act* act, const Part& p, int64_t gl, const float* bias, Out* out, int64_t ldo) {
  Sums<MT> sums;
  for (int64_t c0 = 0; c0 < p.chunks; c0 += p.seg) {  // Part::segments, written out so that span() inlines here
    const int64_t c1 = std::min(p.chunks, c0 + p.seg);
    span<F, MT, Ahead>(act, p.at(gl, c0) - c0 * p.chunk_bytes, c0, c1, sums);
  }
  finish(sums, p, gl, bias, out, ldo);
}

// Slots p0 + [i0, i1) of a segmented panel of gp slots from slot p0 (parts[s % ways] holds slot s, as its group
// s / ways), in the order they lie: segment 0 of each slot's group, then segment 1 of each, ... The activations of one
// segment stay in L1 across the panel, where a whole group (43 KiB of Q4_0 at K = 4864) pushed them out before the
// next group used them again; a whole panel is one sequential stream (part of one skips the other slots' pieces).
// Each group's units are summed in the same order as group() sums them.
template <int F, int MT, bool Ahead, class Out>
inline void panel(const Act* act, const Part* const* parts, int64_t p0, int64_t gp, int64_t i0, int64_t i1,
                  const float* bias, Out* out, int64_t ldo) {
  const Part& q = *parts[0];
  Sums<MT> sums[MAX_PANEL];
  const uint8_t* seg = q.slots + p0 * q.group_bytes;  // the panel's current segment
  for (int64_t c0 = 0; c0 < q.chunks; c0 += q.seg) {
    const int64_t len = std::min(q.seg, q.chunks - c0), piece = len * q.chunk_bytes;
    for (int64_t i = i0; i < i1; ++i)
      span<F, MT, Ahead>(act, seg + i * piece - c0 * q.chunk_bytes, c0, c0 + len, sums[i - i0]);
    seg += gp * piece;
  }
  for (int64_t i = i0; i < i1; ++i)
    finish(sums[i - i0], *parts[(p0 + i) % q.ways], (p0 + i) / q.ways, bias, out, ldo);
}

// Slots [s0, s1) of the slot array parts[0..ways) share (quant_layout.h): panel by panel where it is segmented, else
// slot by slot through group().
template <int F, int MT, bool Ahead, class Out>
inline void slot_range(const Act* act, const Part* const* parts, int64_t s0, int64_t s1, const float* bias, Out* out,
                       int64_t ldo) {
  const Part& q = *parts[0];
  if (!q.segmented()) {
    for (int64_t s = s0; s < s1; ++s) group<F, MT, Ahead>(act, *parts[s % q.ways], s / q.ways, bias, out, ldo);
    return;
  }
  for (int64_t s = s0; s < s1;) {
    const int64_t p0 = s - s % q.panel, e = std::min(p0 + q.panel, q.nslots), stop = std::min(s1, e);
    panel<F, MT, Ahead>(act, parts, p0, e - p0, s - p0, stop - p0, bias, out, ldo);
    s = stop;
  }
}

template <int F, int MT, bool Ahead, class Out>
inline void part_range(const Act* act, const Part& p, int64_t g0, int64_t g1, const float* bias, Out* out,
                       int64_t ldo) {
  if (p.ways != 1) {  // one half of an interleaved matrix alone: its groups are every other slot
    for (int64_t g = g0; g < g1; ++g) group<F, MT, Ahead>(act, p, g, bias, out, ldo);
    return;
  }
  const Part* parts[1] = {&p};
  slot_range<F, MT, Ahead>(act, parts, g0, g1, bias, out, ldo);
}

template <int MT, bool Ahead, class Out>
inline void part_rows(const Act* act, const Part& p, int64_t g0, int64_t g1, const float* bias, Out* out,
                      int64_t ldo) {
  with_format(p.format, [&](auto f) { part_range<decltype(f)::value, MT, Ahead>(act, p, g0, g1, bias, out, ldo); });
}

template <int MT, class Out>
inline void part_rows(bool ahead, const Act* act, const Part& p, int64_t g0, int64_t g1, const float* bias, Out* out,
                      int64_t ldo) {
  if (ahead)
    part_rows<MT, true>(act, p, g0, g1, bias, out, ldo);
  else
    part_rows<MT, false>(act, p, g0, g1, bias, out, ldo);
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
      case 1: part_rows<1>(ahead, act, p, lo - p0, hi - p0, bias, out, ldo); break;
      case 2: part_rows<2>(ahead, act, p, lo - p0, hi - p0, bias, out, ldo); break;
      case 3: part_rows<3>(ahead, act, p, lo - p0, hi - p0, bias, out, ldo); break;
      default: part_rows<4>(ahead, act, p, lo - p0, hi - p0, bias, out, ldo); break;
    }
  }
}

// out[m, 16 j .. 16 j + 16) and out[m, 16 (J + j) .. 16 (J + j) + 16) for j in [j0, j1) and M <= 4 rows of an
// interleaved matrix (quant_layout.h: two parts of J groups): group j of part 0 then group j of part 1 (slots 2 j and
// 2 j + 1), the next group in memory, so the weights stream as one run; the format and M made compile-time once for
// the run. ahead: as rows() takes it (a tile of a wider call after the first passes false).
template <class Out>
inline void interleaved_rows(int64_t M, const Act* act, const Matrix& w, int64_t j0, int64_t j1, const float* bias,
                             Out* out, int64_t ldo, bool ahead = true) {
  const Part* parts[2] = {&w.parts[0], &w.parts[1]};
  with_format(w.parts[0].format, [&](auto f) {
    constexpr int F = decltype(f)::value;
    const auto run = [&](auto mt) {
      if (ahead)
        slot_range<F, decltype(mt)::value, true>(act, parts, 2 * j0, 2 * j1, bias, out, ldo);
      else
        slot_range<F, decltype(mt)::value, false>(act, parts, 2 * j0, 2 * j1, bias, out, ldo);
    };
    switch (M) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{}); break;
    }
  });
}

// The same for any M: more than 4 rows go in tiles of 4 over a pair of groups at a time (of an interleaved matrix:
// gate j and up j, interleaved_tiles), so the pair's weights are read from memory once and from L1/L2 for the later
// tiles. The first tile streams the pair ahead where requested lines go to L2 (quant_stream.h), where the later tiles
// find them too; non-temporal ones would be gone. Every row gets the bits rows() gives it alone (its int32 sums are
// exact, its fp32 steps its own). quant_linear's many-row path and the fused decode step's 5-16 rows run this.
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

template <class Out>
inline void interleaved_tiles(int64_t M, const Act* act, const Matrix& w, int64_t j0, int64_t j1, const float* bias,
                              Out* out, int64_t ldo) {
  if (M <= 4) {
    interleaved_rows(M, act, w, j0, j1, bias, out, ldo);
    return;
  }
  const bool l2 = stream_ahead.hint.load(std::memory_order_relaxed) == Hint::L2;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t m = 0; m < M; m += 4)
      interleaved_rows(std::min<int64_t>(4, M - m), act + m, w, j, j + 1, bias, out + m * ldo, ldo, l2 && m == 0);
}

}  // namespace quant
}  // namespace deploykit
