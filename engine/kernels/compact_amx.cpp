// compact_linear on AMX tiles (compact_amx.h) for every M, and the switch that turns it on.
//
// Up to 32 rows, x is read in place and each thread decodes its column blocks' k-tiles into L1 as the tiles take
// them. Past 32 rows (prefill), x is copied into tile blocks and each pair of column blocks is decoded once into a
// per-thread L2 buffer (K x 64 bytes: 56 KiB at K = 896, 304 KiB at K = 4864) that every 32-row block of the chunk
// reads; amx_bf16.cpp's chunking keeps the x chunk in L2 beside it. Both give each row the same tdpbf16ps sequence.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>

#include "compact_amx.h"
#include "op_args.h"

namespace deploykit {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

using bf16 = at::BFloat16;

// From this many 32-row blocks in a chunk on, a pair of column blocks is decoded once into L2 for all of them;
// below, every block's tiles decode the pair's k-tiles again as they go, which overlaps the decode with the tile
// work. Measured on a 2-core Sapphire Rapids over the benchmark model's 4 matrix shapes against the packed 16-bit
// AMX kernel: decoding again 1.05-1.09x its time at 64 rows (once: 1.21-1.25x), even at 128 rows, decoding once
// 1.06-1.09x at 512 rows with K = 896 (13 blocks a chunk; again: 1.15-1.21x); K = 4864 (2 blocks a chunk) 1.05x
// decoding again, 1.30x once. Runtime-settable so that tests compare both paths bitwise.
std::atomic<int64_t> decode_once_min_blocks{4};

// x [M, K] bf16, a compact blob [N, K] with K % 32 == 0, bias [N] or None -> [M, N] bf16.
at::Tensor compact_linear_amx(const at::Tensor& x, const at::Tensor& blob, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_init(), "AMX tile state was not granted by the OS");
  const compact::Matrix w = compact::matrix(blob);
  TORCH_CHECK(w.K % op_args::BLOCK_K == 0, "the AMX path needs K % ", op_args::BLOCK_K, " == 0, got K=", w.K);
  const int64_t NB = w.N / 16, N = w.N, M = x.size(0), Kh = w.K / 2, pairs = (NB + 1) / 2;
  const op_args::Operands args = op_args::operands(x, w.K, N, bias);
  if (M == 0) return args.out;
  if (M <= 32) {
    at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
      compact_amx::rows(M, args.x, args.ldx, w, 2 * p0, std::min(NB, 2 * p1), args.b, args.o, N);
    });
    return args.out;
  }
  const at::Tensor xb = amx_block_x(x);  // zero-padded to whole 32-row blocks
  const bf16* xbp = xb.data_ptr<bf16>();
  const int64_t mblocks = (M + 31) / 32, chunk = amx::chunk_blocks(w.K);
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    bf16* buf = static_cast<bf16*>(std::aligned_alloc(64, 2 * Kh * 64));
    TORCH_CHECK(buf, "compact_linear_amx: out of memory for a decode buffer");
    {
      compact_amx::Tiles tiles(16, 16);
      for (int64_t c0 = 0; c0 < mblocks; c0 += chunk)
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t nb[2] = {2 * p, 2 * p + 1};
          const int n = nb[1] < NB ? 2 : 1;
          const int64_t m1 = std::min(mblocks, c0 + chunk);
          if (m1 - c0 >= decode_once_min_blocks.load(std::memory_order_relaxed)) {
            for (int j = 0; j < n; ++j) compact::unpack_block(w, nb[j], buf + j * Kh * 32);
            amx::PackedB b{buf, buf + Kh * 32};
            for (int64_t mb = c0; mb < m1; ++mb) {
              const int rows = (int)std::min<int64_t>(32, M - mb * 32);
              amx::tile_blocks(amx::blocked_a(xbp, Kh, mb), std::min(rows, 16), std::max(rows - 16, 0), b, Kh, nb,
                               n, args.b, args.o + mb * 32 * N, N);
            }
          } else {
            for (int64_t mb = c0; mb < m1; ++mb) {
              const int rows = (int)std::min<int64_t>(32, M - mb * 32);
              compact_amx::CompactB b(w, nb, n, buf);
              amx::tile_blocks(amx::blocked_a(xbp, Kh, mb), std::min(rows, 16), std::max(rows - 16, 0), b, Kh, nb,
                               n, args.b, args.o + mb * 32 * N, N);
            }
          }
        }
    }
    std::free(buf);
  });
  return args.out;
}

// Turns the AMX path on or off for every compact matrix it can take (compact_amx::on); true if it is now on.
bool set_compact_amx(bool on) {
  compact_amx::enabled.store(on && amx_init());
  return compact_amx::enabled.load();
}

#else  // the plain AVX-512F build: no tile code; the switch stays off

at::Tensor compact_linear_amx(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}

bool set_compact_amx(bool) { return false; }

#endif

// From how many 32-row blocks of a chunk compact_linear_amx decodes each pair of column blocks once (default 4).
void set_compact_amx_decode_once(int64_t blocks) {
  TORCH_CHECK(blocks >= 1, "the decode-once path needs at least one 32-row block, not ", blocks);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  decode_once_min_blocks.store(blocks);
#endif
}

bool compact_amx_enabled() { return compact_amx::enabled.load(); }

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("set_compact_amx(bool on) -> bool", &set_compact_amx);
  m.def("compact_amx_enabled() -> bool", &compact_amx_enabled);
  m.def("set_compact_amx_decode_once(int blocks) -> ()", &set_compact_amx_decode_once);
  m.def("compact_linear_amx(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("compact_linear_amx", &compact_linear_amx); }

}  // namespace deploykit
