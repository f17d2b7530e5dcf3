// compact_linear on AMX tiles (compact_amx.h) for every M, and the switch that turns it on.
//
// Up to 32 rows, x is read in place and each thread decodes its column blocks' k-tiles into L1 as the tiles take
// them. Past 32 rows (prefill), x is copied into tile blocks, and a chunk of 32-row blocks either decodes each pair
// of column blocks again per block, or once, in k-slices that every block of the chunk reads from L1 (see below).
// Every way gives each row the same tdpbf16ps sequence.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>

#include "compact_amx.h"
#include "op_args.h"

namespace deploykit {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

using bf16 = at::BFloat16;

// Past 32 rows x is copied into tile blocks and taken in chunks of 32-row blocks of at most CHUNK_BYTES, which stay in
// L2 (2 MiB a core on every AMX CPU so far) while each of the thread's column-block pairs goes over them.
constexpr int64_t CHUNK_BYTES = 1024 * 1024;
// Decoded once, a pair is decoded a slice of SLICE k-pairs at a time into L1 (2 x 192 x 64 bytes = 24 KiB), and every
// 32-row block of the chunk runs that slice's tiles on it, its C tiles' fp32 sums kept in L1 between slices
// (amx::Partial: bitwise one pass over K). Decoding the whole pair into L2 instead read B tiles from L2 at
// 1.06-1.09x the packed 16-bit kernel's time; slices of 192 k-pairs 0.93-1.01x, of 448 1.07-1.17x, of 96 1.00-1.05x.
constexpr int64_t SLICE = 192;
// From this many 32-row blocks in a chunk on, a pair of column blocks is decoded once (in slices) for all of them;
// below, every block's tiles decode the pair's k-tiles again as they go (compact_amx::CompactB), which overlaps the
// decode with the tile work. Measured on a 2-core Sapphire Rapids-class Xeon over the benchmark model's matrices
// against the packed 16-bit AMX kernel: at 96 rows decoding again 0.96-1.15x its time, once 1.15-1.18x; at 128 rows
// (4 blocks, K = 896) once 1.06-1.12x, again 1.17-1.19x; at 512 rows and K = 896 once 0.92-1.01x, again 1.27-1.30x;
// K = 4864 (3 blocks a chunk) decoding again 1.04x. Runtime-settable so that tests compare both paths bitwise.
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
  const int64_t mblocks = (M + 31) / 32, chunk = std::max<int64_t>(1, CHUNK_BYTES / (32 * w.K * 2));
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    bf16* buf = static_cast<bf16*>(std::aligned_alloc(64, 2 * SLICE * 64));
    float* cbuf = static_cast<float*>(std::aligned_alloc(64, chunk * 4096));
    TORCH_CHECK(buf && cbuf, "compact_linear_amx: out of memory for a decode buffer");
    {
      compact_amx::Tiles tiles(32);
      for (int64_t c0 = 0; c0 < mblocks; c0 += chunk)
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t nb[2] = {2 * p, 2 * p + 1};
          const int n = nb[1] < NB ? 2 : 1;
          const int64_t m1 = std::min(mblocks, c0 + chunk);
          if (m1 - c0 >= decode_once_min_blocks.load(std::memory_order_relaxed)) {
            for (int64_t k0 = 0; k0 < Kh; k0 += SLICE) {
              const int64_t kn = std::min(SLICE, Kh - k0);
              for (int j = 0; j < n; ++j) compact::unpack_groups(w, nb[j], k0 / 4, (k0 + kn) / 4, buf + j * SLICE * 32);
              amx::PackedB<false> b{buf, buf + SLICE * 32};
              for (int64_t mb = c0; mb < m1; ++mb) {
                const int rows = (int)std::min<int64_t>(32, M - mb * 32);
                amx::ATiles a = amx::blocked_a(xbp, Kh, mb);
                a.base += (k0 / 16) * a.step;
                const amx::Partial part{cbuf + (mb - c0) * 1024, k0 == 0, k0 + kn == Kh};
                amx::tile_blocks(a, std::min(rows, 16), std::max(rows - 16, 0), b, kn, nb, n, args.b,
                                 args.o + mb * 32 * N, N, &part);
              }
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
    std::free(cbuf);
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
