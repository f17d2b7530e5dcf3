// AMX-BF16 GEMM on plain row-major [N, K] weights at 2-64 rows, for bf16 matrices `linear` is given as they are
// (not through prepare_weight: the engine's own matrices, a tied LM head included, are packed or compact). Computes
// out^T = W x^T: 16 weight rows x 32 k are an AMX A tile read in place with the row stride, and x^T is the B operand,
// VNNI-packed per call (M*K*2 bytes).
// Tiles: C 0..3 = (weight half h, x group g) at 2h+g, A 4..5 = weight halves, B 6..7 = x groups.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "op_args.h"
#include "runs.h"

namespace deploykit {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

bool amx_init();                             // amx_bf16.cpp
void amx_configure_tiles(int rows0, int rows1);  // amx_bf16.cpp

namespace {

using bf16 = at::BFloat16;

// x [M, K] -> [ceil(M/16), K/2, 16, 2]: k-pair rows of 16 x rows (one B tile per 32 k), zero-padded.
at::Tensor vnni_x(const at::Tensor& x) {
  const int64_t M = x.size(0), Kh = x.size(1) / 2, ldx = x.stride(0), groups = (M + 15) / 16;
  at::Tensor xv = at::zeros({groups, Kh, 16, 2}, x.options());
  const bf16* src = x.data_ptr<bf16>();
  int32_t* dst = reinterpret_cast<int32_t*>(xv.data_ptr<bf16>());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kp = 0; kp < Kh; ++kp)
      std::memcpy(dst + ((m / 16) * Kh + kp) * 16 + m % 16, src + m * ldx + 2 * kp, 4);
  return xv;
}

// out[m0 + 16g + j, n0 + 16h + i] for NH weight halves of 16 rows and MG x groups of 16 rows.
template <int NH, int MG>
inline void plain_block(const bf16* w, int64_t K, int64_t n0, const bf16* xv, int64_t g0, int64_t M,
                        const float* bias, bf16* out, int64_t ldo, const char* prefetch) {
  _tile_zero(0);
  if constexpr (MG > 1) _tile_zero(1);
  if constexpr (NH > 1) {
    _tile_zero(2);
    if constexpr (MG > 1) _tile_zero(3);
  }
  const int64_t Kh = K / 2, wstride = K * (int64_t)sizeof(bf16);
  const bf16* a0 = w + n0 * K;
  const bf16* b0 = xv + g0 * Kh * 32;
  for (int64_t k = 0; k < K; k += 32) {
    // 16*NH short row streams: request the same columns of the next row block (one line per line read).
    if (prefetch)
      for (int r = 0; r < 16 * NH; ++r) _mm_prefetch(prefetch + r * wstride + k * 2, _MM_HINT_T1);
    _tile_loadd(4, a0 + k, wstride);
    if constexpr (NH > 1) _tile_loadd(5, a0 + 16 * K + k, wstride);
    _tile_loadd(6, b0 + k * 16, 64);
    if constexpr (MG > 1) _tile_loadd(7, b0 + Kh * 32 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MG > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NH > 1) {
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (MG > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][16 * 16];  // [2h + g][n_in_half * 16 + m_in_group]
  _tile_stored(0, c[0], 64);
  if constexpr (MG > 1) _tile_stored(1, c[1], 64);
  if constexpr (NH > 1) {
    _tile_stored(2, c[2], 64);
    if constexpr (MG > 1) _tile_stored(3, c[3], 64);
  }
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int h = 0; h < NH; ++h) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n0 + 16 * h) : _mm512_setzero_ps();
    for (int g = 0; g < MG; ++g) {
      const int64_t m_base = (g0 + g) * 16;
      const int64_t rows = std::min<int64_t>(16, M - m_base);
      for (int64_t j = 0; j < rows; ++j) {
        const __m512 v = _mm512_i32gather_ps(column, c[2 * h + g] + j, 4);  // C column j = out row
        __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(v, bv));
        std::memcpy(out + (m_base + j) * ldo + n0 + 16 * h, &o, sizeof(o));
      }
    }
  }
}

}  // namespace

// x [M, K], w [N, K] contiguous with K % 32 == 0 and N % 16 == 0 -> [M, N] bf16.
at::Tensor linear_plain_amx(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_init(), "AMX tile state was not granted by the OS");
  op_args::check_plain(w);
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  TORCH_CHECK(K % op_args::BLOCK_K == 0 && N % op_args::BLOCK_N == 0, "plain AMX path needs K % ", op_args::BLOCK_K,
              " == 0 and N % ", op_args::BLOCK_N, " == 0");
  const op_args::Operands args = op_args::operands(x, K, N, bias);
  const at::Tensor& b = args.bias;
  const at::Tensor& out = args.out;
  if (M == 0) return out;
  const at::Tensor xv = vnni_x(x);
  const bf16* wp = w.data_ptr<bf16>();
  const bf16* xvp = xv.data_ptr<bf16>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  bf16* op = out.data_ptr<bf16>();
  const int64_t pairs = (N / 16 + 1) / 2, groups = xv.size(0);
  // The weight-row pairs go to the threads in runs as they come free (runs.h tile_pairs), so a thread the host slows
  // holds no other back. A [49152, 896] matrix on an Emerald Rapids-class Xeon (benchmarks/README.md, session 44),
  // runs against fixed shares alternated in one process, time fixed / runs: 16 rows 1.05-1.10, 64 rows 1.30-1.31;
  // with one CPU 30 % busy 1.15-1.17 and 1.13-1.18.
  const int nt = (int)std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(pairs, 1));
  Runs runs;
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    amx_configure_tiles(16, 16);
    tile_pairs(runs, pairs, t0, t1, nt, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * 32;
        const bool pair = n0 + 32 <= N;
        const char* next = n0 + 64 <= N ? reinterpret_cast<const char*>(wp + (n0 + 32) * K) : nullptr;
        for (int64_t g = 0; g < groups; g += 2) {
          const char* pf = g == 0 ? next : nullptr;  // later groups hit the block in L2
          if (pair && g + 1 < groups) plain_block<2, 2>(wp, K, n0, xvp, g, M, bp, op, N, pf);
          else if (pair) plain_block<2, 1>(wp, K, n0, xvp, g, M, bp, op, N, pf);
          else if (g + 1 < groups) plain_block<1, 2>(wp, K, n0, xvp, g, M, bp, op, N, pf);
          else plain_block<1, 1>(wp, K, n0, xvp, g, M, bp, op, N, pf);
        }
      }
    });
    _tile_release();
  });
  return out;
}

#else  // the plain AVX-512F build: no tile code at all, callers check amx_init() first

at::Tensor linear_plain_amx(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}

#endif

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("linear_plain_amx(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("linear_plain_amx", &linear_plain_amx);
}

}  // namespace deploykit
