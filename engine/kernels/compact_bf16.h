// Compact bf16: a packed bf16 matrix (gemv.h) held in 12 bits a weight, losslessly, so a batch-1 decode step, which
// is bound by the bytes it streams, reads 25 % fewer of them.
//
// Why it works: a bf16 weight is 1 sign, 8 exponent and 7 mantissa bits, and a trained (or initialised) matrix uses
// few exponents: its values span a few powers of two around its scale. The high byte of a bf16 (sign and the top 7
// exponent bits) takes about 16 distinct values in a matrix; the low byte (the exponent's last bit and the
// mantissa) is close to uniform. So the low byte is stored as it is and the high byte as a 4-bit code into a
// per-matrix table of its 15 most common values. Code 15 is an escape: such a weight (about 2 in 10,000 on the
// benchmark model) is listed with its exact bits and patched into the decoded line before it is used, so every
// kernel sees exactly the packed bf16 matrix.
//
// Layout: the packed matrix's [N/16, K/2, 16, 2] lines (64 bytes: k-pair j of 16 output columns), taken 4 lines
// (one "group", k-pairs 4q .. 4q + 3 of one 16-column block) at a time, each group 192 bytes:
//   A[64]      low bytes of lines 0 and 1, B[64] low bytes of lines 2 and 3, C[64] codes
//   A[16 L + i] = low byte of line 0 word 8 L + i (i < 8), of line 1 word 8 L + i - 8 (i >= 8), L = 128-bit lane;
//   C[p] = code of A[p]'s high byte (low nibble) | code of B[p]'s high byte << 4.
// so that decoding is 2 table shuffles (vpshufb, AVX512BW) and 4 byte interleaves (vpunpck{l,h}bw) per 128
// weights, which put each line's words back in order. A block's groups are contiguous and blocks follow each other,
// so a matrix is one sequential stream, as the packed layout is.
//
// A blob (int8 [bytes], 64-byte aligned):
//   header (256 bytes): int32 magic, N, K, 0; uint8 table[16] at 16; int64 at 32: the offset of index, at 40: the
//                       offset of the exceptions, at 48: their count
//   groups              N/16 blocks x K/8 groups x 192 bytes, from byte 256
//   index               int64 [N/16 + 1]: block b's exceptions are [index[b], index[b + 1])
//   exceptions          Exception [count], by block, then group, line and word
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gemv.h"
#include "vec.h"

namespace deploykit {
namespace compact {

using bf16 = at::BFloat16;

constexpr int32_t MAGIC = 0x3143'4b44;  // "DKC1"
constexpr int64_t HEADER_BYTES = 256;
constexpr int64_t GROUP_BYTES = 192;  // 4 lines of 32 weights in 12 bits each
constexpr int64_t GROUP_PAIRS = 4;    // k-pairs (lines) per group
constexpr uint8_t ESCAPE = 15;

// A weight whose high byte is not in the table: line `line` (0..3) of group `group` of its block, word `word`
// (0..31, = 2 * column + k parity within the line) holds `bits`.
struct Exception {
  int32_t group;
  uint8_t line, word;
  uint16_t bits;
};
static_assert(sizeof(Exception) == 8);

struct Matrix {
  int64_t N, K, groups;      // groups per 16-column block: K / 8
  const uint8_t* data;       // block b, group q at data + (b * groups + q) * GROUP_BYTES
  const int64_t* index;      // [N / 16 + 1]
  const Exception* exceptions;
  __m512i table;             // the 16 high bytes, in each 128-bit lane (vpshufb looks up within a lane)
  int64_t count;             // exceptions in all
};

inline bool is_blob(const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kChar && t.dim() == 1; }

inline Matrix matrix(const at::Tensor& blob) {
  TORCH_CHECK(is_blob(blob) && blob.is_contiguous() && blob.numel() >= HEADER_BYTES,
              "a compact bf16 weight must be a contiguous int8 blob made by compact_pack");
  const uint8_t* base = reinterpret_cast<const uint8_t*>(blob.data_ptr<int8_t>());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 64 == 0, "a compact bf16 blob must be 64-byte aligned");
  int32_t h[4];
  int64_t off[3];
  std::memcpy(h, base, sizeof(h));
  std::memcpy(off, base + 32, sizeof(off));
  TORCH_CHECK(h[0] == MAGIC && h[1] > 0 && h[1] % 16 == 0 && h[2] > 0 && h[2] % 8 == 0,
              "not a compact bf16 blob (bad header)");
  Matrix m{};
  m.N = h[1];
  m.K = h[2];
  m.groups = m.K / 8;
  m.data = base + HEADER_BYTES;
  const int64_t NB = m.N / 16, data_end = HEADER_BYTES + NB * m.groups * GROUP_BYTES;
  TORCH_CHECK(off[0] >= data_end && off[0] % 8 == 0 && off[1] >= off[0] + (NB + 1) * 8 && off[1] % 8 == 0 &&
                  off[2] >= 0 && off[1] + off[2] * (int64_t)sizeof(Exception) <= blob.numel(),
              "a compact bf16 blob's sections lie outside it");
  m.index = reinterpret_cast<const int64_t*>(base + off[0]);
  m.exceptions = reinterpret_cast<const Exception*>(base + off[1]);
  m.count = off[2];
  TORCH_CHECK(m.index[0] == 0 && m.index[NB] == m.count, "a compact bf16 blob's exception index is inconsistent");
  m.table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 16)));
  return m;
}

// Byte position in a group's A/B half (and in C) of word `word` of line `line % 2`: A[16 L + i] is line 0's word
// 8 L + i for i < 8 and line 1's word 8 L + i - 8 for i >= 8 (the order vpunpck{l,h}bw undo).
inline int position(int line, int word) { return (word / 8) * 16 + (line % 2) * 8 + word % 8; }

// Row r of the [N, K] matrix -> out [K] (bf16 bits), bit for bit (an embedding tied to a compact lm_head). Row r is
// column r % 16 of block r / 16: words 2 (r % 16) and 2 (r % 16) + 1 of every line.
inline void row(const Matrix& w, int64_t r, uint16_t* out) {
  alignas(64) uint8_t table[64];
  _mm512_store_si512(table, w.table);  // the 16 high bytes in each lane
  const int64_t b = r / 16, col = r % 16;
  const uint8_t* src = w.data + b * w.groups * GROUP_BYTES;
  for (int64_t q = 0; q < w.groups; ++q) {
    const uint8_t* g = src + q * GROUP_BYTES;
    for (int line = 0; line < GROUP_PAIRS; ++line)
      for (int parity = 0; parity < 2; ++parity) {
        const int p = position(line, 2 * (int)col + parity), half = line / 2;
        const uint8_t code = (g[128 + p] >> (4 * half)) & 0x0F;
        // An escape reads as +0 here, as in decode(), and gets its bits below.
        out[2 * (GROUP_PAIRS * q + line) + parity] =
            code == ESCAPE ? 0 : (uint16_t)(table[code] << 8 | g[half * 64 + p]);
      }
  }
  for (int64_t e = w.index[b]; e < w.index[b + 1]; ++e) {
    const Exception& x = w.exceptions[e];
    if (x.word / 2 == col) out[2 * (GROUP_PAIRS * x.group + x.line) + x.word % 2] = x.bits;
  }
}

// Group `g` -> its 4 packed lines w[0..3] (k-pairs 4q .. 4q + 3), escapes still reading as +0.
[[gnu::always_inline]] inline void decode(const uint8_t* g, __m512i table, __m512i w[GROUP_PAIRS]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i codes = _mm512_loadu_si512(g + 128);
  const __m512i ha = _mm512_shuffle_epi8(table, _mm512_and_si512(codes, nibble));
  const __m512i hb = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble));
  const __m512i la = _mm512_loadu_si512(g), lb = _mm512_loadu_si512(g + 64);
  w[0] = _mm512_unpacklo_epi8(la, ha);
  w[1] = _mm512_unpackhi_epi8(la, ha);
  w[2] = _mm512_unpacklo_epi8(lb, hb);
  w[3] = _mm512_unpackhi_epi8(lb, hb);
}

// Writes the exact bits of group q's escaped weights into its decoded lines; e advances past them. Rare (about 1
// group in 40 on the benchmark model). Inlined, with constant line indices, so the lines stay in registers: called
// out of line, GCC kept every group's lines and the accumulators on the stack (2x slower at 4 rows).
[[gnu::always_inline]] inline void patch(__m512i w[GROUP_PAIRS], const Exception*& e, const Exception* end, int64_t q) {
  for (; e != end && e->group == q; ++e) {
    const __mmask32 k = (__mmask32)(1u << e->word);
    const short bits = (short)e->bits;
    switch (e->line) {
      case 0: w[0] = _mm512_mask_set1_epi16(w[0], k, bits); break;
      case 1: w[1] = _mm512_mask_set1_epi16(w[1], k, bits); break;
      case 2: w[2] = _mm512_mask_set1_epi16(w[2], k, bits); break;
      default: w[3] = _mm512_mask_set1_epi16(w[3], k, bits); break;
    }
  }
}

// out[m, 16 nb[g] + j] for G blocks (any ids) and MT rows of x (2 x MT x G accumulators: MT <= 4, or 8 with G = 1).
// Each block sums its even lines and its odd lines in two fp32 chains, added at the end: one chain
// (gemv::packed_blocks' order) is bound by vdpbf16ps's latency at 16-17 weights/ns a core on Zen 4 once the decode
// is added, two reach 23-35 (benchmarks/README.md). So results differ from the packed kernels' by fp32 reassociation
// only. Every compact path runs this code (compact_linear in tiles of up to 8 rows) or sums in its order (the decoded
// prefill tiles of compact_bf16.cpp), so the fused step and the per-op path agree bitwise, and a row's result does not
// depend on its batch.
// next: another block's stream to pull into L2 alongside, a group per group (compact_linear's many-row tiles, whose
// compute per byte would otherwise leave the DRAM stream idle), or nullptr.
template <int G, int MT, bool PF>
inline void blocks(const bf16* x, int64_t ldx, const Matrix& w, const int64_t nb[G], const float* bias, bf16* out,
                   int64_t ldo, const uint8_t* next = nullptr) {
  __m512 acc[2][MT][G];
  const uint8_t* src[G];
  const Exception *e[G], *end[G];
  for (int g = 0; g < G; ++g) {
    src[g] = w.data + nb[g] * w.groups * GROUP_BYTES;
    e[g] = w.exceptions + w.index[nb[g]];
    end[g] = w.exceptions + w.index[nb[g] + 1];
  }
  for (int c = 0; c < 2; ++c)
    for (int m = 0; m < MT; ++m)
      for (int g = 0; g < G; ++g) acc[c][m][g] = _mm512_setzero_ps();
  for (int64_t q = 0; q < w.groups; ++q) {
    if (next)
      for (int l = 0; l < 3; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(next) + q * GROUP_BYTES + 64 * l, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = src[g] + q * GROUP_BYTES;
      if (PF)
        for (int l = 0; l < 3; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(p) + gemv::PACKED_PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
      __m512i lines[GROUP_PAIRS];
      decode(p, w.table, lines);
      if (__builtin_expect(e[g] != end[g] && e[g]->group == q, 0)) patch(lines, e[g], end[g], q);
#pragma GCC unroll 4
      for (int j = 0; j < GROUP_PAIRS; ++j)
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const __m512i xb = _mm512_set1_epi32(gemv::load_pair(x + m * ldx + 2 * (GROUP_PAIRS * q + j)));
          acc[j & 1][m][g] = vec::dot2(acc[j & 1][m][g], lines[j], xb);
        }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < G; ++g) {
      __m512 v = _mm512_add_ps(acc[0][m][g], acc[1][m][g]);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + nb[g] * 16));
      const __m256i h = vec::to_bf16(v);
      std::memcpy(out + m * ldo + nb[g] * 16, &h, sizeof(h));
    }
}

// MT <= 4 rows, blocks [b0, b1), streamed as gemv::packed_range does: one block after another, or (Streams::MANY)
// 2 at a time, prefetched ahead, while their 2 x 2 x MT accumulators fit the registers.
template <int MT>
inline void range(const bf16* x, int64_t ldx, const Matrix& w, int64_t b0, int64_t b1, const float* bias, bf16* out,
                  int64_t ldo) {
  int64_t nb = b0;
  const bool one = gemv::one_stream();
  if constexpr (MT <= 2)
    if (!one)
      for (; nb + 2 <= b1; nb += 2) {
        const int64_t ids[2] = {nb, nb + 1};
        blocks<2, MT, true>(x, ldx, w, ids, bias, out, ldo);
      }
  for (; nb < b1; ++nb) {
    const int64_t ids[1] = {nb};
    if (one)
      blocks<1, MT, false>(x, ldx, w, ids, bias, out, ldo);
    else
      blocks<1, MT, true>(x, ldx, w, ids, bias, out, ldo);
  }
}

inline void rows(int64_t M, const bf16* x, int64_t ldx, const Matrix& w, int64_t b0, int64_t b1, const float* bias,
                 bf16* out, int64_t ldo) {
  gemv::with_rows(M, [&](auto mt) { range<decltype(mt)::value>(x, ldx, w, b0, b1, bias, out, ldo); });
}

// Groups [q0, q1) of block nb as packed bf16 lines [4 (q1 - q0), 16, 2] (gemv.h) at dst, exceptions included: exactly
// those k-pairs of the packed matrix's block.
inline void unpack_groups(const Matrix& w, int64_t nb, int64_t q0, int64_t q1, bf16* dst) {
  const uint8_t* src = w.data + nb * w.groups * GROUP_BYTES;
  for (int64_t q = q0; q < q1; ++q) {
    __m512i lines[GROUP_PAIRS];
    decode(src + q * GROUP_BYTES, w.table, lines);
    for (int j = 0; j < GROUP_PAIRS; ++j) _mm512_storeu_si512(dst + (GROUP_PAIRS * (q - q0) + j) * 32, lines[j]);
  }
  uint16_t* words = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = w.index[nb]; i < w.index[nb + 1]; ++i) {
    const Exception& e = w.exceptions[i];
    if (e.group >= q0 && e.group < q1) words[(GROUP_PAIRS * (e.group - q0) + e.line) * 32 + e.word] = e.bits;
  }
}

// Block nb as packed bf16 lines [K/2, 16, 2] (gemv.h) at dst, exceptions included: exactly the packed matrix's block.
inline void unpack_block(const Matrix& w, int64_t nb, bf16* dst) { unpack_groups(w, nb, 0, w.groups, dst); }

}  // namespace compact
}  // namespace deploykit
