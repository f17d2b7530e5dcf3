// The AMX-BF16 tile loop shared by the packed (amx_bf16.cpp) and compact (compact_amx.h) weight paths.
//
// Tiles: C 0..3 (MB x NB of 16x16 fp32: 16-row half h of A times column block j at 2h + j), A 4..5 (the two
// 16-row halves of a 32-row M block), B 6..7 (k-tile of column block 0 and 1: 16 k-pairs x 16 columns, 1 KiB).
// K is cut into segments of segment(Kh) k-pairs, a function of K alone. Each segment's C tiles start at zero and sum
// its k-tiles, in order, with tdpbf16ps on each row alone; the segments' fp32 sums are then added in order
// (acc = s0, acc += s1, ..., out = (acc + s_last) + bias). No other row of A enters a row, so a row's result does not
// depend on how many rows share the call, how its tiles were configured, or whether a call ran all of K or k-slices
// of whole segments (the prefill, amx_slices.h).
//
// Why segments: a prefill reuses a column-block pair's B tiles for every 32-row block of a chunk. Whole K, the pair
// is 56 KiB at K = 896, more than the 48 KiB L1 of these CPUs, so B and A tiles both came from L2 (4 KiB per 4
// tdpbf16ps, about 64 bytes a cycle, over what L2 feeds). A segment's pair (at most 28 KiB) stays in L1 while A
// streams from L2 past it (tileloaddt1, ATiles::stream). oneDNN's AMX matmul splits K the same way (benchmarks/
// README.md, "Where oneDNN's 3.5-3.7 TFLOP/s comes from"); starting each segment at zero, rather than reloading the
// sums into the tiles, keeps the tile unit from waiting on its own stores.
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "vec.h"

namespace deploykit {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

bool amx_init();                                 // amx_bf16.cpp: the OS grants tile state (Linux >= 5.16)
void amx_configure_tiles(int rows0, int rows1);  // amx_bf16.cpp: rows of A's halves; every tile 64 bytes wide
at::Tensor amx_block_x(const at::Tensor& x);     // amx_bf16.cpp: x [M, K] -> zero-padded blocked A tiles

namespace amx {

using bf16 = at::BFloat16;

// Loads this thread's tile shapes: tile t has rows[t] rows of colsb[t] bytes (0 and 0: unused).
inline void configure(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  struct alignas(64) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = rows[t];
    cfg.colsb[t] = colsb[t];
  }
  // GCC 12's _tile_loadconfig declares an 8-byte memory operand, letting the compiler drop the
  // stores to the rest of cfg; this operand covers all 64 bytes.
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

// The tiles of this thread configured for M <= 32 rows of A (two 16-row halves) for its lifetime.
struct Tiles {
  explicit Tiles(int64_t M) { amx_configure_tiles((int)std::min<int64_t>(M, 16), (int)std::max<int64_t>(M - 16, 0)); }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// Where the A tiles of one M block live: tile k-step s of half h starts at base + h * half + s * step (elements)
// with rows `ld` bytes apart. stream: loaded with tileloaddt1 (a prefill's blocked x or panels, read once per pair
// from L2: it should not push the pair's B tiles out of L1); else tileloadd (a few rows read in place, again for
// every pair).
struct ATiles {
  const bf16* base;
  int64_t step, half, ld;
  bool stream = false;
};

// Plain x [M, K]: tiles are read in place with the activation's row stride.
inline ATiles plain_a(const bf16* x, int64_t ldx) { return {x, 32, 16 * ldx, ldx * (int64_t)sizeof(bf16)}; }

// Whether blocked x and panels stream (ATiles::stream): runtime-settable to measure it (set_amx_prompt_tiles,
// compact_amx.cpp).
inline std::atomic<bool> stream_a{true};

// Blocked x [M/16, K/32, 16, 32]: every tile is one contiguous 1 KiB block.
inline ATiles blocked_a(const bf16* xb, int64_t Kh, int64_t mb32) {
  const int64_t per_half = (Kh / 16) * 512;
  return {xb + mb32 * 2 * per_half, 512, per_half, 64, stream_a.load(std::memory_order_relaxed)};
}

// Panels of x: K/32 panels [rows_pad][32] (rows_pad: the rows rounded up to whole 32-row blocks, the rest zeros),
// panel q holding columns 32 q .. 32 q + 31. Every tile is a contiguous 1 KiB block, as in blocked x; a prompt's
// gate_up with SiLU writes its output this way (col_of) for the down projection to read without a copy (amx_slices.h).
inline ATiles panel_a(const bf16* xp, int64_t rows_pad, int64_t mb32) {
  return {xp + mb32 * 32 * 32, rows_pad * 32, 512, 64, stream_a.load(std::memory_order_relaxed)};
}

// Where an output row's column block nb (16 columns) starts: at 16 nb in a plain row, or, with panel (the elements
// of one panel, rows_pad * 32; 0: plain rows), in panel nb / 2 at column 16 (nb % 2). Rows are `ldo` apart in both
// (a panel's: 32).
inline int64_t col_of(int64_t nb, int64_t panel) { return panel ? (nb >> 1) * panel + (nb & 1) * 16 : nb * 16; }

// k-pairs a slice, for Kh k-pairs cut into equal slices of at most `most` (whole k-tiles of 16).
inline int64_t slice_of(int64_t Kh, int64_t most) {
  const int64_t n = (Kh + most - 1) / most;
  return ((Kh + n - 1) / n + 15) / 16 * 16;
}

// The k-pairs of a segment (above) for Kh k-pairs: at most SEGMENT_MAX (a pair's two blocks, 2 x 224 x 64 bytes =
// 28 KiB, leave L1 room for the A tiles passing through and the epilogue's sums), cut equal.
constexpr int64_t SEGMENT_MAX = 224;
inline int64_t segment(int64_t Kh) { return slice_of(Kh, SEGMENT_MAX); }

// From this many rows on (prefill), x is copied once into tile blocks (M*K*2 bytes, small next to M*N*K MACs):
// strided A tiles would touch 16 pages each. Fewer rows are read in place.
constexpr int64_t BLOCK_X_MIN_M = 64;

// Weight tiles are requested this far ahead of their tileloadd: a tile load that misses to DRAM stalls the AMX
// pipe, and the hardware prefetcher restarts at every column block.
constexpr int64_t PREFETCH_BYTES = 4096;

// B tiles read in place from packed [K/2, 16, 2] blocks (gemv.h), at w0 and w1. PF: request them ahead (off for a
// buffer that was just decoded into L1, and for a prompt's packed weights, which amx::Ahead requests into L2).
template <bool PF = true>
struct PackedB {
  const bf16* w0;
  const bf16* w1;
  template <int NB>
  [[gnu::always_inline]] inline void load(int64_t kp) {
    if constexpr (PF) {
      const char* p0 = reinterpret_cast<const char*>(w0 + kp * 32) + PREFETCH_BYTES;
      for (int l = 0; l < 16; ++l) _mm_prefetch(p0 + l * 64, _MM_HINT_T0);
    }
    if constexpr (PF && NB > 1) {
      const char* p1 = reinterpret_cast<const char*>(w1 + kp * 32) + PREFETCH_BYTES;
      for (int l = 0; l < 16; ++l) _mm_prefetch(p1 + l * 64, _MM_HINT_T0);
    }
    _tile_loadd(6, w0 + kp * 32, 64);
    if constexpr (NB > 1) _tile_loadd(7, w1 + kp * 32, 64);
  }
};

// out[h * 16 + r, 16 nb[j] + c] for MB 16-row halves of A (rows0, rows1 valid rows) and NB column blocks whose
// k-tiles `b` loads (b.load<NB>(kp) fills B tiles 6 and 7 with k-pairs kp .. kp + 15), over Kh k-pairs.
// partial (or nullptr: all of K at once): this call is the k-slice [k0, k0 + Kh) of K (whole segments of `seg`
// k-pairs); acc holds the fp32 sum of the segments before it (unless first) and takes this slice's (unless last,
// which writes the output instead).
struct Partial {
  float* acc;  // [4][16 * 16], 64-byte aligned
  bool first, last;
  int64_t k0, seg;
  bool own_lines = false;  // a plain epilogue's output lines requested for ownership ahead (tile_block)
};

// Whether a prompt's plain epilogues request their output lines ahead (Partial::own_lines): runtime-settable to
// measure it (set_amx_prompt_tiles, compact_amx.cpp).
inline std::atomic<bool> own_lines{true};

// The MB x NB C tiles into dst [4][16 * 16] (tile t at dst + 256 t).
template <int MB, int NB>
[[gnu::always_inline]] inline void store_tiles(float* dst) {
  _tile_stored(0, dst, 64);
  if constexpr (NB > 1) _tile_stored(1, dst + 256, 64);
  if constexpr (MB > 1) {
    _tile_stored(2, dst + 512, 64);
    if constexpr (NB > 1) _tile_stored(3, dst + 768, 64);
  }
}

// The C tiles' sums over the segment just ended into acc (first: acc had none yet), and the tiles zeroed for the
// next segment.
template <int MB, int NB>
[[gnu::always_inline]] inline void add_segment(float* acc, bool first, bool zero) {
  if (first) {
    store_tiles<MB, NB>(acc);
  } else {
    alignas(64) float s[4 * 256];
    store_tiles<MB, NB>(s);
    for (int t = 0; t < 4; ++t) {
      if ((t & 1) >= NB || (t >> 1) >= MB) continue;
      for (int i = t * 256; i < t * 256 + 256; i += 16)
        _mm512_store_ps(acc + i, _mm512_add_ps(_mm512_load_ps(acc + i), _mm512_load_ps(s + i)));
    }
  }
  if (zero) {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (MB > 1) {
      _tile_zero(2);
      if constexpr (NB > 1) _tile_zero(3);
    }
  }
}

// v rounded to bf16 and widened back, bit for bit what storing it as bf16 and loading it gives.
inline __m512 bf16_round(__m512 v) {
  return vec::widen((__m256i)_mm512_cvtneps_pbh(v));
}

// A row's 16 fp32 sums: the last segment's c plus, where K had more than one segment, the earlier ones' (a).
[[gnu::always_inline]] inline __m512 sums(const float* c, const float* a) {
  const __m512 v = _mm512_load_ps(c);
  return a ? _mm512_add_ps(_mm512_load_ps(a), v) : v;
}

// One row of a block's epilogue: its sums (c, a) plus the bias bv to bf16 at o; with silu, silu(gate) * up from the
// gate and up blocks' rows, each rounded to bf16 first, as a stored gate_up row is.
[[gnu::always_inline]] inline void epilogue_row(const float* c, const float* a, __m512 bv, bf16* o) {
  __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(sums(c, a), bv));
  std::memcpy(o, &v, sizeof(v));
}
[[gnu::always_inline]] inline void silu_row(const float* g, const float* ag, const float* u, const float* au,
                                            __m512 bg, __m512 bu, bf16* o) {
  vec::store16(o, vec::silu_mul(bf16_round(_mm512_add_ps(sums(g, ag), bg)),
                                bf16_round(_mm512_add_ps(sums(u, au), bu))));
}

// A block's SiLU epilogue, deferred: its C tiles wait in c while the next block's k-loop converts a few of its rows
// after each k-step, so that vector work (an exp and a reciprocal a value) runs beside the tile work instead of
// after it. Each row the same bits as at once.
struct Pending {
  alignas(64) float c[4][16 * 16];
  const float* acc = nullptr;  // the earlier segments' sums, [4][16 * 16] (nullptr: K was one segment)
  __m512 bg, bu;
  int rows[2] = {0, 0}, done = 0, units = 0, h = 0, r = 0;  // the next row: r of half h
  bf16* out = nullptr;
  int64_t ldo = 0;
  bool active() const { return done < units; }
  // Converts rows until `upto` of them are done.
  void run(int upto) {
    for (upto = std::min(upto, units); done < upto; ++done) {
      const float* ag = acc ? acc + h * 512 + r * 16 : nullptr;
      silu_row(c[h * 2] + r * 16, ag, c[h * 2 + 1] + r * 16, ag ? ag + 256 : nullptr, bg, bu, out + (h * 16 + r) * ldo);
      if (++r == rows[h]) r = 0, ++h;
    }
  }
  // C tiles 2 and 3 still hold this block's lower half (tile_block's `hold`): stored behind the next block's first
  // tile products, or here when something else needs the tiles first.
  bool held = false;
  void flush_held() {
    if (held) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      held = false;
    }
  }
  void finish() {
    flush_held();
    run(units);
  }
  // This block's rows (rows0, rows1 of two halves), its last segment's C tiles already in c and the earlier ones'
  // sums in a (or nullptr); nb: the gate and up blocks; o: the block's first row, rows `ld` apart, in panels of
  // `panel` elements where panel is not 0 (col_of). a must hold until the rows are out (the next block's k-loop).
  void set(int rows0, int rows1, const int64_t* nb, const float* bias, bf16* o, int64_t ld, const float* a,
           int64_t panel) {
    acc = a;
    bg = bias ? _mm512_loadu_ps(bias + nb[0] * 16) : _mm512_setzero_ps();
    bu = bias ? _mm512_loadu_ps(bias + nb[1] * 16) : _mm512_setzero_ps();
    rows[0] = rows0;
    rows[1] = rows1;
    out = o + col_of(nb[0], panel);
    ldo = ld;
    done = h = r = 0;
    units = rows0 + rows1;
  }
};

// The weights of the next decode (amx_slices.h decodes a pair's B once for many 32-row blocks), requested into L2 a
// few lines after each k-step of the tiles that run before it. Decoding them straight from memory left the tiles
// idle for its stalls: a build with no decode at all ran 512-row matmuls in 0.78-0.93 of the time. Requested all at
// once when the decode ended, presumably holding the core's line-fill buffers, they bought nothing (0.98-1.29). Spread
// over the k-steps, time with / without, in quiet minutes of an Emerald Rapids-class Xeon (benchmarks/README.md,
// session 40): gate_up at 512 rows 0.94-0.96 (compact bf16, Q4_0, Q4_K_M), the other shapes 0.94-1.04 (noise); a
// 512-token prefill 0.96 (compact bf16) and 0.97 (Q4_K_M).
struct Ahead {
  const char* p[2] = {nullptr, nullptr};  // up to two byte ranges [p, e): a pair's two column blocks
  const char* e[2] = {nullptr, nullptr};
  int per = 0;  // lines a k-step
  // Ranges that `steps` k-steps should request in all.
  void set(int n, const char* const* begin, const char* const* end, int64_t steps) {
    int64_t lines = 0;
    for (int j = 0; j < 2; ++j) {
      p[j] = j < n ? begin[j] : nullptr;
      e[j] = j < n ? end[j] : nullptr;
      lines += (e[j] - p[j] + 63) / 64;
    }
    per = (int)std::max<int64_t>(1, (lines + steps - 1) / std::max<int64_t>(steps, 1));
  }
  [[gnu::always_inline]] inline void step() {
    for (int i = 0; i < per; ++i) {
      const int j = p[0] < e[0] ? 0 : 1;
      if (p[j] >= e[j]) return;
      _mm_prefetch(p[j], _MM_HINT_T1);
      p[j] += 64;
    }
  }
};

// silu (NB == 2: nb[0] a gate block, nb[1] its up block): out[r, 16 nb[0] + c] = silu(gate) * up instead, computed
// from the two blocks' bf16 outputs exactly as silu_mul computes it from a stored gate_up row.
// pend (or nullptr; only with partial, whose acc outlives the call): a deferred SiLU epilogue (Pending), run a few
// rows a k-step; with silu, this block's then takes its place, else every epilogue runs at once. ahead (or nullptr):
// the next decode's weights, requested a few lines a k-step. panel (a SiLU epilogue only; 0: plain rows): out holds
// this block's rows in panels (col_of).
// With a deferred SiLU epilogue, a block's C tiles 2 and 3 stay in the tiles when its last segment ends and are stored
// in the next block's first k-step, after its products on tiles 0 and 1 (as oneDNN's AMX kernel interleaves its
// tile stores): 4 tile stores at the end of a block leave the tile unit idle while they drain.
template <int MB, int NB, class Source>
inline void tile_block(const ATiles& a, int rows0, int rows1, Source& b, int64_t Kh, const int64_t nb[NB],
                       const float* bias, bf16* out, int64_t ldo, const Partial* partial = nullptr, bool silu = false,
                       Pending* pend = nullptr, Ahead* ahead = nullptr, int64_t panel = 0) {
  if (!partial && pend) {  // a deferred epilogue would outlive `own` below: the previous block's rows go out now
    pend->finish();
    pend = nullptr;
  }
  const int64_t k0 = partial ? partial->k0 : 0, seg = partial ? partial->seg : segment(Kh);
  alignas(64) float own[4 * 256];  // all of K in this call: the earlier segments' sums
  float* acc = partial ? partial->acc : own;
  bool empty = !partial || partial->first;  // acc holds no segment yet
  const bool last = !partial || partial->last;
  const bool hold = MB > 1 && NB > 1 && silu && pend && last;
  if (pend && pend->held && !hold) pend->flush_held();
  bool held = pend && pend->held;  // the previous block's tiles 2 and 3, stored in this block's first k-step
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MB > 1) {
    if (!held) {
      _tile_zero(2);
      if constexpr (NB > 1) _tile_zero(3);
    }
  }
  const bf16* a0 = a.base;
  const int steps = (int)((Kh + 15) / 16);
  const int per = pend && pend->active() ? (pend->units - pend->done + steps - 1) / steps : 0;
  // A prompt block's plain epilogue (at once, below): its rows' output lines are requested for ownership a few a
  // k-step through K's last segment (from own_from in this call). Without it, its 32 rows' stores missed on lines not
  // yet owned while the tiles sat idle. Alternated in one process on an Emerald Rapids-class Xeon (benchmarks/
  // README.md, session 47), time with / without at 512 rows: qkv [1152, 896] 0.94-0.98 in 4 runs of 6, o_proj
  // [896, 896] 0.95-0.97, down [896, 4864] 0.99-1.00; the deferred SiLU rows gained nothing from it (1.01-1.04), nor
  // did a plain epilogue deferred like them.
  const int owned = partial && partial->own_lines && last && !(pend && silu) ? rows0 + (MB > 1 ? rows1 : 0) : 0;
  const int64_t own_from = owned ? (k0 + Kh - 1) / seg * seg - k0 : Kh;  // where K's last segment starts, in this call
  const int own_steps = (int)((Kh - own_from + 15) / 16);
  const int owned_per = owned ? (owned + own_steps - 1) / own_steps : 0;
  int own_row = 0;
  for (int64_t kp = 0; kp < Kh; kp += 16, a0 += a.step) {
    if (kp > 0 && (k0 + kp) % seg == 0) {  // a segment ends inside this call
      if (pend) pend->run(pend->units);    // its rows may read the acc about to be written
      add_segment<MB, NB>(acc, empty, true);
      empty = false;
    }
    if (a.stream) {
      _tile_stream_loadd(4, a0, a.ld);
      if constexpr (MB > 1) _tile_stream_loadd(5, a0 + a.half, a.ld);
    } else {
      _tile_loadd(4, a0, a.ld);
      if constexpr (MB > 1) _tile_loadd(5, a0 + a.half, a.ld);
    }
    b.template load<NB>(kp);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB > 1 && NB > 1) {
      if (held) {
        _tile_stored(2, pend->c[2], 64);
        _tile_stored(3, pend->c[3], 64);
        _tile_zero(2);
        _tile_zero(3);
        held = pend->held = false;
      }
    }
    if constexpr (MB > 1) {
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
    if (per) pend->run(pend->done + per);
    if (ahead) ahead->step();
    for (int i = 0; kp >= own_from && i < owned_per && own_row < owned; ++i, ++own_row) {
      const char* o = reinterpret_cast<const char*>(out + (own_row < rows0 ? own_row : 16 + own_row - rows0) * ldo +
                                                     col_of(nb[0], panel));
      asm volatile("prefetchw %0" ::"m"(*o));
      const char* e = o + NB * 32 - 1;  // the row's last byte of these blocks: in the next line where o is unaligned
      if ((reinterpret_cast<uintptr_t>(e) ^ reinterpret_cast<uintptr_t>(o)) >= 64)
        asm volatile("prefetchw %0" ::"m"(*e));
    }
  }
  if (!last) {
    if (pend) pend->run(pend->units);
    add_segment<MB, NB>(acc, empty, false);
    return;
  }
  const float* prev = empty ? nullptr : acc;  // the earlier segments' sums, [4][256]
  if constexpr (NB > 1) {
    if (pend && silu) {  // the previous block's rows are all out, and this block's C tiles take their place
      pend->finish();
      _tile_stored(0, pend->c[0], 64);
      _tile_stored(1, pend->c[1], 64);
      if constexpr (MB > 1) {
        if (!hold) {
          _tile_stored(2, pend->c[2], 64);
          _tile_stored(3, pend->c[3], 64);
        }
      }
      pend->set(rows0, MB > 1 ? rows1 : 0, nb, bias, out, ldo, prev, panel);
      pend->held = hold;
      return;
    }
  }
  if (pend) pend->finish();
  alignas(64) float c[4][16 * 16];  // [tile][row * 16 + col]
  store_tiles<MB, NB>(c[0]);
  auto at = [&](int t, int r) { return prev ? prev + t * 256 + r * 16 : nullptr; };
  if constexpr (NB > 1) {
    if (silu) {
      const __m512 bg = bias ? _mm512_loadu_ps(bias + nb[0] * 16) : _mm512_setzero_ps();
      const __m512 bu = bias ? _mm512_loadu_ps(bias + nb[1] * 16) : _mm512_setzero_ps();
      for (int h = 0; h < MB; ++h)
        for (int r = 0, rows = h == 0 ? rows0 : rows1; r < rows; ++r)
          silu_row(c[h * 2] + r * 16, at(h * 2, r), c[h * 2 + 1] + r * 16, at(h * 2 + 1, r), bg, bu,
                   out + (h * 16 + r) * ldo + col_of(nb[0], panel));
      return;
    }
  }
  for (int h = 0; h < MB; ++h) {
    const int rows = h == 0 ? rows0 : rows1;
    for (int j = 0; j < NB; ++j) {
      const float* ct = c[h * 2 + j];
      const __m512 bv = bias ? _mm512_loadu_ps(bias + nb[j] * 16) : _mm512_setzero_ps();
      for (int r = 0; r < rows; ++r)
        epilogue_row(ct + r * 16, at(h * 2 + j, r), bv, out + (h * 16 + r) * ldo + nb[j] * 16);
    }
  }
}

// tile_block for a runtime rows1 (0: one half) and block count (1 or 2).
template <class Source>
inline void tile_blocks(const ATiles& a, int rows0, int rows1, Source& b, int64_t Kh, const int64_t* nb, int n,
                        const float* bias, bf16* out, int64_t ldo, const Partial* partial = nullptr,
                        bool silu = false, Pending* pend = nullptr, Ahead* ahead = nullptr, int64_t panel = 0) {
  if (rows1 > 0) {
    if (n > 1) tile_block<2, 2>(a, rows0, rows1, b, Kh, nb, bias, out, ldo, partial, silu, pend, ahead, panel);
    else tile_block<2, 1>(a, rows0, rows1, b, Kh, nb, bias, out, ldo, partial, false, pend, ahead, panel);
  } else {
    if (n > 1) tile_block<1, 2>(a, rows0, 0, b, Kh, nb, bias, out, ldo, partial, silu, pend, ahead, panel);
    else tile_block<1, 1>(a, rows0, 0, b, Kh, nb, bias, out, ldo, partial, false, pend, ahead, panel);
  }
}

}  // namespace amx

#endif

}  // namespace deploykit
