// Compact bf16 weights (compact_bf16.h): packing at load, unpacking, and the matmul for every M.
//
// Up to 4 rows stream the compact lines straight into the GEMV (the batch-1 decode path, bound by bytes read); more
// rows do so up to 8 at a time, block by block, each tile decoding the block again from L2 while the first pulls the
// next block in. Measured on the benchmark model (benchmarks/compact.py, Zen 4): a 16-row decode step 0.98x the
// packed kernels' time, a 512-token prefill 1.05-1.14x. Decoding once into a packed tile in L2 and running 16-bit
// tiles over it was slower at every M from 5 to 64 (1.15-1.6x: storing and reloading the tile cost more than decoding
// again). Every path sums in the same order (compact_bf16.h), so a row's output never depends on the rows beside it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <numeric>
#include <vector>

#include "compact_bf16.h"
#include "gemv.h"
#include "op_args.h"

namespace deploykit {
namespace {

using namespace compact;

// Byte position in a group's A/B half (and in C) of word `word` of line `line % 2`: A[16 L + i] is line 0's word
// 8 L + i for i < 8 and line 1's word 8 L + i - 8 for i >= 8 (the order vpunpck{l,h}bw undo).
inline int position(int line, int word) { return (word / 8) * 16 + (line % 2) * 8 + word % 8; }

// Rows per tile from 5 rows on; 4 rows at a time measured 1.2-1.4x the packed kernels at 16 rows (each tile decodes
// the block again), two blocks of 4 rows spilled registers (1.35x), and without pulling the next block into L2 the
// 16-row step took 1.5x.
constexpr int64_t TILE_ROWS = 8;

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

// [N, K, exceptions] of a compact blob.
std::vector<int64_t> compact_info(const at::Tensor& blob) {
  const Matrix w = matrix(blob);
  return {w.N, w.K, w.count};
}

// x [M, K] bf16, a compact blob [N, K], bias [N] or None -> [M, N] bf16.
at::Tensor compact_linear(const at::Tensor& x, const at::Tensor& blob, const std::optional<at::Tensor>& bias) {
  const Matrix w = matrix(blob);
  const int64_t NB = w.N / 16, N = w.N, M = x.size(0);
  const op_args::Operands args = op_args::operands(x, w.K, N, bias);
  if (M == 0) return args.out;
  const bf16* xp = args.x;
  const int64_t ldx = args.ldx;
  if (M <= 4) {
    at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) { rows(M, xp, ldx, w, b0, b1, args.b, args.o, N); });
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

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("compact_pack(Tensor packed, float max_escapes) -> Tensor", &compact_pack);
  m.def("compact_unpack(Tensor blob) -> Tensor", &compact_unpack);
  m.def("compact_info(Tensor blob) -> int[]", &compact_info);
  m.def("compact_linear(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("compact_linear", &compact_linear); }

}  // namespace deploykit
