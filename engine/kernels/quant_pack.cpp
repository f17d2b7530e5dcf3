// Load-time side of quantized weights: GGUF blocks -> the engine's layout (quant_layout.h), and back to values for
// the rows an embedding lookup needs. Both run once per weight or per token row, so they are plain scalar code;
// the tests check them against llama.cpp's own dequantizer (the gguf package).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "quant_amx.h"  // enabled: whether quantized matmuls run on AMX tiles here
#include "quant_layout.h"

namespace deploykit {
namespace {

using namespace quant;

// One GGUF row decoded into unsigned codes (the stored convention of quant_layout.h) and its scales, raw fp16 bits
// or small integers, exactly as the file holds them.
struct Row {
  std::vector<uint8_t> q;               // [K]
  std::vector<uint16_t> d, m;           // per 32 (legacy) or per 256 (K-quants: d, dmin)
  std::vector<uint8_t> sc, mn;          // Q4_K, Q5_K: per 32, 6-bit
  std::vector<int8_t> sc6;              // Q6_K: per 16
};

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void decode_row(int32_t f, const uint8_t* src, int64_t K, Row& row) {
  row.q.assign(K, 0);
  const Info inf = info(f);
  const int64_t nb = K / inf.file_block;
  uint8_t* q = row.q.data();
  row.d.assign(nb, 0);
  row.m.assign(nb, 0);
  if (f == Q4_K || f == Q5_K) row.sc.assign(K / 32, 0), row.mn.assign(K / 32, 0);
  if (f == Q6_K) row.sc6.assign(K / 16, 0);
  for (int64_t b = 0; b < nb; ++b, src += inf.file_bytes) {
    uint8_t* y = q + b * inf.file_block;
    switch (f) {
      case Q8_0:  // d, int8[32]
        row.d[b] = u16(src);
        for (int j = 0; j < 32; ++j) y[j] = (uint8_t)((int)(int8_t)src[2 + j] + 128);
        break;
      case Q4_0:
      case Q4_1: {  // d, (m), nibbles: byte j = weight j (low) and weight j + 16 (high)
        row.d[b] = u16(src);
        const uint8_t* qs = src + (f == Q4_1 ? 4 : 2);
        if (f == Q4_1) row.m[b] = u16(src + 2);
        for (int j = 0; j < 16; ++j) y[j] = qs[j] & 15, y[j + 16] = qs[j] >> 4;
        break;
      }
      case Q5_0:
      case Q5_1: {  // d, (m), qh u32 (bit j = 5th bit of weight j), nibbles as Q4_0
        row.d[b] = u16(src);
        const int off = f == Q5_1 ? 4 : 2;
        if (f == Q5_1) row.m[b] = u16(src + 2);
        uint32_t qh;
        std::memcpy(&qh, src + off, 4);
        const uint8_t* qs = src + off + 4;
        for (int j = 0; j < 16; ++j) {
          y[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
          y[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
        break;
      }
      case Q4_K:
      case Q5_K: {  // d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks, (Q5_K: 32 bytes of fifth bits,)
                    // 128 bytes of nibbles
        row.d[b] = u16(src);
        row.m[b] = u16(src + 2);
        const uint8_t* s = src + 4;
        const uint8_t* qh = src + 16;  // Q5_K: byte l, bit j = fifth bit of weight l of sub-block j
        const uint8_t* qs = src + (f == Q5_K ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          uint8_t sc, mn;
          if (j < 4) {
            sc = s[j] & 63, mn = s[j + 4] & 63;
          } else {
            sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
            mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
          }
          row.sc[b * 8 + j] = sc, row.mn[b * 8 + j] = mn;
        }
        for (int p = 0; p < 4; ++p)  // 32 bytes per pair of sub-blocks: low nibbles 2p, high nibbles 2p + 1
          for (int l = 0; l < 32; ++l) y[64 * p + l] = qs[32 * p + l] & 15, y[64 * p + 32 + l] = qs[32 * p + l] >> 4;
        if (f == Q5_K)
          for (int j = 0; j < 8; ++j)
            for (int l = 0; l < 32; ++l) y[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
        break;
      }
      case Q6_K: {  // ql[128] low nibbles, qh[64] top 2 bits, scales s8[16] (per 16), d
        const uint8_t* ql = src;
        const uint8_t* qh = src + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
        row.d[b] = u16(src + 208);
        for (int i = 0; i < 16; ++i) row.sc6[b * 16 + i] = sc[i];
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32)
          for (int l = 0; l < 32; ++l) {
            uint8_t* z = y + 128 * half;
            z[l] = (ql[l] & 15) | (((qh[l] >> 0) & 3) << 4);
            z[l + 32] = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
            z[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            z[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
          }
        break;
      }
      default: TORCH_CHECK(false, "unsupported format ", f);
    }
  }
}

// Writers of one unit (32 k) of 16 rows; q(r, k) = the code of row r at k within the unit.
template <class Q>
void byte_lines(Q q, uint8_t* out) {  // 8 lines
  for (int e = 0; e < 8; ++e)
    for (int r = 0; r < 16; ++r)
      for (int j = 0; j < 4; ++j) out[e * 64 + r * 4 + j] = q(r, 4 * e + j);
}
template <class Q>
void nibble_lines(Q q, uint8_t* out) {  // 4 lines
  for (int g = 0; g < 4; ++g)
    for (int r = 0; r < 16; ++r)
      for (int j = 0; j < 4; ++j) out[g * 64 + r * 4 + j] = (q(r, 4 * g + j) & 15) | ((q(r, 16 + 4 * g + j) & 15) << 4);
}
template <class Q>
void fifth_bits(Q q, uint8_t* out) {  // 64 zeroed bytes, arranged as quant_layout.h's fifth_bit_of reads them
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < 32; ++k)
      if ((q(r, k) >> 4) & 1) set_fifth_bit(out, r, k);
}
template <class Q>
void top_bit_lines(Q q, uint8_t* out) {  // 2 lines
  std::memset(out, 0, 128);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int r = 0; r < 16; ++r)
        for (int j = 0; j < 4; ++j) out[h * 64 + r * 4 + j] |= ((q(r, 4 * (4 * h + s) + j) >> 4) & 3) << (2 * s);
}

// One 16-row group of `format` from 16 decoded rows into `out` (group_bytes(format, K) bytes).
void pack_group(int32_t f, const Row* rows, int64_t K, uint8_t* out) {
  const Info inf = info(f);
  for (int64_t c = 0; c < K / (32 * inf.units); ++c) {
    uint8_t* o = out + c * inf.chunk_bytes;
    std::memset(o, 0, inf.chunk_bytes);
    for (int u = 0; u < inf.units; ++u) {
      const int64_t k0 = (c * inf.units + u) * 32, unit = k0 / 32;
      auto q = [&](int r, int k) { return rows[r].q[k0 + k]; };
      auto put16 = [&](uint8_t* dst, auto value) {
        for (int r = 0; r < 16; ++r) {
          const uint16_t v = value(r);
          std::memcpy(dst + 2 * r, &v, 2);
        }
      };
      switch (f) {
        case Q8_0:
          byte_lines(q, o + u * 512);
          put16(o + 1024 + u * 32, [&](int r) { return rows[r].d[unit]; });
          break;
        case Q4_0:
        case Q4_1:
        case Q5_0:
        case Q5_1: {
          nibble_lines(q, o + u * 256);
          const bool five = f == Q5_0 || f == Q5_1;
          if (five) fifth_bits(q, o + 512 + u * 64);
          uint8_t* scales = o + 512 + (five ? 128 : 0);
          put16(scales + u * 32, [&](int r) { return rows[r].d[unit]; });
          if (f == Q4_1 || f == Q5_1) put16(scales + 64 + u * 32, [&](int r) { return rows[r].m[unit]; });
          break;
        }
        case Q4_K:
        case Q5_K: {
          nibble_lines(q, o + u * 256);
          if (f == Q5_K) fifth_bits(q, o + fifth_at(f) + u * 64);
          uint8_t* s = o + kscales_at(f);
          for (int r = 0; r < 16; ++r) s[64 + u * 16 + r] = rows[r].sc[unit], s[192 + u * 16 + r] = rows[r].mn[unit];
          if (u == 0) {
            put16(s, [&](int r) { return rows[r].d[c]; });
            put16(s + 32, [&](int r) { return rows[r].m[c]; });
          }
          break;
        }
        case Q6_K:
          nibble_lines(q, o + u * 384);
          top_bit_lines(q, o + u * 384 + 256);
          for (int half = 0; half < 2; ++half)
            for (int r = 0; r < 16; ++r) o[3072 + (2 * u + half) * 16 + r] = (uint8_t)rows[r].sc6[2 * unit + half];
          if (u == 0) put16(o + 3072 + 256, [&](int r) { return rows[r].d[c]; });
          break;
      }
    }
  }
}

}  // namespace

// The segments a blob of these parts gets when quant_pack is left to choose (segment_k < 0): segments of SEG_K
// weights in panels of PANEL groups where some part's group passes SEGMENT_ABOVE bytes, in the AVX-512 builds on CPUs
// whose quantized matmuls are not on AMX tiles (their batch-1 GEMV walks the panels, quant_rows.h). Measured on a
// 2-vCPU Zen 4 (benchmarks/README.md, session 52), a standalone Q4_0 GEMV at K = 4864, both threads, DRAM fast: plain
// groups 57-66 GB/s, its activations held in L1 (a timing-only copy) 73-85, panels of 4 groups in 4 segments 68-79,
// 8 groups 71-80 (a panel is the unit a thread claims, so 8 left two threads 4 and 3 of down's 7 panels), 2 groups
// 62-69; with DRAM slow all alike. In the batch-1 step a Q4_0 or Q8_0 token took ~0.97x the time with DRAM fast.
constexpr int32_t SEG_K = 1024, PANEL = 4;
constexpr int64_t SEGMENT_ABOVE = 20 << 10;

int32_t auto_segment_k(const std::vector<int64_t>& formats, int64_t K) {
#ifdef __AVX512F__
  if (quant_amx::enabled.load(std::memory_order_relaxed)) return 0;
  for (int64_t f : formats)
    if (group_bytes((int32_t)f, K) > SEGMENT_ABOVE) return SEG_K;
#endif
  (void)formats, (void)K;
  return 0;
}

// raws: per part, the GGUF bytes of its rows [rows, K / block * block_bytes] (uint8); formats: their ggml types.
// -> the uint8 blob of the [sum(rows), K] matrix (quant_layout.h), 64-byte aligned parts. interleave: two parts of
// one format and size stored group by group (quant_layout.h INTERLEAVED_AT). segment_k: the weights of a segment
// (quant_layout.h SEGMENT_AT; a multiple of 256) in panels of PANEL groups, 0 for none, or < 0 to let
// auto_segment_k choose. The matrix and every product with it are the same whatever the layout; only the order of
// its bytes in memory changes.
at::Tensor quant_pack(const std::vector<at::Tensor>& raws, const std::vector<int64_t>& formats, int64_t K,
                      bool interleave, int64_t segment_k) {
  TORCH_CHECK(!raws.empty() && raws.size() == formats.size() && (int)raws.size() <= MAX_PARTS,
              "quant_pack: one format per part, 1 to ", MAX_PARTS, " parts");
  TORCH_CHECK(!interleave || (raws.size() == 2 && formats[0] == formats[1] && raws[0].dim() == 2 &&
                              raws[1].dim() == 2 && raws[0].size(0) == raws[1].size(0)),
              "quant_pack: interleave takes two parts of one format and as many rows");
  std::vector<int64_t> offsets;
  int64_t size = HEADER_BYTES, N = 0;
  for (size_t p = 0; p < raws.size(); ++p) {
    const int32_t f = (int32_t)formats[p];
    TORCH_CHECK(known(f), "quant_pack: ggml type ", f, " is not kept quantized");
    const Info inf = info(f);
    TORCH_CHECK(K % (32 * inf.units) == 0, "quant_pack: K=", K, " is not a multiple of ", 32 * inf.units);
    const at::Tensor& r = raws[p];
    TORCH_CHECK(r.scalar_type() == at::kByte && r.dim() == 2 && r.is_contiguous() && r.size(0) % 16 == 0 &&
                    r.size(1) == K / inf.file_block * inf.file_bytes,
                "quant_pack: part ", p, " must be contiguous uint8 [rows (a multiple of 16), ",
                K / inf.file_block * inf.file_bytes, "]");
    offsets.push_back(interleave && p == 1 ? offsets[0] + group_bytes(f, K) : size);
    size += r.size(0) / 16 * group_bytes(f, K);
    N += r.size(0);
  }
  at::Tensor blob = at::zeros({size}, at::kByte);
  uint8_t* base = blob.data_ptr<uint8_t>();
  const int32_t head[4] = {MAGIC, (int32_t)N, (int32_t)K, (int32_t)raws.size()};
  std::memcpy(base, head, sizeof(head));
  const int32_t interleaved = interleave ? 1 : 0;
  std::memcpy(base + INTERLEAVED_AT, &interleaved, sizeof(interleaved));
  const int32_t seg_k = segment_k < 0 ? auto_segment_k(formats, K) : (int32_t)segment_k;
  TORCH_CHECK(seg_k >= 0 && seg_k % 256 == 0, "quant_pack: segment_k=", segment_k, " is not a multiple of 256");
  const int32_t segments[2] = {seg_k, seg_k > 0 ? PANEL : 0};
  std::memcpy(base + SEGMENT_AT, segments, sizeof(segments));
  for (size_t p = 0; p < raws.size(); ++p) {
    const int32_t fr[2] = {(int32_t)formats[p], (int32_t)raws[p].size(0)};
    std::memcpy(base + 16 + p * 16, fr, sizeof(fr));
    std::memcpy(base + 16 + p * 16 + 8, &offsets[p], 8);
  }
  const Matrix m = matrix(blob);  // the header as written: where each group's chunks go
  for (size_t p = 0; p < raws.size(); ++p) {
    const Part& part = m.parts[p];
    const uint8_t* src = raws[p].data_ptr<uint8_t>();
    const int64_t row_bytes = raws[p].size(1), gb = part.group_bytes;
    at::parallel_for(0, raws[p].size(0) / 16, 1, [&](int64_t g0, int64_t g1) {
      std::vector<Row> rows(16);
      std::vector<uint8_t> group(gb);
      for (int64_t g = g0; g < g1; ++g) {
        for (int r = 0; r < 16; ++r) decode_row(part.format, src + (g * 16 + r) * row_bytes, K, rows[r]);
        pack_group(part.format, rows.data(), K, group.data());
        part.segments(g, 0, part.chunks, [&](const uint8_t* at, int64_t c0, int64_t c1) {
          std::memcpy(const_cast<uint8_t*>(at) + c0 * part.chunk_bytes, group.data() + c0 * part.chunk_bytes,
                      (c1 - c0) * part.chunk_bytes);
        });
      }
    });
  }
  return blob;
}

// Row r (of the whole matrix) as K floats: the inverse of quant_pack, used for embedding lookups.
void dequant_row(const Matrix& m, int64_t row, float* out) {
  const Part& p = part_of(m, row / 16);
  const int r = (int)(row % 16);
  const int64_t g = (row - p.row0) / 16;
  const Info inf = info(p.format);
  for (int64_t c = 0; c < m.K / (32 * inf.units); ++c) {
    const uint8_t* o = p.at(g, c);
    for (int u = 0; u < inf.units; ++u) {
      float* y = out + (c * inf.units + u) * 32;
      auto nib = [&](const uint8_t* lines, int k) {  // 4 nibble lines: k-group g low, g + 4 high
        const int g = (k / 4) % 4, j = k % 4;
        const uint8_t v = lines[g * 64 + r * 4 + j];
        return k < 16 ? v & 15 : v >> 4;
      };
      switch (p.format) {
        case Q8_0: {
          const float d = half(o + 1024 + u * 32 + 2 * r);
          for (int k = 0; k < 32; ++k) y[k] = d * (float)((int)o[u * 512 + (k / 4) * 64 + r * 4 + k % 4] - 128);
          break;
        }
        case Q4_0:
        case Q4_1:
        case Q5_0:
        case Q5_1: {
          const bool five = p.format == Q5_0 || p.format == Q5_1, offset = p.format == Q4_1 || p.format == Q5_1;
          const uint8_t* scales = o + 512 + (five ? 128 : 0);
          const float d = half(scales + u * 32 + 2 * r), mn = offset ? half(scales + 64 + u * 32 + 2 * r) : 0.0f;
          for (int k = 0; k < 32; ++k) {
            int q = nib(o + u * 256, k);
            if (five) q |= fifth_bit_of(o + 512 + u * 64, r, k) << 4;
            y[k] = offset ? d * (float)q + mn : d * (float)(q - (five ? 16 : 8));
          }
          break;
        }
        case Q4_K:
        case Q5_K: {
          const uint8_t* s = o + kscales_at(p.format);
          const float d = half(s + 2 * r) * (float)s[64 + u * 16 + r];
          const float mn = half(s + 32 + 2 * r) * (float)s[192 + u * 16 + r];
          for (int k = 0; k < 32; ++k) {
            int q = nib(o + u * 256, k);
            if (p.format == Q5_K) q |= fifth_bit_of(o + fifth_at(Q5_K) + u * 64, r, k) << 4;
            y[k] = d * (float)q - mn;
          }
          break;
        }
        case Q6_K: {
          const float d = half(o + 3072 + 256 + 2 * r);
          const uint8_t* lines = o + u * 384;
          for (int k = 0; k < 32; ++k) {
            const int e = k / 4, hi = (lines[256 + (e / 4) * 64 + r * 4 + k % 4] >> (2 * (e % 4))) & 3;
            const int sc = (int8_t)o[3072 + (2 * u + k / 16) * 16 + r];
            y[k] = d * (float)sc * (float)((nib(lines, k) | (hi << 4)) - 32);
          }
          break;
        }
      }
    }
  }
}

// blob [N, K] quantized, ids int64 [n] -> [n, K] in `dtype` (bf16 or fp32): the embedding lookup of a quantized
// (possibly tied) token table.
at::Tensor quant_rows(const at::Tensor& blob, const at::Tensor& ids, at::ScalarType dtype) {
  const Matrix m = matrix(blob);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be an int64 [n] tensor");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "quant_rows returns bf16 or fp32");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.size(0);
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < m.N, "token id ", id[i], " out of range");
  at::Tensor out = at::empty({n, m.K}, at::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequant_row(m, id[i], o + i * m.K);
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// The blob's shape, whether its two parts are interleaved (1 or 0), and its parts' (format, rows) pairs flattened, for
// Python to describe a weight.
std::vector<int64_t> quant_parts(const at::Tensor& blob) {
  const Matrix m = matrix(blob);
  std::vector<int64_t> out{m.N, m.K, m.interleaved ? 1 : 0};
  for (int p = 0; p < m.nparts; ++p) out.push_back(m.parts[p].format), out.push_back(m.parts[p].rows);
  return out;
}

// [seg_k, panel] of the blob (quant_layout.h SEGMENT_AT; [0, 0]: not segmented).
std::vector<int64_t> quant_segments(const at::Tensor& blob) {
  const Matrix m = matrix(blob);
  return {m.seg_k, m.panel};
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("quant_pack(Tensor[] raws, int[] formats, int K, bool interleave=False, int segment_k=-1) -> Tensor");
  m.def("quant_rows(Tensor blob, Tensor ids, ScalarType dtype) -> Tensor");
  m.def("quant_parts(Tensor blob) -> int[]");
  m.def("quant_segments(Tensor blob) -> int[]");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_rows", &quant_rows);
  m.impl("quant_parts", &quant_parts);
  m.impl("quant_segments", &quant_segments);
}

}  // namespace deploykit
