// AMX-BF16 tile GEMM on the packed [N/16, K/2, 16, 2] weight layout (needs K % 32 == 0).
//
// A packed 16-column block is already an AMX B tile (16 k-pair rows x 64 bytes), so weights
// are read in place; x rows are loaded as A tiles straight from the activation with its row
// stride, so neither operand is copied. Tiles: C 0..3 (2x2 of 16x16 fp32), A 4..5, B 6..7.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "op_args.h"

namespace deploykit {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
namespace {

using bf16 = at::BFloat16;

constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;
constexpr int64_t BLOCK_X_MIN_M = 64;
// Weight tiles are requested this far ahead of their tileloadd: a tile load that misses to DRAM
// stalls the AMX pipe, and the hardware prefetcher restarts at every 28 KiB column block.
constexpr int64_t PREFETCH_BYTES = 4096;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace

// Tile shapes for this thread: C 0..3, A 4..5 (rows0 / rows1 valid rows in the first / second
// 16-row half of a 32-row M block), B 6..7; all 64 bytes wide. Shared with amx_plain_bf16.cpp.
void amx_configure_tiles(int rows0, int rows1) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = (uint8_t)rows[t];
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  // GCC 12's _tile_loadconfig declares an 8-byte memory operand, letting the compiler drop the
  // stores to the rest of cfg; this operand covers all 64 bytes.
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

namespace {

// Where the A tiles of one M block live: tile k-step s of half h starts at
// base + h * half + s * step (elements) with rows `ld` bytes apart.
struct ATiles {
  const bf16* base;
  int64_t step, half, ld;
};

// Plain x [M, K]: tiles are read in place with the activation's row stride.
inline ATiles plain_a(const bf16* x, int64_t ldx) { return {x, 32, 16 * ldx, ldx * (int64_t)sizeof(bf16)}; }

// Blocked x [M/16, K/32, 16, 32]: every tile is one contiguous 1 KiB block.
inline ATiles blocked_a(const bf16* xb, int64_t Kh, int64_t mb32) {
  const int64_t per_half = (Kh / 16) * 512;
  return {xb + mb32 * 2 * per_half, 512, per_half, 64};
}

// C[rows, 16*NB] for MB 16-row halves of A, NB column blocks starting at block nb0.
template <int MB, int NB>
inline void tile_block(const ATiles& a, int rows0, int rows1, const bf16* wp, int64_t Kh,
                       int64_t nb0, const float* bias, bf16* out, int64_t ldo) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MB > 1) {
    _tile_zero(2);
    if constexpr (NB > 1) _tile_zero(3);
  }
  const bf16* b0 = wp + nb0 * Kh * 32;
  const bf16* b1 = b0 + Kh * 32;
  const bf16* a0 = a.base;
  for (int64_t kp = 0; kp < Kh; kp += 16, a0 += a.step) {
    _tile_loadd(4, a0, a.ld);
    if constexpr (MB > 1) _tile_loadd(5, a0 + a.half, a.ld);
    const char* p0 = reinterpret_cast<const char*>(b0 + kp * 32) + PREFETCH_BYTES;
    for (int l = 0; l < 16; ++l) _mm_prefetch(p0 + l * 64, _MM_HINT_T0);
    if constexpr (NB > 1) {
      const char* p1 = reinterpret_cast<const char*>(b1 + kp * 32) + PREFETCH_BYTES;
      for (int l = 0; l < 16; ++l) _mm_prefetch(p1 + l * 64, _MM_HINT_T0);
    }
    _tile_loadd(6, b0 + kp * 32, 64);
    if constexpr (NB > 1) _tile_loadd(7, b1 + kp * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB > 1) {
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][16 * 16];  // [tile][row * 16 + col]
  _tile_stored(0, c[0], 64);
  if constexpr (NB > 1) _tile_stored(1, c[1], 64);
  if constexpr (MB > 1) {
    _tile_stored(2, c[2], 64);
    if constexpr (NB > 1) _tile_stored(3, c[3], 64);
  }
  for (int h = 0; h < MB; ++h) {
    const int rows = h == 0 ? rows0 : rows1;
    for (int j = 0; j < NB; ++j) {
      const float* ct = c[h * 2 + j];
      const __m512 bv = bias ? _mm512_loadu_ps(bias + (nb0 + j) * 16) : _mm512_setzero_ps();
      for (int r = 0; r < rows; ++r) {
        __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(ct + r * 16), bv));
        std::memcpy(out + (h * 16 + r) * ldo + (nb0 + j) * 16, &v, sizeof(v));
      }
    }
  }
}

// One M block (<= 32 rows) across column-block pairs [p0, p1) of the weight.
inline void m_block(const ATiles& a, int rows, const bf16* wp, int64_t Kh, int64_t NB,
                    int64_t p0, int64_t p1, const float* bias, bf16* out, int64_t ldo) {
  const int rows0 = std::min(rows, 16), rows1 = rows - rows0;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t nb0 = p * 2;
    const bool pair = nb0 + 1 < NB;
    if (rows1 > 0) {
      if (pair) tile_block<2, 2>(a, rows0, rows1, wp, Kh, nb0, bias, out, ldo);
      else tile_block<2, 1>(a, rows0, rows1, wp, Kh, nb0, bias, out, ldo);
    } else {
      if (pair) tile_block<1, 2>(a, rows0, 0, wp, Kh, nb0, bias, out, ldo);
      else tile_block<1, 1>(a, rows0, 0, wp, Kh, nb0, bias, out, ldo);
    }
  }
}

// x [M, K] -> zero-padded [ceil(M/32)*2, K/32, 16, 32] so A tiles are contiguous 1 KiB blocks.
at::Tensor block_x(const at::Tensor& x) {
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

}  // namespace

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
  const int64_t pairs = (NB + 1) / 2;
  // Prefill: copy x once into tile blocks (M*K*2 bytes, small next to M*N*K MACs); strided A tiles
  // would touch 16 pages each. Decode-sized M reads x in place.
  const bool blocked = M >= BLOCK_X_MIN_M;
  at::Tensor xb = blocked ? block_x(x) : at::Tensor();
  const bf16* xbp = blocked ? xb.data_ptr<bf16>() : nullptr;
  const int64_t full = blocked ? (M + 31) / 32 : M / 32, tail = blocked ? 0 : M % 32;
  // 32-row M blocks per chunk so that the chunk (re-read once per column pair) stays in L2.
  const int64_t chunk_blocks = std::max<int64_t>(1, (768 * 1024) / (32 * K * (int64_t)sizeof(bf16)));
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    if (full > 0) {
      amx_configure_tiles(16, 16);
      for (int64_t c0 = 0; c0 < full; c0 += chunk_blocks) {
        const int64_t c1 = std::min(full, c0 + chunk_blocks);
        for (int64_t p = p0; p < p1; ++p)
          for (int64_t mb = c0; mb < c1; ++mb) {
            const int rows = (int)std::min<int64_t>(32, M - mb * 32);  // blocked x is zero-padded
            const ATiles a = blocked ? blocked_a(xbp, Kh, mb) : plain_a(args.x + mb * 32 * args.ldx, args.ldx);
            m_block(a, rows, w, Kh, NB, p, p + 1, args.b, args.o + mb * 32 * N, N);
          }
      }
    }
    if (tail > 0) {
      const int rows0 = (int)std::min<int64_t>(tail, 16);
      amx_configure_tiles(rows0, (int)tail - rows0);
      m_block(plain_a(args.x + full * 32 * args.ldx, args.ldx), (int)tail, w, Kh, NB, p0, p1, args.b,
              args.o + full * 32 * N, N);
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
