// The engine's in-memory layout of block-quantized weights (GGUF Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and
// the blob that carries a (possibly mixed-format) matrix through the torch ops.
//
// Weights are repacked once at load for vpdpbusd (u8 x s8 -> s32, 4 products per lane): a 64-byte "line" holds 16
// output rows x 4 consecutive k as unsigned bytes (byte r*4 + j = row r, k 4g + j), so one vpdpbusd with 4 int8
// activations broadcast accumulates 16 rows at once and no horizontal sum is needed (as gemv.h's bf16 lines).
// K is walked in units of 32 (one activation block, quant_act.h); a unit is 8 such lines (k-groups 0..7):
//   byte formats (Q8_0):  8 stored lines, value + 128 (so it is unsigned);
//   nibble formats:       4 stored lines, line g = k-group g in the low nibble and k-group g + 4 in the high one;
//     Q5_0/Q5_1/Q5_K add the 5th bits, 64 bytes a unit (a b-line: fifth_bit_of below), Q6_K
//     the top 2 bits as 2 h-lines (h-line h, bits 2s..2s+1 of byte r*4 + j = k-group 4h + s).
// Units are grouped into chunks that carry their scales after the quants, so a 16-row group is one contiguous
// stream of whole 64-byte lines (the file's bytes per weight, except Q4_K's and Q5_K's u8 sub-scales, 4.625 vs 4.5
// and 5.625 vs 5.5 bits, and Q6_K's padding to whole lines, 6.625 vs 6.5625 bits):
//   Q8_0  2 units: 16 lines | d0[16] d1[16] fp16                              1088 B per 16 x 64 weights
//   Q4_0  2 units:  8 lines | d0 d1                                            576 B
//   Q4_1  2 units:  8 lines | d0 d1 | m0 m1 (fp16, value = d q + m)            640 B
//   Q5_0  2 units:  8 lines | 5th bits (2 x 64 B) | d0 d1                      704 B
//   Q5_1  2 units:  8 lines | 5th bits | d0 d1 | m0 m1                         768 B
//   Q4_K  8 units: 32 lines | d[16] dmin[16] fp16 | sc[8][16] m[8][16] u8      2368 B per 16 x 256 weights
//   Q5_K  8 units: 32 lines | 5th bits (8 x 64 B) | then Q4_K's scales        2880 B
//   Q6_K  8 units: (4 lines + 2 h-lines) x 8 | sc[16][16] s8 | d[16] fp16 | pad 3392 B
// Each format's value: Q8_0 d (q - 128); Q4_0 d (q - 8); Q5_0 d (q - 16); Q4_1/Q5_1 d q + m;
// Q4_K and Q5_K (d sc_j) q - (dmin m_j) per 32; Q6_K d sc_i (q - 32) per 16.
//
// A matrix [N, K] is one uint8 blob: a 256-byte header (magic, N, K, parts) and then each part's 16-row groups,
// each group one stream of K / (32 * units per chunk) chunks. Parts let q, k and v (or gate and up) of different
// formats form one fused matrix, as Q4_K_M files mix them.
//
// Segmented blobs (SEGMENT_AT): where a group is longer than the L1 cache (down at K = 4864 is 43 KiB of Q4_0), the
// GEMV's stream evicts the activations it reuses for the next group, and reading them again from L2 left 0.77x of
// the read rate with DRAM fast (benchmarks/README.md, session 52). Such a part then holds its groups in panels of
// `panel` groups, each panel cut along K into segments of seg_k weights, stored segment-major: segment 0 of each of
// the panel's groups, then segment 1 of each, ... The batch-1 GEMV walks a panel in that order (quant_rows.h panel):
// one sequential stream whose activations for one segment (~1 KiB) stay in L1 across the panel. Every kernel reaches
// a chunk through Part::at / Part::segments, and sums each group's units in the same order, so every product is
// bitwise what the plain layout gives. An interleaved blob's two parts share one array of slots (gate group j at slot
// 2 j, up group j at 2 j + 1), and its panels are of slots.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace deploykit {
namespace quant {

// ggml type ids (deploykit/gguf.py GGML_TYPES).
enum Format : int32_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Info {
  int32_t units;        // 32-weight units per chunk
  int32_t chunk_bytes;  // bytes per chunk of one 16-row group
  int32_t file_block;   // weights per block in the GGUF file
  int32_t file_bytes;   // bytes per block in the GGUF file
};

inline bool known(int32_t f) {
  return f == Q4_0 || f == Q4_1 || f == Q5_0 || f == Q5_1 || f == Q8_0 || f == Q4_K || f == Q5_K || f == Q6_K;
}

// The formats whose codes carry a fifth bit in b-lines after a chunk's lines, and where a chunk's b-lines start.
constexpr bool fifth_bit(int32_t f) { return f == Q5_0 || f == Q5_1 || f == Q5_K; }
constexpr int64_t fifth_at(int32_t f) { return f == Q5_K ? 2048 : 512; }
// A unit's 64 bytes of 5th bits (at fifth_at(F) + 64 u of its chunk) are a "b-line", in every build: byte r*4 + j,
// bit e = the 5th bit of row r, k 4e + j, as Q6_K's h-lines hold its top bits. A nibble plane's 5th bits are then
// one GF2P8AFFINEQB of the unit's b-line (AVX-512 builds on CPUs with GFNI), or a 16-bit shift and an AND of it
// (quant_gemv.h or_fifth; quant_gemv_avx2.h fifth_bits). Until session 57 the AVX-512 builds held 8 u64 masks a
// unit, one kmask a plane: on Zen 4 the b-line through GFNI took Q5_0 from 8.4 to 7.2 ns a unit (7.0 with its chain
// started at its offset, quant_gemv.h; benchmarks/README.md).
inline int fifth_bit_of(const uint8_t* unit_bits, int r, int k) {  // row r, k 0..31 of the unit
  return (unit_bits[r * 4 + k % 4] >> (k / 4)) & 1;
}
inline void set_fifth_bit(uint8_t* unit_bits, int r, int k) {  // into zeroed bytes
  unit_bits[r * 4 + k % 4] |= static_cast<uint8_t>(1 << (k / 4));
}
// Where a K-quant chunk's d, dmin and sub-scales start (Q4_K and Q5_K): after its lines and b-lines.
constexpr int64_t kscales_at(int32_t f) { return f == Q5_K ? 2560 : 2048; }

constexpr Info info_of(int32_t f) {
  switch (f) {
    case Q8_0: return {2, 1088, 32, 34};
    case Q4_0: return {2, 576, 32, 18};
    case Q4_1: return {2, 640, 32, 20};
    case Q5_0: return {2, 704, 32, 22};
    case Q5_1: return {2, 768, 32, 24};
    case Q4_K: return {8, 2368, 256, 144};
    case Q5_K: return {8, 2880, 256, 176};
    case Q6_K: return {8, 3392, 256, 210};
    default: return {0, 0, 0, 0};
  }
}

inline Info info(int32_t f) {
  TORCH_CHECK(known(f), "unsupported quantized format ", f);
  return info_of(f);
}

// fn(std::integral_constant<int, F>{}) for the known format id f: a part's format made compile-time, for every kernel
// that walks parts (quant_rows.h, quant_amx.h).
template <class Fn>
inline void with_format(int32_t f, Fn&& fn) {
  switch (f) {
    case Q8_0: return fn(std::integral_constant<int, Q8_0>{});
    case Q4_0: return fn(std::integral_constant<int, Q4_0>{});
    case Q4_1: return fn(std::integral_constant<int, Q4_1>{});
    case Q5_0: return fn(std::integral_constant<int, Q5_0>{});
    case Q5_1: return fn(std::integral_constant<int, Q5_1>{});
    case Q4_K: return fn(std::integral_constant<int, Q4_K>{});
    case Q5_K: return fn(std::integral_constant<int, Q5_K>{});
    case Q6_K: return fn(std::integral_constant<int, Q6_K>{});
  }
}

constexpr int64_t HEADER_BYTES = 256;
constexpr int32_t MAGIC = 0x3151'4b44;  // "DKQ1"
constexpr int MAX_PARTS = 12;

// Header: int32 magic, N, K, parts; then per part int32 format, rows, int64 offset (from the blob start); at
// INTERLEAVED_AT an int32, 1 where the blob's two parts (one format, as many rows each) lie group by group, group g
// of part 0 then group g of part 1: gate_up's gate and up halves, so that the fused decode step, which takes gate block
// j and up block j together, reads one sequential stream (step_matrix.h gate_up_columns). 0 in older blobs: the
// header is zeroed.
constexpr int64_t INTERLEAVED_AT = 16 + MAX_PARTS * 16;
// At SEGMENT_AT two int32: seg_k, the weights of a segment (a multiple of 256, so of every format's chunk; 0: not
// segmented), and panel, the groups (slots) of a panel. 0 in older blobs.
constexpr int64_t SEGMENT_AT = INTERLEAVED_AT + 4;
static_assert(SEGMENT_AT + 8 <= HEADER_BYTES);
constexpr int64_t MAX_PANEL = 8;  // the most groups a panel holds (quant_rows.h keeps a panel's sums on the stack)

struct Part {
  int32_t format;
  int64_t row0, rows;   // rows [row0, row0 + rows) of the matrix, multiples of 16
  const uint8_t* data;  // unsegmented: group g of this part at data + g * group_stride
  int64_t group_bytes;  // one group's bytes
  int64_t group_stride; // group_bytes, or 2 group_bytes in an interleaved blob
  // The slot array the part's groups lie in: group g is slot g * ways + way of nslots, from `slots` on.
  const uint8_t* slots;
  int64_t ways, way, nslots;
  int64_t chunks, chunk_bytes;  // a group's chunks and their bytes
  int64_t seg, panel;           // chunks a segment (chunks: not segmented) and slots a panel

  bool segmented() const { return seg < chunks; }
  // Chunk c of group g, followed in memory by the rest of c's segment.
  const uint8_t* at(int64_t g, int64_t c) const {
    if (!segmented()) return data + g * group_stride + c * chunk_bytes;
    const int64_t s = g * ways + way, p0 = s - s % panel, gp = std::min(panel, nslots - p0);
    const int64_t c0 = c - c % seg, len = std::min(seg, chunks - c0);
    return slots + p0 * group_bytes + (gp * c0 + (s - p0) * len + (c - c0)) * chunk_bytes;
  }
  // fn(base, c0, c1) over the segments of group g's chunks [begin, end): chunk c of [c0, c1) at base + c chunk_bytes.
  template <class Fn>
  void segments(int64_t g, int64_t begin, int64_t end, Fn&& fn) const {
    for (int64_t c0 = begin; c0 < end;) {
      const int64_t c1 = std::min(end, (c0 / seg + 1) * seg);
      fn(at(g, c0) - c0 * chunk_bytes, c0, c1);
      c0 = c1;
    }
  }
};

struct Matrix {
  int64_t N, K;
  int nparts;
  Part parts[MAX_PARTS];
  bool interleaved;  // two parts, group by group (INTERLEAVED_AT)
  int32_t seg_k, panel;  // SEGMENT_AT (0, 0: not segmented)
};

inline int64_t group_bytes(int32_t format, int64_t K) {
  const Info i = info(format);
  return K / (32 * i.units) * i.chunk_bytes;
}

inline bool is_blob(const at::Tensor& t) { return t.defined() && t.scalar_type() == at::kByte && t.dim() == 1; }

inline Matrix matrix(const at::Tensor& blob) {
  TORCH_CHECK(is_blob(blob) && blob.is_contiguous() && blob.numel() >= HEADER_BYTES,
              "a quantized weight must be a contiguous uint8 blob made by quant_pack");
  const uint8_t* base = blob.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 64 == 0, "a quantized weight blob must be 64-byte aligned");
  int32_t h[4];
  std::memcpy(h, base, sizeof(h));
  TORCH_CHECK(h[0] == MAGIC && h[3] >= 1 && h[3] <= MAX_PARTS, "not a quantized weight blob (bad header)");
  int32_t interleaved;
  std::memcpy(&interleaved, base + INTERLEAVED_AT, sizeof(interleaved));
  TORCH_CHECK(interleaved == 0 || (interleaved == 1 && h[3] == 2), "bad interleave flag in a quantized weight blob");
  int32_t sp[2];
  std::memcpy(sp, base + SEGMENT_AT, sizeof(sp));
  TORCH_CHECK(sp[0] == 0 ? sp[1] == 0 : sp[0] > 0 && sp[0] % 256 == 0 && sp[1] >= 1 && sp[1] <= MAX_PANEL,
              "bad segments in a quantized weight blob");
  Matrix m{h[1], h[2], h[3], {}, interleaved == 1, sp[0], sp[1]};
  const int64_t ways = m.interleaved ? 2 : 1;
  int64_t row = 0;
  for (int p = 0; p < m.nparts; ++p) {
    int32_t fr[2];
    int64_t off;
    std::memcpy(fr, base + 16 + p * 16, sizeof(fr));
    std::memcpy(&off, base + 16 + p * 16 + 8, sizeof(off));
    TORCH_CHECK(known(fr[0]) && fr[1] > 0 && fr[1] % 16 == 0, "bad part ", p, " in a quantized weight blob");
    const int64_t gb = group_bytes(fr[0], m.K);
    TORCH_CHECK(off >= HEADER_BYTES && off % 64 == 0 && off + (fr[1] / 16 * ways - ways + 1) * gb <= blob.numel(),
                "part ", p, " lies outside its quantized weight blob");
    const Info inf = info(fr[0]);
    const int64_t chunks = m.K / (32 * inf.units), way = m.interleaved ? p : 0;
    const int64_t seg = m.seg_k > 0 ? std::min<int64_t>(chunks, m.seg_k / (32 * inf.units)) : chunks;
    m.parts[p] = Part{fr[0], row, fr[1], base + off, gb, ways * gb, base + off - way * gb, ways, way,
                      fr[1] / 16 * ways, chunks, inf.chunk_bytes, seg, std::max(1, m.panel)};
    row += fr[1];
  }
  TORCH_CHECK(row == m.N, "the parts of a quantized weight blob do not add up to its ", m.N, " rows");
  TORCH_CHECK(!m.interleaved || (m.parts[0].format == m.parts[1].format && m.parts[0].rows == m.parts[1].rows &&
                                 m.parts[1].data == m.parts[0].data + m.parts[0].group_bytes),
              "an interleaved quantized weight blob takes two parts of one format and size, one group apart");
  return m;
}

// The part holding 16-row group `g` (row 16 g).
inline const Part& part_of(const Matrix& m, int64_t g) {
  int p = 0;
  while (p + 1 < m.nparts && 16 * g >= m.parts[p + 1].row0) ++p;
  return m.parts[p];
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

}  // namespace quant

// Row `row` of the whole matrix as K floats (quant_pack.cpp): the embedding lookup of a quantized token table.
void dequant_row(const quant::Matrix& m, int64_t row, float* out);

}  // namespace deploykit
