// A prompt's AMX-BF16 driver for every weight kind: x is copied into tile blocks (or comes as the panels a gate_up
// with SiLU wrote, XTiles below), and each pair of 16-column blocks gives its B tiles one segment of K at a time
// (amx_tiles.h), decoded to bf16 once (compact 12-bit, block-quantized) or read in place (packed), for every 32-row
// block of a chunk that stays in L2; a long K takes the k-slices outermost. A Source says how its blocks decode
// (compact_amx.cpp, quant_prompt_amx.cpp, amx_bf16.cpp); every way gives each row the same tdpbf16ps sequence and the
// same order of segment sums (amx_tiles.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <vector>

#include "amx_tiles.h"
#include "runs.h"

namespace deploykit {
namespace amx_slices {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

using bf16 = at::BFloat16;

// A prompt's x (past 32 rows; packed weights: from 64) is copied into tile blocks (or read as panels) and taken in
// chunks of 32-row blocks of at most CHUNK_BYTES, which stay in L2 (2 MiB a core on every AMX CPU so far) while each
// column-block pair of a thread's run goes over them.
constexpr int64_t CHUNK_BYTES = 1024 * 1024;
// Decoded once, a pair is decoded a k-slice at a time into a buffer, and every 32-row block of the chunk runs that
// slice's tiles on it. A slice is one segment of K (amx_tiles.h: at most 28 KiB of the pair's B tiles, which stay in
// L1 while the blocks' A tiles stream past from L2), its C tiles started at zero and their sums added in fp32 into the
// block's sums of the earlier segments. Before segments, a pair was decoded whole (56 KiB at K = 896, B tiles from L2)
// because slices that reloaded their partial sums into the tiles took 1.05-1.10x the time (session 38).
// slice_segments (runtime-settable, for measurements and the tests: bitwise the same either way): segments a slice,
// 0 for the whole K a slice (up to WHOLE_K k-pairs; k-outer slices of about KOUTER_SLICE).
inline std::atomic<int64_t> slice_segments{1};
constexpr int64_t WHOLE_K = 2048;
// A long K leaves too few 32-row blocks in a chunk that stays in L2 (K = 4864: 3) to decode a pair once for them, so
// every block decoded the pair again, from memory (a 512-token prefill's down projection at 1.3 TFLOP/s against 2.1
// for gate_up). There the k-slices go outermost instead: for each slice, every pair of a thread's run is decoded once
// and run on the slice of up to KOUTER_BLOCKS blocks (their A slices stay in L2 across the pairs), the sums of every
// (block, pair) kept between slices in at most about KOUTER_C_BYTES.
constexpr int64_t KOUTER_SLICE = 640;
constexpr int64_t KOUTER_BLOCKS = 16, KOUTER_C_BYTES = 1024 * 1024;

// k-pairs a slice for Kh k-pairs (whole segments, at most all of them); outer: the k-outer path.
inline int64_t slice_for(int64_t Kh, bool outer) {
  const int64_t seg = amx::segment(Kh), all = (Kh + seg - 1) / seg;
  const int64_t n = slice_segments.load(std::memory_order_relaxed);
  return std::min(all, n > 0 ? n : std::max<int64_t>(1, (outer ? KOUTER_SLICE : WHOLE_K) / seg)) * seg;
}

// The column-block pairs a call runs and where their rows go: adjacent blocks (2p, 2p + 1) of a linear into
// [M, N], or, for a gate_up matrix [gate; up] with silu, gate block p and up block NB/2 + p into [M, N/2] as
// silu(gate) * up (the decode step pairs them the same way).
struct Pairs {
  int64_t NB;
  bool silu;
  int64_t panel = 0;  // with silu: the output in panels of this many elements (amx_tiles.h col_of); 0: rows
  int64_t count() const { return silu ? NB / 2 : (NB + 1) / 2; }
  int64_t ldo() const { return panel ? 32 : silu ? NB * 8 : NB * 16; }
  int ids(int64_t p, int64_t* nb) const {
    nb[0] = silu ? p : 2 * p;
    nb[1] = silu ? NB / 2 + p : 2 * p + 1;
    return nb[1] < NB ? 2 : 1;
  }
};

// A prompt's x as its A tiles read it: blocked (amx_block_x, copied from x [M, K]) or panels (amx_tiles.h panel_a,
// written so by a gate_up with SiLU: rows_pad rows a panel).
struct XTiles {
  const bf16* p;
  int64_t rows_pad = 0;  // panels; 0: blocked
  amx::ATiles at(int64_t Kh, int64_t mb) const {
    return rows_pad ? amx::panel_a(p, rows_pad, mb) : amx::blocked_a(p, Kh, mb);
  }
};

// Block mb's tiles over k-pairs [k0, k0 + kn) of column blocks nb (n of them), B tiles from `b` (decoded, or in
// place), the earlier segments' sums at c.
inline void slice_block(int64_t M, const XTiles& x, int64_t Kh, int64_t mb, int64_t k0, int64_t kn, const int64_t* nb,
                        int n, amx::PackedB<false>& b, float* c, const float* bias, bf16* out, const Pairs& pairs,
                        amx::Pending* pend, amx::Ahead* ahead) {
  const int64_t ldo = pairs.ldo();
  const int rows = (int)std::min<int64_t>(32, M - mb * 32);
  amx::ATiles a = x.at(Kh, mb);
  a.base += (k0 / 16) * a.step;
  const amx::Partial part{c, k0 == 0, k0 + kn == Kh, k0, amx::segment(Kh),
                          amx::own_lines.load(std::memory_order_relaxed)};
  amx::tile_blocks(a, std::min(rows, 16), std::max(rows - 16, 0), b, kn, nb, n, bias, out + mb * 32 * ldo, ldo, &part,
                   pairs.silu, pend, ahead, pairs.panel);
}

// The B tiles of pair p's k-pairs [k0, k0 + kn): decoded into buf (two blocks of `slice` k-pairs), or, for a source
// whose blocks already are packed B tiles (src.in_place(nb, k0): block nb's tile rows from k-pair k0), read where they
// are. nb, n: the pair's blocks. Source: src.slice(nb, k0, kn, dst) writes block nb's k-pairs [k0, k0 + kn) as packed
// [kn][16][2] bf16, and src.bytes(nb, k0, kn, begin, end) says which bytes of the weights that reads.
template <class Source>
inline amx::PackedB<false> slice_tiles(Source& src, const Pairs& pairs, int64_t p, int64_t k0, int64_t kn,
                                       int64_t slice, bf16* buf, int64_t* nb, int& n) {
  n = pairs.ids(p, nb);
  if constexpr (requires { src.in_place(nb[0], k0); }) {
    return {src.in_place(nb[0], k0), src.in_place(nb[n - 1], k0)};
  } else {
    for (int j = 0; j < n; ++j) src.slice(nb[j], k0, kn, buf + j * slice * 32);
    return {buf, buf + slice * 32};
  }
}

// The next decode, pair q's k-pairs [k0, k0 + kn), as the weights `steps` k-steps of tiles request before it.
template <class Source>
inline amx::Ahead* next_decode(Source& src, const Pairs& pairs, int64_t q, int64_t k0, int64_t kn, int64_t steps,
                               amx::Ahead& ahead) {
  int64_t nb[2];
  const char* begin[2];
  const char* end[2];
  const int n = pairs.ids(q, nb);
  for (int j = 0; j < n; ++j) src.bytes(nb[j], k0, kn, begin[j], end[j]);
  ahead.set(n, begin, end, steps);
  return &ahead;
}

// Blocks [c0, c1) against pairs [p0, p1), k-slices of `slice` k-pairs outermost; cbuf holds (c1 - c0) * (p1 - p0) *
// 1024 floats.
template <class Source>
inline void k_outer(int64_t M, const XTiles& x, Source& src, const Pairs& pairs, int64_t c0, int64_t c1, int64_t p0,
                    int64_t p1, int64_t slice, bf16* buf, float* cbuf, const float* bias, bf16* out,
                    amx::Pending* pend) {
  const int64_t Kh = src.K / 2;
  for (int64_t k0 = 0; k0 < Kh; k0 += slice) {
    const int64_t kn = std::min(slice, Kh - k0);
    for (int64_t p = p0; p < p1; ++p) {
      int64_t nb[2];
      int n;
      amx::PackedB<false> b = slice_tiles(src, pairs, p, k0, kn, slice, buf, nb, n);
      amx::Ahead ahead, *next = nullptr;  // the next pair's slice, else the first pair's next slice
      const int64_t steps = (c1 - c0) * ((kn + 15) / 16);
      if (p + 1 < p1) next = next_decode(src, pairs, p + 1, k0, kn, steps, ahead);
      else if (k0 + kn < Kh) next = next_decode(src, pairs, p0, k0 + kn, std::min(slice, Kh - k0 - kn), steps, ahead);
      for (int64_t mb = c0; mb < c1; ++mb)
        slice_block(M, x, Kh, mb, k0, kn, nb, n, b, cbuf + ((p - p0) * (c1 - c0) + (mb - c0)) * 1024, bias, out,
                    pairs, pend, next);
    }
  }
}

// Blocks [c0, c1) against pairs [p0, p1), a pair at a time: decoded once in k-slices of `slice` k-pairs for all the
// blocks (from `once` blocks on; cbuf holds (c1 - c0) * 1024 floats), else again for
// every block as its tiles go (src.again).
template <class Source>
inline void pair_outer(int64_t M, const XTiles& x, Source& src, const Pairs& pairs, int64_t c0, int64_t c1, int64_t p0,
                       int64_t p1, int64_t once, int64_t slice, bf16* buf, float* cbuf, const float* bias, bf16* out,
                       amx::Pending* pend) {
  const int64_t Kh = src.K / 2;
  for (int64_t p = p0; p < p1; ++p) {
    int64_t nb[2];
    if (c1 - c0 >= once) {
      for (int64_t k0 = 0; k0 < Kh; k0 += slice) {
        const int64_t kn = std::min(slice, Kh - k0);
        int n;
        amx::PackedB<false> b = slice_tiles(src, pairs, p, k0, kn, slice, buf, nb, n);
        amx::Ahead ahead, *next = nullptr;  // this pair's next slice, else the next pair's first
        const int64_t steps = (c1 - c0) * ((kn + 15) / 16);
        if (k0 + kn < Kh) next = next_decode(src, pairs, p, k0 + kn, std::min(slice, Kh - k0 - kn), steps, ahead);
        else if (p + 1 < p1) next = next_decode(src, pairs, p + 1, 0, std::min(slice, Kh), steps, ahead);
        for (int64_t mb = c0; mb < c1; ++mb)
          slice_block(M, x, Kh, mb, k0, kn, nb, n, b, cbuf + (mb - c0) * 1024, bias, out, pairs, pend, next);
      }
    } else {
      const int n = pairs.ids(p, nb);
      if (pend) pend->flush_held();  // again() runs its own tiles, without the deferred epilogue
      for (int64_t mb = c0; mb < c1; ++mb) src.again(M, x, mb, nb, n, bias, out, pairs);
    }
  }
}

// M rows of x (its A tiles: x) against every pair of src into out (bias fp32 or nullptr; with pairs.panel, out is
// panels); pairs give their B tiles once for a chunk from `once` 32-row blocks on (Source::again below that), and the
// k-slices go outermost where a chunk has fewer than `outer` blocks and the call at least that many. The pairs of each
// chunk (or k-outer span of blocks) go to the threads in runs as they come free (runs.h tile_pairs); a k-outer run is
// at least OUTER_LEAST pairs (but the last, or where a fixed share would hold fewer), since each run reads its blocks'
// A slices again.
constexpr int64_t OUTER_LEAST = 4;
template <class Source>
void blocked_tiles(int64_t M, const XTiles& x, Source& src, const Pairs& pairs, int64_t once, int64_t outer_min,
                   const float* bias, bf16* out) {
  TORCH_CHECK(!pairs.panel || (pairs.silu && pairs.NB % 4 == 0),
              "AMX tiles: only a SiLU epilogue over whole 32-column panels writes panels");
  const int64_t mblocks = (M + 31) / 32, chunk = std::max<int64_t>(1, CHUNK_BYTES / (32 * src.K * 2));
  const int64_t np = pairs.count();
  if (np == 0) return;
  const int nt = (int)std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(np, 1));
  const int64_t share = (np + nt - 1) / nt;  // a fixed share's pairs, at most
  // The C tiles' sums between k-slices: 4 KiB per 32-row block and pair.
  const int64_t span = std::clamp<int64_t>(KOUTER_C_BYTES / (share * 4096), 1, KOUTER_BLOCKS);
  const bool outer = chunk < outer_min && std::min(mblocks, span) >= outer_min;
  const int64_t slice = slice_for(src.K / 2, outer);
  const int64_t group = outer ? span : chunk, groups = (mblocks + group - 1) / group;  // 32-row blocks a group
  const int64_t least = outer ? std::min(OUTER_LEAST, share) : 1;
  std::vector<Runs> runs(groups);
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    bf16* buf = static_cast<bf16*>(std::aligned_alloc(64, 2 * slice * 64));
    float* cbuf = static_cast<float*>(std::aligned_alloc(64, (outer ? span * share : chunk) * 4096));
    TORCH_CHECK(buf && cbuf, "AMX tiles: out of memory for a decode buffer");
    {
      amx::Tiles tiles(32);
      // A SiLU epilogue (an exp, a reciprocal) is deferred into the next block's k-loop (amx::Pending). Alternated
      // call by call on an Emerald Rapids-class Xeon (session 39), time deferred / at once: gate_up [9728, 896] at
      // 512 rows 0.92-0.97 (six runs), at 128 and 2,048 rows 0.98; [16384, 2048] 0.99-1.01. A plain epilogue (one
      // conversion to bf16) stays at once: deferred, [1152, 896] and [896, 896] took 1.02-1.06.
      amx::Pending pending;
      amx::Pending* pend = pairs.silu ? &pending : nullptr;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t c0 = g * group, c1 = std::min(mblocks, c0 + group);
        tile_pairs(runs[g], np, t0, t1, nt, least, [&](int64_t p0, int64_t p1) {
          if (outer)
            k_outer(M, x, src, pairs, c0, c1, p0, p1, slice, buf, cbuf, bias, out, pend);
          else
            pair_outer(M, x, src, pairs, c0, c1, p0, p1, once, slice, buf, cbuf, bias, out, pend);
        });
      }
      pending.finish();
    }
    std::free(buf);
    std::free(cbuf);
  });
}

// The same for xt [M, K], copied into tile blocks first (zero-padded to whole 32-row blocks).
template <class Source>
void blocked(int64_t M, const at::Tensor& xt, Source& src, const Pairs& pairs, int64_t once, int64_t outer_min,
             const float* bias, bf16* out) {
  const at::Tensor xb = amx_block_x(xt);
  blocked_tiles(M, XTiles{xb.data_ptr<bf16>()}, src, pairs, once, outer_min, bias, out);
}

// Panels for the rows of an [M, K] x (K % 32 == 0), written by a gate_up with SiLU (Pairs::panel): [K/32, rows_pad, 32]
// with the rows past M zeroed, since the A tiles of the last 32-row block read them.
inline at::Tensor panels_for(int64_t M, int64_t K, const at::TensorOptions& options) {
  const int64_t rows_pad = (M + 31) / 32 * 32;
  at::Tensor p = at::empty({K / 32, rows_pad, 32}, options);
  if (rows_pad > M) p.narrow(1, M, rows_pad - M).zero_();
  return p;
}

// The M rows [M, K] that panels xp hold (a copy).
inline at::Tensor rows_of(const at::Tensor& xp, int64_t M) {
  return xp.narrow(1, 0, M).transpose(0, 1).reshape({M, xp.size(0) * 32});
}

// Rows y [M, K] as panels (panels_for), for a path that computed rows.
inline at::Tensor panels_of(const at::Tensor& y) {
  const int64_t M = y.size(0), K = y.size(1);
  at::Tensor p = panels_for(M, K, y.options());
  p.narrow(1, 0, M).copy_(y.view({M, K / 32, 32}).transpose(0, 1));
  return p;
}

// A panels tensor's rows_pad, checked against K and M.
inline int64_t panel_rows(const at::Tensor& xp, int64_t M, int64_t K) {
  TORCH_CHECK(xp.dim() == 3 && xp.size(0) * 32 == K && xp.size(2) == 32 && xp.size(1) % 32 == 0 &&
                  xp.size(1) >= M && xp.size(1) < M + 32 && xp.scalar_type() == at::kBFloat16 && xp.is_contiguous(),
              "x panels must be a contiguous bf16 [K/32, rows rounded up to 32, 32] tensor for K=", K, " and M=", M,
              ", got ", xp.sizes());
  return xp.size(1);
}

#endif

}  // namespace amx_slices
}  // namespace deploykit
