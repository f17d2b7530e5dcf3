// AMX-BF16 tile GEMM on the packed [N/16, K/2, 16, 2] weight layout (needs K % 32 == 0).
//
// A packed 16-column block is already an AMX B tile (16 k-pair rows x 64 bytes), so weights are read in place. Up to
// 63 rows, x rows are loaded as A tiles straight from the activation with its row stride, so neither operand is
// copied; from 64 rows (a prompt) x is copied into tile blocks and the pairs go through amx_slices.h a segment of K
// at a time, as compact and quantized weights do. Tiles: C 0..3 (2x2 of 16x16 fp32), A 4..5, B 6..7.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "amx_slices.h"
#include "amx_tiles.h"
#include "op_args.h"
#include "runs.h"

namespace deploykit {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace {

using bf16 = at::BFloat16;

constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;

}  // namespace

// Tile shapes for this thread: C 0..3, A 4..5 (rows0 / rows1 valid rows in the first / second
// 16-row half of a 32-row M block), B 6..7; all 64 bytes wide. Shared with amx_plain_bf16.cpp.
void amx_configure_tiles(int rows0, int rows1) {
  const uint8_t rows[8] = {(uint8_t)rows0, (uint8_t)rows0, (uint8_t)rows1, (uint8_t)rows1,
                           (uint8_t)rows0, (uint8_t)rows1, 16, 16};
  uint16_t colsb[8];
  for (int t = 0; t < 8; ++t) colsb[t] = rows[t] ? 64 : 0;
  amx::configure(rows, colsb);
}

namespace {

using amx::ATiles;

// Packed weights as an amx_slices source: a block's k-pairs already are B tiles, read in place (no decode buffer).
struct Source {
  const bf16* w;
  int64_t K;
  const bf16* in_place(int64_t nb, int64_t k0) const { return w + (nb * (K / 2) + k0) * 32; }
  void bytes(int64_t nb, int64_t k0, int64_t kn, const char*& begin, const char*& end) const {
    begin = reinterpret_cast<const char*>(in_place(nb, k0));
    end = begin + kn * 64;
  }
  // Block mb of x's tiles against column blocks nb over all of K (below `once` blocks a chunk).
  void again(int64_t M, const amx_slices::XTiles& x, int64_t mb, const int64_t* nb, int n, const float* bias,
             bf16* out, const amx_slices::Pairs& pairs) {
    const int rows = (int)std::min<int64_t>(32, M - mb * 32);
    amx::PackedB<> b{in_place(nb[0], 0), in_place(nb[n - 1], 0)};
    amx::tile_blocks(x.at(K / 2, mb), std::min(rows, 16), std::max(rows - 16, 0), b, K / 2, nb, n, bias,
                     out + mb * 32 * pairs.ldo(), pairs.ldo());
  }
};

// One M block (<= 32 rows) across column-block pairs [p0, p1) of the weight.
inline void m_block(const ATiles& a, int rows, const bf16* wp, int64_t Kh, int64_t NB,
                    int64_t p0, int64_t p1, const float* bias, bf16* out, int64_t ldo) {
  const int rows0 = std::min(rows, 16), rows1 = rows - rows0;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t nb[2] = {p * 2, p * 2 + 1};
    amx::PackedB<> b{wp + nb[0] * Kh * 32, wp + nb[1] * Kh * 32};
    amx::tile_blocks(a, rows0, rows1, b, Kh, nb, nb[1] < NB ? 2 : 1, bias, out, ldo);
  }
}

}  // namespace

// x [M, K] -> zero-padded [ceil(M/32)*2, K/32, 16, 32] so A tiles are contiguous 1 KiB blocks.
at::Tensor amx_block_x(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), halves = (M + 31) / 32 * 2, kb = K / 32;
  at::Tensor xb = at::empty({halves, kb, 16, 32}, x.options());
  const bf16* src = x.data_ptr<bf16>();
  bf16* dst = xb.data_ptr<bf16>();
  at::parallel_for(0, halves, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t m = h * 16 + r;
        for (int64_t k = 0; k < kb; ++k) {
          bf16* d = dst + ((h * kb + k) * 16 + r) * 32;
          if (m < M) std::memcpy(d, src + m * ldx + k * 32, 64);
          else std::memset(d, 0, 64);
        }
      }
  });
  return xb;
}

// Asks the kernel for AMX tile state (Linux >= 5.16); false when the OS refuses.
bool amx_init() {
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

// x [M, K], wp [N/16, K/2, 16, 2] with K % 32 == 0 -> [M, N] bf16.
at::Tensor linear_packed_amx(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_init(), "AMX tile state was not granted by the OS");
  op_args::check_packed(wp);
  const int64_t NB = wp.size(0), Kh = wp.size(1), N = NB * 16, K = Kh * 2, M = x.size(0);
  TORCH_CHECK(K % op_args::BLOCK_K == 0, "AMX path needs K % ", op_args::BLOCK_K, " == 0, got K=", K);
  const op_args::Operands args = op_args::operands(x, K, N, bias);
  const bf16* w = wp.data_ptr<bf16>();
  if (M >= amx::BLOCK_X_MIN_M) {  // a prompt: x in tile blocks, k-slices of whole segments (amx_slices.h)
    Source src{w, K};
    amx_slices::blocked(M, x, src, amx_slices::Pairs{NB, false}, 1, 4, args.b, args.o);
    return args.out;
  }
  // Up to 63 rows, read in place: whole 32-row blocks, then the rest; the pairs of each go to the threads in runs as
  // they come free (runs.h tile_pairs).
  const int64_t pairs = (NB + 1) / 2, full = M / 32, tail = M % 32;
  const int nt = (int)std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(pairs, 1));
  Runs runs[2];
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    if (full > 0) {
      amx_configure_tiles(16, 16);
      tile_pairs(runs[0], pairs, t0, t1, nt, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t mb = 0; mb < full; ++mb)
            m_block(amx::plain_a(args.x + mb * 32 * args.ldx, args.ldx), 32, w, Kh, NB, p, p + 1, args.b,
                    args.o + mb * 32 * N, N);
      });
    }
    if (tail > 0) {
      const int rows0 = (int)std::min<int64_t>(tail, 16);
      amx_configure_tiles(rows0, (int)tail - rows0);
      tile_pairs(runs[1], pairs, t0, t1, nt, 1, [&](int64_t p0, int64_t p1) {
        m_block(amx::plain_a(args.x + full * 32 * args.ldx, args.ldx), (int)tail, w, Kh, NB, p0, p1, args.b,
                args.o + full * 32 * N, N);
      });
    }
    _tile_release();
  });
  return args.out;
}

#else  // the plain AVX-512F build: no tile code at all, callers check amx_init() first

bool amx_init() { return false; }

at::Tensor linear_packed_amx(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}

#endif

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("amx_init() -> bool", &amx_init);
  m.def("linear_packed_amx(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("linear_packed_amx", &linear_packed_amx);
}

}  // namespace deploykit
