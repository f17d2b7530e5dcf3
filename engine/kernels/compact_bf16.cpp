// Compact bf16 weights (compact_bf16.h): packing at load, unpacking, and the matmul for every M.
//
// Up to 4 rows stream the compact lines straight into the GEMV (the batch-1 decode path, bound by bytes read); more
// rows do so up to 8 at a time, block by block, each tile decoding the block again from L2 while the first pulls the
// next block in (a 16-row decode step: 0.98x the packed kernels' time, benchmarks/compact.py, Zen 4). From
// decode_min_m rows on (prefill) each pair of blocks is decoded once into a buffer that 7-row tiles read, which pays
// only when many tiles share it (below 96 rows, decoding again in every tile was as fast or faster). Every path sums
// in the same order (compact_bf16.h), so a row's output never depends on the rows beside it or on the path.
// On a CPU with AMX the whole op runs on its tiles instead, at every M (compact_amx.h), in the tiles' one order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "compact_amx.h"
#include "compact_bf16.h"
#include "gemv.h"
#include "op_args.h"

namespace deploykit {
namespace {

using namespace compact;

// Rows per tile from 5 rows on; 4 rows at a time measured 1.2-1.4x the packed kernels at 16 rows (each tile decodes
// the block again), two blocks of 4 rows spilled registers (1.35x), and without pulling the next block into L2 the
// 16-row step took 1.5x.
constexpr int64_t TILE_ROWS = 8;

// From this many rows on (prefill), each pair of blocks is decoded once into a per-thread buffer in L2 and tiles of 7
// rows read its 16-bit lines: 2 chains x 7 rows x 2 blocks = 28 accumulators, one x broadcast per 2 dot products.
// The 8-row tiles decode every line again for each tile and need a broadcast per dot product. Measured over the
// benchmark model's 4 matrix shapes (Zen 4, 2 threads, paired in one process): 0.925x the tiles' time at 512 rows
// (0.443 against 0.431 TFLOP/s; packed 16-bit 0.445), 0.93x at 128, even at 96, 1.01x at 64, 1.06x at 32. Other
// shapes against the tiles at 512 rows: 4 blocks x 3 rows 1.14x (each k-pair reads 4 lines from L2 for 12 dot
// products), 1 x 8 1.09x, 2 x 6 0.98x, this one 0.93x. Runtime-settable, so both paths can be compared (and tested
// bitwise) in one process.
std::atomic<int64_t> decode_min_m{96};
constexpr int DECODED_BLOCKS = 2;
constexpr int DECODED_ROWS = 7;

// out[m, 16 (nb0 + g) + j] for G blocks decoded block after block at `lines` (unpack_block's layout) and MT rows,
// summed as blocks<> sums (even and odd k-pairs in two chains, added at the end): bitwise blocks<>'s result.
// next/per: `per` lines of the next group's compact bytes to request into L2 per k-pair (or next = nullptr).
template <int G, int MT>
inline void decoded_blocks(const bf16* x, int64_t ldx, const bf16* lines, int64_t Kh, int64_t nb0, const float* bias,
                           bf16* out, int64_t ldo, const char* next, int per) {
  __m512 acc[2][MT][G];
  for (int c = 0; c < 2; ++c)
    for (int m = 0; m < MT; ++m)
      for (int g = 0; g < G; ++g) acc[c][m][g] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < Kh; kp += 2) {
    if (next)
      for (int i = 0; i < 2 * per; ++i) _mm_prefetch(next + (kp * per + i) * 64, _MM_HINT_T1);
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      __m512i w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_load_si512(lines + (g * Kh + kp + c) * 32);
      for (int m = 0; m < MT; ++m) {
        const __m512i xb = _mm512_set1_epi32(gemv::load_pair(x + m * ldx + 2 * (kp + c)));
        for (int g = 0; g < G; ++g) acc[c][m][g] = vec::dot2(acc[c][m][g], w[g], xb);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int g = 0; g < G; ++g) {
      __m512 v = _mm512_add_ps(acc[0][m][g], acc[1][m][g]);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + (nb0 + g) * 16));
      const __m256i h = vec::to_bf16(v);
      std::memcpy(out + m * ldo + (nb0 + g) * 16, &h, sizeof(h));
    }
}

// Blocks [nb0, nb0 + G) for all M rows: decode them into `buf` (G x K x 32 bytes, 64-byte aligned), then tiles of
// DECODED_ROWS rows; the first tile requests the next group's compact bytes (`next`, `next_bytes`) into L2.
template <int G>
inline void decoded_group(int64_t M, const bf16* x, int64_t ldx, const Matrix& w, int64_t nb0, const float* bias,
                          bf16* out, int64_t ldo, bf16* buf, const uint8_t* next, int64_t next_bytes) {
  const int64_t Kh = w.K / 2;
  for (int g = 0; g < G; ++g) unpack_block(w, nb0 + g, buf + g * Kh * 32);
  // Lines of the next group per k-pair of the first tile: its G x Kh x 48 bytes over Kh k-pairs.
  const int per = next ? static_cast<int>((next_bytes + Kh * 64 - 1) / (Kh * 64)) : 0;
  for (int64_t m = 0; m < M; m += DECODED_ROWS) {
    const char* pf = m == 0 ? reinterpret_cast<const char*>(next) : nullptr;
    gemv::with_rows<DECODED_ROWS>(std::min<int64_t>(DECODED_ROWS, M - m), [&](auto mt) {
      decoded_blocks<G, decltype(mt)::value>(x + m * ldx, ldx, buf, Kh, nb0, bias, out + m * ldo, ldo, pf, per);
    });
  }
}

}  // namespace

// packed [N/16, K/2, 16, 2] bf16 (gemv.h) -> a compact blob, or an empty int8 tensor when more than max_escapes of
// the weights fall outside the 15 most common high bytes (the matrix then stays packed: each escape costs 8 bytes
// and a patch).
at::Tensor compact_pack(const at::Tensor& packed, double max_escapes) {
  op_args::check_packed(packed);
  const int64_t NB = packed.size(0), Kh = packed.size(1), N = NB * 16, K = Kh * 2;
  TORCH_CHECK(K % 8 == 0, "compact bf16 needs K to be a multiple of 8, got ", K);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t total = N * K, groups = K / 8;

  // The high bytes' histogram, then the 15 most common (ties to the smaller byte, so packing is deterministic).
  std::vector<std::array<int64_t, 256>> parts(at::get_num_threads(), std::array<int64_t, 256>{});
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    auto& h = parts[at::get_thread_num()];
    for (int64_t i = b0 * Kh * 32; i < b1 * Kh * 32; ++i) ++h[src[i] >> 8];
  });
  std::array<int64_t, 256> hist{};
  for (const auto& h : parts)
    for (int v = 0; v < 256; ++v) hist[v] += h[v];
  std::array<int, 256> order;
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return hist[a] > hist[b]; });
  std::array<uint8_t, 256> code;
  code.fill(ESCAPE);
  uint8_t table[16] = {};
  int64_t kept = 0;
  for (int c = 0; c < ESCAPE; ++c) {
    code[order[c]] = (uint8_t)c;
    table[c] = (uint8_t)order[c];
    kept += hist[order[c]];
  }
  const int64_t escapes = total - kept;
  if ((double)escapes > max_escapes * (double)total) return at::empty({0}, packed.options().dtype(at::kChar));

  std::vector<int64_t> index(NB + 1, 0);
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t n = 0;
      for (int64_t i = b * Kh * 32; i < (b + 1) * Kh * 32; ++i) n += code[src[i] >> 8] == ESCAPE;
      index[b + 1] = n;
    }
  });
  std::partial_sum(index.begin(), index.end(), index.begin());
  const int64_t index_off = HEADER_BYTES + NB * groups * GROUP_BYTES;
  const int64_t exc_off = index_off + (NB + 1) * 8;
  const int64_t bytes = (exc_off + escapes * (int64_t)sizeof(Exception) + 63) / 64 * 64;
  at::Tensor blob = at::zeros({bytes}, packed.options().dtype(at::kChar));
  uint8_t* base = reinterpret_cast<uint8_t*>(blob.data_ptr<int8_t>());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 64 == 0, "the allocator returned an unaligned blob");
  const int32_t head[4] = {MAGIC, (int32_t)N, (int32_t)K, 0};
  const int64_t offs[3] = {index_off, exc_off, escapes};
  std::memcpy(base, head, sizeof(head));
  std::memcpy(base + 16, table, sizeof(table));
  std::memcpy(base + 32, offs, sizeof(offs));
  std::memcpy(base + index_off, index.data(), index.size() * 8);
  Exception* exc = reinterpret_cast<Exception*>(base + exc_off);
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      Exception* e = exc + index[b];
      for (int64_t q = 0; q < groups; ++q) {
        uint8_t* g = base + HEADER_BYTES + (b * groups + q) * GROUP_BYTES;
        const uint16_t* lines = src + (b * Kh + q * GROUP_PAIRS) * 32;  // 4 lines of 32 words
        for (int line = 0; line < GROUP_PAIRS; ++line)
          for (int word = 0; word < 32; ++word) {
            const uint16_t v = lines[line * 32 + word];
            const uint8_t c = code[v >> 8];
            const int p = position(line, word), half = line / 2;
            g[half * 64 + p] = c == ESCAPE ? 0 : (uint8_t)(v & 0xFF);
            g[128 + p] |= (uint8_t)(c << (4 * half));
            if (c == ESCAPE) *e++ = Exception{(int32_t)q, (uint8_t)line, (uint8_t)word, v};
          }
      }
    }
  });
  return blob;
}

// A compact blob -> the packed [N/16, K/2, 16, 2] bf16 matrix it holds, bit for bit.
at::Tensor compact_unpack(const at::Tensor& blob) {
  const Matrix w = matrix(blob);
  const int64_t NB = w.N / 16, Kh = w.K / 2;
  at::Tensor out = at::empty({NB, Kh, 16, 2}, blob.options().dtype(at::kBFloat16));
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) unpack_block(w, b, o + b * Kh * 32);
  });
  return out;
}

// Rows ids [n] of the [N, K] matrix a compact blob holds -> [n, K] bf16, bit for bit (the lookup of an embedding tied
// to a compact lm_head). Row r is column r % 16 of block r / 16: words 2 (r % 16) and 2 (r % 16) + 1 of every line.
at::Tensor compact_rows(const at::Tensor& blob, const at::Tensor& ids) {
  const Matrix w = matrix(blob);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "compact_rows needs int64 ids [n]");
  const at::Tensor idc = ids.contiguous();
  const int64_t n = idc.numel(), K = w.K, *id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < w.N, "token id ", id[i], " is outside the vocabulary [0, ", w.N, ")");
  at::Tensor out = at::empty({n, K}, blob.options().dtype(at::kBFloat16));
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<bf16>());
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) row(w, id[i], o + i * K);
  });
  return out;
}

// [N, K, exceptions] of a compact blob.
std::vector<int64_t> compact_info(const at::Tensor& blob) {
  const Matrix w = matrix(blob);
  return {w.N, w.K, w.count};
}

// x [M, K] bf16, a compact blob [N, K], bias [N] or None -> [M, N] bf16.
at::Tensor compact_linear(const at::Tensor& x, const at::Tensor& blob, const std::optional<at::Tensor>& bias) {
  const Matrix w = matrix(blob);
  if (compact_amx::on(w)) return compact_linear_amx(x, blob, bias);  // every M, so a row's bits never depend on M
  const int64_t NB = w.N / 16, N = w.N, M = x.size(0);
  const op_args::Operands args = op_args::operands(x, w.K, N, bias);
  if (M == 0) return args.out;
  const bf16* xp = args.x;
  const int64_t ldx = args.ldx;
  if (M <= 4) {
    at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) { rows(M, xp, ldx, w, b0, b1, args.b, args.o, N); });
    return args.out;
  }
  if (M >= decode_min_m.load(std::memory_order_relaxed)) {
    // Groups of DECODED_BLOCKS blocks (the last may be shorter), each decoded once into this thread's buffer.
    const int64_t Kh = w.K / 2, groups = (NB + DECODED_BLOCKS - 1) / DECODED_BLOCKS;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      bf16* buf = static_cast<bf16*>(std::aligned_alloc(64, DECODED_BLOCKS * Kh * 64));
      TORCH_CHECK(buf, "compact_linear: out of memory for a decode buffer");
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t nb0 = g * DECODED_BLOCKS, n = std::min<int64_t>(DECODED_BLOCKS, NB - nb0);
        const uint8_t* next = g + 1 < g1 ? w.data + (nb0 + DECODED_BLOCKS) * w.groups * GROUP_BYTES : nullptr;
        const int64_t next_bytes =
            next ? std::min<int64_t>(DECODED_BLOCKS, NB - nb0 - DECODED_BLOCKS) * w.groups * GROUP_BYTES : 0;
        gemv::with_rows<DECODED_BLOCKS>(n, [&](auto gt) {
          decoded_group<decltype(gt)::value>(M, xp, ldx, w, nb0, args.b, args.o, N, buf, next, next_bytes);
        });
      }
      std::free(buf);
    });
    return args.out;
  }
  // Block by block, every tile of up to 8 rows streams the block's compact lines (from L2 after the first tile): 8
  // rows x 2 chains = 16 accumulators share each decoded line. Tiles are as even as possible (9 rows: 5 + 4, not
  // 8 + 1, whose lone row waits on vdpbf16ps latency).
  const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t t = 0, m = 0; t < tiles; ++t) {
        const int64_t rows_t = M / tiles + (t < M % tiles);
        const int64_t ids[1] = {b};
        // The first tile pulls the next block into L2 (the later tiles find this one there).
        const uint8_t* next = t == 0 && b + 1 < b1 ? w.data + (b + 1) * w.groups * GROUP_BYTES : nullptr;
        gemv::with_rows<TILE_ROWS>(rows_t, [&](auto mt) {
          blocks<1, decltype(mt)::value, false>(xp + m * ldx, ldx, w, ids, args.b, args.o + m * N, N, next);
        });
        m += rows_t;
      }
  });
  return args.out;
}

// From how many rows compact_linear decodes each group of blocks once (prefill) instead of per 8-row tile.
void set_compact_decode_min_m(int64_t m) {
  TORCH_CHECK(m >= 5, "the decode-once path starts at 5 rows or more, not ", m);
  decode_min_m.store(m);
}

int64_t compact_decode_min_m() { return decode_min_m.load(); }

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("set_compact_decode_min_m(int m) -> ()", &set_compact_decode_min_m);
  m.def("compact_decode_min_m() -> int", &compact_decode_min_m);
  m.def("compact_pack(Tensor packed, float max_escapes) -> Tensor", &compact_pack);
  m.def("compact_unpack(Tensor blob) -> Tensor", &compact_unpack);
  m.def("compact_info(Tensor blob) -> int[]", &compact_info);
  m.def("compact_rows(Tensor blob, Tensor ids) -> Tensor", &compact_rows);
  m.def("compact_linear(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("compact_linear", &compact_linear); }

}  // namespace deploykit
