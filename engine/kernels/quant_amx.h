// quant_linear's many-row path on AMX-INT8 tiles (Sapphire Rapids and later). Every 32-k unit's int32 dot products
// are the VNNI GEMV's (quant_gemv.h), summed by tdpbssd instead of vpdpbusd, and end in the same fp32 steps
// (quant_scale.h), so each row's output is bitwise what it gets alone: the row count only picks the kernel.
//
// Each unit of a 16-column group is decoded once into a B tile, 8 rows (k-groups) x 64 bytes (16 columns x 4 k):
// the packed line layout (quant_layout.h) with the codes made signed (Q8_0 c - 128, Q4_0 c - 8, Q5_0 c - 16, Q6_K
// c - 32; the others keep their unsigned codes, 0-31, whose offsets come in the fp32 steps). x's quantized rows
// (quant_act.h) are copied into A tiles, [16-row block][unit][16 rows][32 k]. Every unit has its own scales, so a C
// tile (16 rows x 16 columns of int32) holds one unit at a time: it is stored to L1 and folded into the 16 rows'
// fp32 sums, which stay in registers over K. Four C tiles take units in turn, so later units' tdpbssd and tile stores
// run under this one's fp32 steps (step() below). Q6_K's two 16-k halves have their own sub-scales: two C tiles a
// unit, from A tiles 16 bytes wide and B tiles of 4 rows (a second tile configuration).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "quant_act.h"
#include "quant_layout.h"
#include "runs.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#include "amx_tiles.h"
#include "quant_gemv.h"  // store16
#include "quant_scale.h"
#include "quant_stream.h"
#endif

namespace deploykit {
namespace quant_amx {

// Turned on at load where the CPU has AMX-INT8 and the OS grants tile state (engine/kernels/__init__.py).
inline std::atomic<bool> enabled{false};
// From this many rows on, an AMX-INT8 CPU runs the tiles, which give every row the same bits as the GEMV. The tiles
// always take 16 rows: measured on a 2-core Sapphire Rapids-class Xeon over the benchmark model's 4 shapes (Q4_0,
// Q8_0), their time / the GEMV's at 10 rows 1.13-1.29, 12 rows 1.06-1.11, 16 rows 0.82-0.98, 64 rows 0.59-0.65, 512
// rows 0.50-0.56 (Q4_K 0.49, Q6_K 0.54).
constexpr int64_t MIN_ROWS = 16;
// Whether quant_linear takes M rows on the tiles (the fused decode step asks the same of its 16).
inline bool takes(int64_t M) { return M >= MIN_ROWS && enabled.load(std::memory_order_relaxed); }

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)

// GCC 12 warns inside its own _mm512_cvtph_ps / _mm512_cvtepi32_ps about an _mm512_undefined_* placeholder.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

using namespace quant;

constexpr int64_t TILE_BYTES = 512;  // one A tile (16 rows x 32 k) or one decoded unit (8 k-groups x 64 bytes)
// Rows of x per pass over the thread's columns: their A tiles and scales stay in L2 (2 MiB a core on every AMX CPU)
// while each group of decoded columns runs over them.
constexpr int64_t ROWS_BYTES = 1024 * 1024;
// Decoded columns per pass over those rows: at most this many bytes, in L2 beside them.
constexpr int64_t DECODED_BYTES = 256 * 1024;

// Unit u of the chunk at ch (one 16-row group's chunk) -> dst [8][64], signed.
template <int F>
[[gnu::always_inline]] inline void decode_unit(const uint8_t* ch, int u, int8_t* dst) {
  if constexpr (F == Q8_0) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int e = 0; e < 8; ++e)
      _mm512_store_si512(dst + 64 * e, _mm512_xor_si512(_mm512_loadu_si512(ch + u * 512 + 64 * e), flip));
  } else {
    constexpr int64_t unit_bytes = F == Q6_K ? 384 : 256;
    constexpr char zero = F == Q4_0 ? 8 : F == Q5_0 ? 16 : F == Q6_K ? 32 : 0;
    const __m512i low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    const __m512i z = _mm512_set1_epi8(zero);
    const bool gfni = fifth_bit(F) && fifth_gfni.load(std::memory_order_relaxed);  // only the 5-bit formats read it
    const uint8_t* lines = ch + u * unit_bytes;
    for (int l = 0; l < 4; ++l) {  // line l: k-group l in the low nibbles, l + 4 in the high ones
      const __m512i v = _mm512_loadu_si512(lines + l * 64);
      __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      if constexpr (fifth_bit(F)) {  // as quant_gemv.h (every AMX CPU has GFNI; the switch is for the tests)
        const __m512i bline = _mm512_loadu_si512(ch + fifth_at(F) + u * 64);
        if (gfni) {
          lo = or_fifth<true>(lo, bline, l);
          hi = or_fifth<true>(hi, bline, l + 4);
        } else {
          lo = or_fifth<false>(lo, bline, l);
          hi = or_fifth<false>(hi, bline, l + 4);
        }
      }
      if constexpr (F == Q6_K) {  // as quant_gemv.h: bits 2l..2l+1 of the two h-lines are the top 2 bits
        const __m512i h0 = _mm512_loadu_si512(lines + 256), h1 = _mm512_loadu_si512(lines + 320);
        const int s = 4 - 2 * l;
        const __m512i t0 = s >= 0 ? _mm512_slli_epi16(h0, s) : _mm512_srli_epi16(h0, -s);
        const __m512i t1 = s >= 0 ? _mm512_slli_epi16(h1, s) : _mm512_srli_epi16(h1, -s);
        lo = _mm512_or_si512(lo, _mm512_and_si512(t0, top2));
        hi = _mm512_or_si512(hi, _mm512_and_si512(t1, top2));
      }
      _mm512_store_si512(dst + 64 * l, _mm512_sub_epi8(lo, z));
      _mm512_store_si512(dst + 64 * (l + 4), _mm512_sub_epi8(hi, z));
    }
  }
}

// Group gl of part p -> dst [units][8][64], requesting the weights ahead of the decode as the GEMV does
// (quant_stream.h): the groups are read once, in order, between the tiles' work on the previous ones.
template <int F>
inline void decode_group(const Part& p, int64_t gl, int64_t K, int8_t* dst) {
  constexpr Info inf = info_of(F);
  const int64_t ahead = stream_ahead.bytes[F].load(std::memory_order_relaxed);
  const Hint hint = stream_ahead.hint.load(std::memory_order_relaxed);
  p.segments(gl, 0, K / (32 * inf.units), [&](const uint8_t* base, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int u = 0; u < inf.units; ++u) {
        if (ahead) request_ahead<F>(base + c * inf.chunk_bytes, u, ahead, hint);
        decode_unit<F>(base + c * inf.chunk_bytes, u, dst + (c * inf.units + u) * TILE_BYTES);
      }
  });
}

// Group g of part p, whose chunks hold its scales (Part::at: wherever its segments lie).
struct GroupRef {
  const Part* p;
  int64_t g;
  const uint8_t* chunk(int64_t c) const { return p->at(g, c); }
};

// Whole units: C 0..3 (16 x 16 int32), A 4..5 (16 rows x 32 k), B 6..7 (8 k-groups x 64 bytes). Halves (Q6_K):
// C 0..1, A 2..3 (16 rows x 16 k), B 4..5 (4 k-groups).
inline void configure(bool halves) {
  static constexpr uint8_t whole_rows[8] = {16, 16, 16, 16, 16, 16, 8, 8};
  static constexpr uint16_t whole_colsb[8] = {64, 64, 64, 64, 32, 32, 64, 64};
  static constexpr uint8_t half_rows[8] = {16, 16, 16, 16, 4, 4, 0, 0};
  static constexpr uint16_t half_colsb[8] = {64, 64, 16, 16, 64, 64, 0, 0};
  amx::configure(halves ? half_rows : whole_rows, halves ? half_colsb : whole_colsb);
}

// Unit u's dot products into C tile T (0-3) from A tile 4 + T % 2 (xa) and B tile 6 + T % 2 (the decoded group wd);
// store<T> writes C tile T out. (GCC's tile intrinsics paste their tile numbers into the instruction: literals only.)
#define DEPLOYKIT_DP(C, A, B)                   \
  do {                                          \
    _tile_zero(C);                              \
    _tile_loadd(A, xa + u * TILE_BYTES, 32);    \
    _tile_loadd(B, wd + u * TILE_BYTES, 64);    \
    _tile_dpbssd(C, A, B);                      \
  } while (0)
template <int T>
[[gnu::always_inline]] inline void issue(const int8_t* xa, const int8_t* wd, int64_t u) {
  if constexpr (T == 0) DEPLOYKIT_DP(0, 4, 6);
  else if constexpr (T == 1) DEPLOYKIT_DP(1, 5, 7);
  else if constexpr (T == 2) DEPLOYKIT_DP(2, 4, 6);
  else DEPLOYKIT_DP(3, 5, 7);
}
#undef DEPLOYKIT_DP

template <int T>
[[gnu::always_inline]] inline void store(int32_t* c) {
  if constexpr (T == 0) _tile_stored(0, c, 64);
  else if constexpr (T == 1) _tile_stored(1, c, 64);
  else if constexpr (T == 2) _tile_stored(2, c, 64);
  else _tile_stored(3, c, 64);
}

// The activation scalars of a 16-row block, one table per unit: [4][16] = dh, ms, d, d sum q of its 16 rows (the values
// ActScalars computes), so that the fold reads each as one broadcast from L1 rather than through the row's Act.
constexpr int64_t TABLE_FLOATS = 64;
struct TableScalars {
  const float* p;  // row r of unit u's table
  float dh() const { return p[0]; }
  float ms() const { return p[16]; }
  float d() const { return p[32]; }
  float dsum() const { return p[48]; }
};

inline void fill_table(const Act* act, int64_t units, float* tab) {
  for (int64_t u = 0; u < units; ++u)
    for (int r = 0; r < 16; ++r) {
      const ActScalars x{act[r], u};
      float* t = tab + u * TABLE_FLOATS + r;
      t[0] = x.dh();
      t[16] = x.ms();
      t[32] = x.d();
      t[48] = x.dsum();
    }
}

// accf[r] + unit u's term for the 16 rows, from its int32 dots ca (and cb, Q6_K's second halves) [16 rows][16].
// Every index of accf is a constant (a pack expansion, not a loop), so the 16 sums stay in registers; a runtime index
// anywhere kept them on the stack, stored and reloaded around every tile instruction (a "memory" asm), at 2.5x the
// time.
template <int F, size_t... R>
[[gnu::always_inline]] inline void fold(__m512 (&accf)[16], const GroupRef& gbase, int64_t u, const int32_t* ca,
                                        const int32_t* cb, const float* tab, std::index_sequence<R...>) {
  constexpr Info inf = info_of(F);
  const UnitScale<F> s(gbase.chunk(u / inf.units), (int)(u % inf.units));
  const auto tb = [&](int r) { return F == Q6_K ? _mm512_load_si512(cb + 16 * r) : _mm512_setzero_si512(); };
  const float* tu = tab + u * TABLE_FLOATS;
  ((accf[R] = s.apply(accf[R], _mm512_load_si512(ca + 16 * R), tb(R), TableScalars{tu + R})), ...);
}

template <size_t... R>
[[gnu::always_inline]] inline void accf_zero(__m512 (&accf)[16], std::index_sequence<R...>) {
  ((accf[R] = _mm512_setzero_ps()), ...);
}

template <class Out, size_t... R>
[[gnu::always_inline]] inline void store_rows(const __m512 (&accf)[16], __m512 b, int rows, Out* out, int64_t ldo,
                                              std::index_sequence<R...>) {
  ((R < (size_t)rows ? store16(out + R * ldo, _mm512_add_ps(accf[R], b)) : void()), ...);
}

// Step v of a block's unit loop (T = v % 4): unit v + 1's sums (tdpbssd issued two steps ago) are stored, unit v + 3's
// tdpbssd is issued, and unit v, stored a step ago, is folded. Each tdpbssd has two folds' time to finish before its
// store waits on it, and each store one fold's time to reach L1 before the vector loads read it (a tile store does not
// forward to them). With one step between issue and store, the stores stalled on the tdpbssd about half the time.
template <int F, int T>
[[gnu::always_inline]] inline void step(__m512 (&accf)[16], const int8_t* xa, const int8_t* wd, const GroupRef& gbase,
                                        int64_t v, int64_t units, int32_t (&c)[2][256], const float* tab) {
  if (v + 1 < units) store<(T + 1) % 4>(c[(T + 1) % 2]);
  if (v + 3 < units) issue<(T + 3) % 4>(xa, wd, v + 3);
  fold<F>(accf, gbase, v, c[T % 2], nullptr, tab, std::make_index_sequence<16>());
}

// out[r, col .. col + 16) for the `rows` valid rows of one 16-row block: xa its A tiles [units][16][32] and tab its
// scalar tables (zero past `rows`), wd one decoded group [units][8][64] whose scales are in its packed chunks at gbase.
template <int F, class Out>
inline void block(const int8_t* xa, const float* tab, const int8_t* wd, const GroupRef& gbase, int64_t units, int rows,
                  const float* bias, Out* out, int64_t ldo, int64_t col) {
  constexpr auto rows16 = std::make_index_sequence<16>();
  __m512 accf[16];  // the rows' fp32 sums over K, in registers
  accf_zero(accf, rows16);
  alignas(64) int32_t c[2][256];
  if constexpr (F == Q6_K) {
    for (int64_t u = 0; u < units; ++u) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, xa + u * TILE_BYTES, 32);
      _tile_loadd(3, xa + u * TILE_BYTES + 16, 32);
      _tile_loadd(4, wd + u * TILE_BYTES, 64);
      _tile_loadd(5, wd + u * TILE_BYTES + 256, 64);
      _tile_dpbssd(0, 2, 4);
      _tile_dpbssd(1, 3, 5);
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      fold<F>(accf, gbase, u, c[0], c[1], tab, rows16);
    }
  } else {
    issue<0>(xa, wd, 0);
    if (units > 1) issue<1>(xa, wd, 1);
    if (units > 2) issue<2>(xa, wd, 2);
    store<0>(c[0]);
    for (int64_t u = 0; u < units; u += 4) {
      step<F, 0>(accf, xa, wd, gbase, u, units, c, tab);
      if (u + 1 < units) step<F, 1>(accf, xa, wd, gbase, u + 1, units, c, tab);
      if (u + 2 < units) step<F, 2>(accf, xa, wd, gbase, u + 2, units, c, tab);
      if (u + 3 < units) step<F, 3>(accf, xa, wd, gbase, u + 3, units, c, tab);
    }
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
  store_rows(accf, b, rows, out + col, ldo, rows16);
}

// 16-row block b of the quantized rows acts[16 b ..] as A tiles [units][16 rows][32 k] at xa and its scalar tables
// at tab (rows past the caller's padded with zero rows).
inline void pack_block(const Act* acts, int64_t units, int8_t* xa, float* tab) {
  for (int64_t u = 0; u < units; ++u)
    for (int r = 0; r < 16; ++r) std::memcpy(xa + u * TILE_BYTES + r * 32, acts[r].q + u * 32, 32);
  fill_table(acts, units, tab);
}

// Decoded groups per pass over the rows, and so the groups a decode buffer holds.
inline int64_t per_pass(int64_t K) { return std::clamp<int64_t>(DECODED_BYTES / (16 * K), 1, 16); }

// out[:, 16 g0 .. 16 g1) (row stride ldo) for M rows packed by pack_block (xa, tabs: every 16-row block, in order)
// times w's 16-column groups [g0, g1), on this thread. dec: room for per_pass(K) decoded groups.
template <class Out>
void groups(const int8_t* xa, const float* tabs, int64_t M, const Matrix& w, int64_t g0, int64_t g1,
            const float* bias, Out* out, int64_t ldo, int8_t* dec) {
  const int64_t K = w.K, units = K / 32, blocks = (M + 15) / 16;
  const int64_t chunk_blocks = std::max<int64_t>(1, ROWS_BYTES / (16 * K * 9 / 8)), pass = per_pass(K);
  int config = -1;  // 0: whole units, 1: halves
  for (int64_t c0 = 0; c0 < blocks; c0 += chunk_blocks)
    for (int64_t gc = g0; gc < g1; gc += pass) {
      const int64_t ge = std::min(g1, gc + pass);
      for (int64_t g = gc; g < ge; ++g) {
        const Part& p = part_of(w, g);
        int8_t* dst = dec + (g - gc) * units * TILE_BYTES;
        with_format(p.format, [&](auto f) { decode_group<decltype(f)::value>(p, g - p.row0 / 16, K, dst); });
      }
      for (int64_t b = c0; b < std::min(blocks, c0 + chunk_blocks); ++b)
        for (int64_t g = gc; g < ge; ++g) {
          const Part& p = part_of(w, g);
          const int want = p.format == Q6_K;
          if (want != config) {
            config = want;
            configure(want);
          }
          const GroupRef gbase{&p, g - p.row0 / 16};
          const int rows = (int)std::min<int64_t>(16, M - 16 * b);
          const int8_t* xb = xa + b * units * TILE_BYTES;
          const float* tb = tabs + b * units * TABLE_FLOATS;
          const int8_t* wd = dec + (g - gc) * units * TILE_BYTES;
          with_format(p.format, [&](auto f) {
            block<decltype(f)::value>(xb, tb, wd, gbase, units, rows, bias, out + 16 * b * ldo, ldo, 16 * g);
          });
        }
    }
  if (config >= 0) _tile_release();
}

// out [M, N] for M quantized rows of x (acts: rows padded with zero rows to whole 16-row blocks) times w.
template <class Out>
void linear(const Act* acts, int64_t M, const Matrix& w, const float* bias, Out* out) {
  const int64_t K = w.K, NG = w.N / 16, units = K / 32, blocks = (M + 15) / 16;
  // A tiles: [block][unit][16 rows][32 k], one copy of the quantized rows (M K bytes).
  int8_t* xa = static_cast<int8_t*>(std::aligned_alloc(64, blocks * units * TILE_BYTES));
  float* tabs = static_cast<float*>(std::aligned_alloc(64, blocks * units * TABLE_FLOATS * sizeof(float)));
  TORCH_CHECK(xa && tabs, "quant_linear: out of memory for the activation tiles");
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      pack_block(acts + 16 * b, units, xa + b * units * TILE_BYTES, tabs + b * units * TABLE_FLOATS);
  });
  // The 16-column groups go to the threads in runs of at least a decode pass as they come free (runs.h tile_pairs).
  // Runs are counted in groups, not whole passes: a run's last pass may be short (its rows' A tiles, in L2, read once
  // more), but whole passes would split a matrix of 4-5 passes (K = 896: 16 groups a pass) 3 to 2 at best. A Q4_0
  // [9728, 896] on an Emerald Rapids-class Xeon (benchmarks/README.md, session 44), alternated in one process, time
  // fixed shares / runs: 32 rows 1.00-1.09, 64 rows 1.20-1.22; with one CPU 30 % busy 1.13-1.15 and 1.08-1.28.
  const int nt = (int)std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(NG, 1));
  Runs runs;
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    int8_t* dec = static_cast<int8_t*>(std::aligned_alloc(64, per_pass(K) * units * TILE_BYTES));
    TORCH_CHECK(dec, "quant_linear: out of memory for a decode buffer");
    tile_pairs(runs, NG, t0, t1, nt, per_pass(K),
               [&](int64_t g0, int64_t g1) { groups(xa, tabs, M, w, g0, g1, bias, out, w.N, dec); });
    std::free(dec);
  });
  std::free(xa);
  std::free(tabs);
}

// One thread's room for 16 rows on the tiles inside the fused decode step (decode_step.cpp), sized up front: their A
// tiles and tables, and the decode buffer.
struct Rows16 {
  std::unique_ptr<int8_t[]> xa, dec;  // not zeroed: every byte is written before it is read
  std::unique_ptr<float[]> tabs;
  void reserve(int64_t K) {  // K: the longest of the step's matrices
    xa.reset(new int8_t[K / 32 * TILE_BYTES + 64]);
    dec.reset(new int8_t[std::max<int64_t>(DECODED_BYTES, 16 * K) + 64]);  // per_pass(k) groups of 16 k bytes, k <= K
    tabs.reset(new float[K / 32 * TABLE_FLOATS]);
  }
  // The 16 rows a (quantized, K wide) packed for the tiles, for the groups_of calls that follow.
  void pack(const Act* a, int64_t K) { pack_block(a, K / 32, align(xa.get()), tabs.get()); }
  // y[:, 16 g0 .. 16 g1) = the packed rows times w's groups [g0, g1): what linear() gives them.
  template <class Out>
  void groups_of(const Matrix& w, int64_t g0, int64_t g1, const float* bias, Out* y, int64_t ldy) {
    groups(align(xa.get()), tabs.get(), 16, w, g0, g1, bias, y, ldy, align(dec.get()));
  }
  static int8_t* align(int8_t* p) {
    return reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  }
};

#pragma GCC diagnostic pop

#else  // builds without AMX-INT8: `enabled` stays off and this is never called

template <class Out>
void linear(const quant::Act*, int64_t, const quant::Matrix&, const float*, Out*) {
  TORCH_CHECK(false, "this kernel library was built without AMX-INT8");
}

struct Rows16 {
  void reserve(int64_t) {}
  void pack(const quant::Act*, int64_t) { TORCH_CHECK(false, "this kernel library was built without AMX-INT8"); }
  template <class Out>
  void groups_of(const quant::Matrix&, int64_t, int64_t, const float*, Out*, int64_t) {
    TORCH_CHECK(false, "this kernel library was built without AMX-INT8");
  }
};

#endif

}  // namespace quant_amx
}  // namespace deploykit
