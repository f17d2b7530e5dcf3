// The matrices of the fused decode step (decode_step.cpp) and their products with the step's B rows: packed bf16
// (gemv.h), compact bf16 (compact_bf16.h) or block-quantized (quant_layout.h), chosen per weight at load, each run by
// the same code as the per-op linear of its kind, so the step and the per-op path agree bitwise.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "argmax.h"
#include "compact_amx.h"
#include "compact_bf16.h"
#include "gemv.h"
#include "quant_amx.h"
#include "quant_gemv.h"
#include "runs.h"

namespace deploykit {
namespace step {

using bf16 = at::BFloat16;

// Rows of one call: up to 4, each weight line is loaded once for all of them (gemv::packed_range); up to 16 where
// every matrix runs on AMX tiles (compact, compact_amx::on), whose k-tiles take 16 rows for about the time of one,
// or is quantized (as quant_linear runs them: 16 rows on AMX-INT8 tiles where the CPU has them, else tiles of 4 rows
// over each pair of groups, quant::tiled_rows). Past 4 rows the per-op path ran each of ~12 ops a layer from Python:
// a 16-sequence step of the benchmark model took 1.5x a 1-sequence one.
constexpr int64_t MAX_ROWS = 4, MAX_TILE_ROWS = 16;
static_assert(MAX_TILE_ROWS <= quant_amx::MIN_ROWS, "Room::tiles takes one block of 16 rows");

// One thread's room for the rows quantized (quantized weights take int8 activations) and for 16 of them on AMX-INT8
// tiles, sized up front: nothing inside the step's parallel region allocates.
struct Room {
  quant::ActBuffer acts;
  quant_amx::Rows16 tiles;
  void reserve(int64_t B, int64_t K) {  // K: the longest of the step's matrices
    acts.reserve(B, K);
    if (B == quant_amx::MIN_ROWS) tiles.reserve(K);
  }
};

struct Weight {
  enum Kind { PACKED, COMPACT, QUANTIZED } kind = PACKED;
  const bf16* packed = nullptr;
  compact::Matrix c{};
  quant::Matrix q{};
  bool quantized() const { return kind == QUANTIZED; }
  // Whether it takes up to MAX_TILE_ROWS rows.
  bool wide() const { return quantized() || (kind == COMPACT && compact_amx::on(c)); }
};

// layer < 0: a matrix outside the layers (the LM head), named alone.
inline Weight weight(const at::Tensor& w, int64_t N, int64_t K, int64_t layer, const char* name) {
  const std::string where = layer < 0 ? std::string(name) : "layer " + std::to_string(layer) + " " + name;
  Weight out;
  if (compact::is_blob(w)) {
    out.kind = Weight::COMPACT;
    out.c = compact::matrix(w);
    TORCH_CHECK(out.c.N == N && out.c.K == K, where, ": the compact weight is [", out.c.N, ", ",
                out.c.K, "], expected [", N, ", ", K, "]");
    return out;
  }
  if (quant::is_blob(w)) {
    out.kind = Weight::QUANTIZED;
    out.q = quant::matrix(w);
    TORCH_CHECK(out.q.N == N && out.q.K == K, where, ": the quantized weight is [", out.q.N,
                ", ", out.q.K, "], expected [", N, ", ", K, "]");
    return out;
  }
  TORCH_CHECK(w.dim() == 4 && w.size(0) * 16 == N && w.size(1) * 2 == K && w.size(2) == 16 && w.size(3) == 2 &&
                  w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              where, ": expected a packed bf16 [", N / 16, ", ", K / 2, ", 16, 2] weight, a "
              "compact or a quantized one");
  out.packed = w.data_ptr<bf16>();
  return out;
}

// The token table the step looks its rows up in, of the kinds layers.embed_rows takes: quantized, compact, packed
// [V/16, H/2, 16, 2] or plain [V, H] bf16; each row the bits embed_rows gives it (a quantized row rounded from fp32
// to bf16 to nearest even, as Tensor.to does).
struct Table {
  enum Kind { PLAIN, PACKED, COMPACT, QUANTIZED } kind = PLAIN;
  const bf16* dense = nullptr;
  compact::Matrix c{};
  quant::Matrix q{};
  int64_t V = 0;
  // Row id -> out [H]; scratch: H floats.
  void row(int64_t id, int64_t H, bf16* out, float* scratch) const {
    if (kind == QUANTIZED) {
      dequant_row(q, id, scratch);
      for (int64_t k = 0; k < H; ++k) out[k] = static_cast<bf16>(scratch[k]);
    } else if (kind == COMPACT) {
      compact::row(c, id, reinterpret_cast<uint16_t*>(out));
    } else if (kind == PACKED) {  // row id is column id % 16 of block id / 16: pairs of k
      const bf16* b = dense + id / 16 * H * 16 + id % 16 * 2;
      for (int64_t k = 0; k < H; k += 2) out[k] = b[k * 16], out[k + 1] = b[k * 16 + 1];
    } else {
      std::copy(dense + id * H, dense + (id + 1) * H, out);
    }
  }
};

inline Table table(const at::Tensor& t, int64_t H) {
  Table out;
  if (quant::is_blob(t)) {
    out.kind = Table::QUANTIZED, out.q = quant::matrix(t), out.V = out.q.N;
    TORCH_CHECK(out.q.K == H, "the token table is [", out.q.N, ", ", out.q.K, "], expected H = ", H);
  } else if (compact::is_blob(t)) {
    out.kind = Table::COMPACT, out.c = compact::matrix(t), out.V = out.c.N;
    TORCH_CHECK(out.c.K == H, "the token table is [", out.c.N, ", ", out.c.K, "], expected H = ", H);
  } else {
    const bool packed = t.dim() == 4 && t.size(1) * 2 == H && t.size(2) == 16 && t.size(3) == 2;
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && (packed || (t.dim() == 2 && t.size(1) == H)),
                "the token table: expected a contiguous bf16 [V, ", H, "] or packed [V/16, ", H / 2, ", 16, 2] "
                "tensor, a compact or a quantized one");
    out.kind = packed ? Table::PACKED : Table::PLAIN, out.dense = t.data_ptr<bf16>();
    out.V = packed ? t.size(0) * 16 : t.size(0);
  }
  return out;
}

// B rows of x [B, K] made ready once per phase for w's kernel: quantized for a quantized w, and packed for the
// AMX-INT8 tiles at 16 rows (in room.tiles, where quant_linear would take them); the bf16 kinds read x in place.
struct Ready {
  quant::Act a[MAX_TILE_ROWS];
  bool tiles = false;
};

inline void prepare(int64_t B, const bf16* x, int64_t K, const Weight& w, Room& room, Ready& r) {
  if (!w.quantized()) return;
  for (int64_t b = 0; b < B; ++b) {
    r.a[b] = room.acts.row(b);
    quant::quantize(x + b * K, K, r.a[b]);
  }
  r.tiles = B == quant_amx::MIN_ROWS && quant_amx::takes(B);  // Room::tiles holds one 16-row block
  if (r.tiles) room.tiles.pack(r.a, K);
}

// y[:, 16 b0 .. 16 b1) = x W^T + bias for B rows of x [B, K], made ready for w.
inline void columns(int64_t B, const bf16* x, int64_t K, const Weight& w, Room& room, const Ready& r, int64_t b0,
                    int64_t b1, const float* bias, bf16* y, int64_t ldy) {
  if (w.kind == Weight::PACKED) {
    gemv::packed_rows(B, x, K, w.packed, K / 2, b0, b1, bias, y, ldy);
  } else if (w.kind == Weight::COMPACT) {
    if (compact_amx::on(w.c)) compact_amx::rows(B, x, K, w.c, b0, b1, bias, y, ldy);
    else compact::rows(B, x, K, w.c, b0, b1, bias, y, ldy);
  } else if (r.tiles) {
    room.tiles.groups_of(w.q, b0, b1, bias, y, ldy);
  } else {
    quant::tiled_rows(B, r.a, w.q, b0, b1, bias, y, ldy);
  }
}

// y[:, 16 b0 .. 16 b1) = x W^T + bias for B rows of x [B, K].
inline void matvec(int64_t B, const bf16* x, int64_t K, const Weight& w, Room& room, int64_t b0, int64_t b1,
                   const float* bias, bf16* y, int64_t ldy) {
  Ready r;
  prepare(B, x, K, w, room, r);
  columns(B, x, K, w, room, r, b0, b1, bias, y, ldy);
}

// gu[:, gate blocks j and up blocks J + j] for j in [j0, j1), on one thread so it can apply silu(gate) * up to
// its own columns without waiting: P + P pairs at a time keep 2P weight streams in flight (P = 4, or 2 from 3 rows
// on, as packed_range groups its blocks).
template <int MT>
inline void gate_up_pairs(const bf16* x, int64_t ldx, const bf16* w, int64_t Kh, int64_t J, int64_t j0, int64_t j1,
                          const float* bias, bf16* gu, int64_t ldo) {
  constexpr int P = MT <= 2 ? 4 : 2;
  int64_t j = j0;
  if (gemv::one_stream()) {  // gate block j, then up block j: one stream at a time (gemv.h Streams)
    for (; j < j1; ++j) {
      const int64_t gate[1] = {j}, up[1] = {J + j};
      gemv::packed_blocks<1, MT, false>(x, ldx, w, Kh, gate, bias, gu, ldo);
      gemv::packed_blocks<1, MT, false>(x, ldx, w, Kh, up, bias, gu, ldo);
    }
    return;
  }
  for (; j + P <= j1; j += P) {
    int64_t ids[2 * P];
    for (int p = 0; p < P; ++p) ids[p] = j + p, ids[P + p] = J + j + p;
    gemv::packed_blocks<2 * P, MT>(x, ldx, w, Kh, ids, bias, gu, ldo);
  }
  for (; j < j1; ++j) {
    const int64_t ids[2] = {j, J + j};
    gemv::packed_blocks<2, MT>(x, ldx, w, Kh, ids, bias, gu, ldo);
  }
}

// gu[:, gate blocks [j0, j1)] and gu[:, up blocks J + [j0, j1)] = x [B, H] W_gate_up^T + bias ([B, 2I], I = 16 J),
// x made ready for w, on this thread, so that it can go on to silu(gate) * up for its own columns.
inline void gate_up_columns(int64_t B, const bf16* x, int64_t H, const Weight& w, Room& room, const Ready& r, int64_t J,
                            int64_t j0, int64_t j1, const float* bias, bf16* gu) {
  const int64_t ldo = 32 * J;
  // Interleaved halves (quant_layout.h): gate block j, then up block j, the next group in memory, so a claim is one
  // stream. Measured on a 2-vCPU Zen 4 (benchmarks/README.md, session 51), the batch-1 step with the halves interleaved
  // against one run of gate blocks then one of up blocks, alternated in one process, median time a token with DRAM
  // slow / fast: Q4_0 0.966 / 0.915 (gate_up 0.957 / 0.829), Q8_0 0.923 / 0.852, Q4_K_M 0.960 (slow only).
  if (w.quantized() && w.q.interleaved) {
    if (B <= MAX_ROWS && !r.tiles) return quant::interleaved_rows(B, r.a, w.q, j0, j1, bias, gu, ldo);
    for (int64_t j = j0; j < j1; ++j) {
      columns(B, x, H, w, room, r, j, j + 1, bias, gu, ldo);
      columns(B, x, H, w, room, r, J + j, J + j + 1, bias, gu, ldo);
    }
  } else if (w.quantized()) {
    columns(B, x, H, w, room, r, j0, j1, bias, gu, ldo);
    columns(B, x, H, w, room, r, J + j0, J + j1, bias, gu, ldo);
  } else if (w.kind == Weight::COMPACT && compact_amx::on(w.c)) {  // gate j and up j as a pair
    compact_amx::Tiles tiles(B);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t ids[2] = {j, J + j};
      compact_amx::blocks(B, x, H, w.c, ids, 2, bias, gu, ldo);
    }
  } else if (w.kind == Weight::COMPACT) {
    gemv::with_rows(B, [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
      if (gemv::one_stream()) {  // one stream at a time: gate blocks [j0, j1) in a run, then up's (gate_up_claim)
        for (int64_t j = j0; j < j1; ++j) compact::blocks<1, MT, false>(x, H, w.c, &j, bias, gu, ldo);
        for (int64_t j = J + j0; j < J + j1; ++j) compact::blocks<1, MT, false>(x, H, w.c, &j, bias, gu, ldo);
        return;
      }
      for (int64_t j = j0; j < j1; ++j) {  // gate block j and up block j at once (gemv.h Streams)
        const int64_t ids[2] = {j, J + j};
        compact::blocks<2, MT, true>(x, H, w.c, ids, bias, gu, ldo);  // 4 MT accumulators
      }
    });
  } else {
    gemv::with_rows(B, [&](auto mt) {
      gate_up_pairs<decltype(mt)::value>(x, H, w.packed, H / 2, J, j0, j1, bias, gu, ldo);
    });
  }
}

inline void gate_up(int64_t B, const bf16* x, int64_t H, const Weight& w, int64_t J, int64_t j0, int64_t j1,
                    const float* bias, Room& room, bf16* gu) {
  Ready r;
  prepare(B, x, H, w, room, r);
  gate_up_columns(B, x, H, w, room, r, J, j0, j1, bias, gu);
}

// logits[:, 16 b0 .. 16 b1) = x W^T in fp32 for B rows of x [B, K] made ready for w, the bits kernels.logits gives:
// a quantized head writes fp32 directly (no bf16 rounding of near-tied logits), the bf16 kinds round to bf16 as their
// linear does (into `rounded`, [B, V]) and are widened.
inline void head_columns(int64_t B, const bf16* x, int64_t K, const Weight& w, Room& room, const Ready& r, int64_t b0,
                         int64_t b1, bf16* rounded, float* logits, int64_t V) {
  if (w.quantized() && r.tiles) return room.tiles.groups_of(w.q, b0, b1, nullptr, logits, V);
  if (w.quantized()) return quant::tiled_rows(B, r.a, w.q, b0, b1, nullptr, logits, V);
  columns(B, x, K, w, room, r, b0, b1, nullptr, rounded, V);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 16 * b0; c < 16 * b1; ++c) logits[b * V + c] = static_cast<float>(rounded[b * V + c]);
}

// Whether a phase on w goes through Shares (runs.h: a thread done with its share takes over from a slower one): every
// kind but packed bf16, whose GEMV splits a thread's range into streams of its own (gemv.h Streams) and keeps fixed
// shares. Quantized and compact matrices are read as one stream per thread, or a pair of blocks at a time.
inline bool shared(const Weight& w) { return w.kind != Weight::PACKED; }

// The column blocks a claim takes of n: about 16 KiB of a quantized matrix (a claim is one atomic add; K = 896 in Q4_0
// is 8 KiB a block, K = 4864 43 KiB), or 2 compact blocks, a pair as the compact kernels take them (21 KiB each at
// K = 896); at most an eighth of n, so that a small matrix's shares still leave something to take over.
inline int64_t claim_blocks(const Weight& w, int64_t n) {
  const int64_t claim = w.quantized() ? 16384 / w.q.parts[0].group_bytes : 2;
  return std::max<int64_t>(1, std::min(claim, n / 8));
}

// A segmented matrix's panel (quant_layout.h), whose groups lie segment by segment and are best read whole
// (quant_rows.h panel), or 1 block. ways: 2 where a claim's block j stands for gate j and up j (interleaved gate_up,
// whose panels are of slots). Claims take whole panels, while a take-over splits what is left at any block, so that
// the two threads still finish a phase close together. Measured on a 2-vCPU Zen 4 (benchmarks/README.md, session
// 52): the last claims of a share tapering to single groups (read out of their panels, past the other groups'
// pieces) lost down's whole gain from the panels (Q4_0 down 1.05 / 1.01 the plain layout's time, DRAM slow / fast).
inline int64_t panel_blocks(const Weight& w, int64_t ways = 1) {
  if (!w.quantized() || !w.q.parts[0].segmented()) return 1;
  return std::max<int64_t>(1, w.q.parts[0].panel / ways);
}
inline int64_t whole(int64_t claim, int64_t unit) { return std::max(unit, claim / unit * unit); }

// cols(b0, b1) over the column blocks of w this thread claims of `shares`.
template <class Cols>
inline void claims(const Weight& w, Shares& shares, int tid, const Cols& cols) {
  const int64_t base = claim_blocks(w, shares.items()), step = whole(base, panel_blocks(w));
  shares.walk(tid, step, 2 * base, cols);
}

// y[:, 16 b0 .. 16 b1) = x W^T + bias for B rows of x [B, K] over the column blocks this thread claims of `shares`.
inline void matvec_shares(int64_t B, const bf16* x, int64_t K, const Weight& w, Room& room, Shares& shares, int tid,
                          const float* bias, bf16* y, int64_t ldy) {
  Ready r;
  prepare(B, x, K, w, room, r);
  claims(w, shares, tid, [&](int64_t b0, int64_t b1) { columns(B, x, K, w, room, r, b0, b1, bias, y, ldy); });
}

// The LM head's fp32 logits [B, V] (head_columns) for column blocks [b0, b1), or, with shares, for those this thread
// claims; with picks ([B]), each row's greedy token among them merged in (argmax.h: torch.argmax's answer once every
// thread's picks are merged), scanned while the thread's own logits are still in L1.
inline void head(int64_t B, const bf16* x, int64_t K, const Weight& w, Room& room, Shares* shares, int tid,
                 int64_t b0, int64_t b1, bf16* rounded, float* logits, int64_t V, argmax::Best* picks) {
  Ready r;
  prepare(B, x, K, w, room, r);
  const auto cols = [&](int64_t c0, int64_t c1) {
    head_columns(B, x, K, w, room, r, c0, c1, rounded, logits, V);
    for (int64_t b = 0; picks && b < B; ++b) {
      const float* row = logits + b * V + 16 * c0;
      const int64_t j = argmax::argmax_row(row, 16 * (c1 - c0));
      picks[b].merge(row[j], 16 * c0 + j);
    }
  };
  if (shares) claims(w, *shares, tid, cols);
  else cols(b0, b1);
}

// The gate blocks a claim of gate_up takes of J (and as many up blocks): about GATE_UP_RUN bytes of each half where
// gate_up_columns reads a claim's blocks as runs (quantized: one run of interleaved gate and up blocks, or one run of
// gate blocks and then one of up blocks; compact off AMX tiles with one stream at a time), at most an eighth of J.
// Claims of one block a half (8 KiB of Q4_0 at K = 896, 21 KiB compact) switched between the two halves' streams every
// block, which the hardware prefetcher follows worse than long runs. Measured on a 2-vCPU Zen 4 (benchmarks/README.md,
// session 50) in the batch-1 fused step, halves not interleaved, 128 KiB against one block, alternated in one process,
// 24-40 rounds, median time in gate_up (a token) with DRAM slow / fast (the bandwidth probe below / above 46 GB/s):
// Q4_0 0.90-0.94 (0.95-0.99) / 0.72-0.85 (0.86-0.96), Q4_K_M 0.84 (0.92) / 0.73 (0.86), Q8_0 (15 KiB blocks) 0.98
// (0.99) / 0.96 (1.00), compact bf16 0.90 (0.94) / 0.79-0.80 (0.90-0.91); 256 KiB and J / 8 as 128 KiB. The AMX tiles
// and the compact GEMV's two streams at once (gemv.h Streams) take gate j and up j as one pair and keep claim_blocks.
inline constexpr int64_t GATE_UP_RUN = 128 << 10;
inline int64_t gate_up_claim(const Weight& w, int64_t J) {
  const bool runs = w.quantized() || (w.kind == Weight::COMPACT && !compact_amx::on(w.c) && gemv::one_stream());
  if (!runs) return std::max<int64_t>(1, claim_blocks(w, 2 * J) / 2);
  const int64_t block = w.quantized() ? w.q.parts[0].group_bytes : w.c.groups * compact::GROUP_BYTES;
  return whole(std::max<int64_t>(1, std::min(GATE_UP_RUN / block, J / 8)), panel_blocks(w, 2));
}

// gate_up over the column blocks j this thread claims of `shares` (J of them; a claim of blocks [j0, j1) takes gate
// blocks j0..j1 and up blocks J + j0..J + j1), then done(j0, j1) for each claim: silu(gate) * up of its columns, on
// the thread that has them.
template <class Done>
inline void gate_up_shares(int64_t B, const bf16* x, int64_t H, const Weight& w, int64_t J, Shares& shares, int tid,
                           const float* bias, Room& room, bf16* gu, const Done& done) {
  Ready r;
  prepare(B, x, H, w, room, r);
  const int64_t step = gate_up_claim(w, shares.items());
  shares.walk(tid, step, 2 * step, [&](int64_t j0, int64_t j1) {
    gate_up_columns(B, x, H, w, room, r, J, j0, j1, bias, gu);
    done(j0, j1);
  });
}

}  // namespace step
}  // namespace deploykit
