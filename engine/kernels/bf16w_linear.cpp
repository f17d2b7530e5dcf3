// linear_bf16w: fp32 activations x [M, K] times bf16 weights packed as kernels.pack lays them out,
// [N/16, K/2, 16, 2] (a 64-byte line is k-pair j of 16 output columns), -> fp32 [M, N]; each weight is widened to
// fp32 in registers.
//
// Why: a CPU without bf16 units (AVX2, or AVX-512 without AVX512-BF16) runs a model in fp32, and held its bf16
// checkpoint's weights widened to fp32 in memory: twice the bytes to hold and, at decode, to read per token, for
// values that are exactly the checkpoint's bf16 ones. Held as bf16 and widened here, every product is the same fp32
// product, from half the bytes. PyTorch's fp32 GEMM (MKL) is also slow at the few rows of a decode step (on a
// 2-core Zen 3: 4.7 GB/s of weights at 4 rows against 14 at one).
//
// Widening: a 32-byte half line is 8 columns' (k 2j, k 2j + 1) pairs, one per 32-bit lane, so `lane << 16` is
// column c's weight at k 2j as fp32 and `lane & 0xFFFF0000` its weight at 2j + 1. Each is multiplied by the
// activation at that k, broadcast: outer products, 8 outputs a register, no horizontal sums. Every output is one FMA
// chain over k in order: the same operations in the same order whatever M is and however the rows and columns are
// tiled, so a row's output does not depend on its batch.
// Two paths, chosen by the number of rows (both keep that chain, so they agree bitwise):
//   - up to FEW_ROWS rows (decode): weights stream from memory once, widened in registers (bf16w_rows.h tile, groups,
//     which the fused fp32 decode step runs too);
//   - more rows (batched decode, prefill): compute-bound, so each 128-k chunk of a column group is widened once into
//     an L1 buffer and 6-row x 16-column register tiles run over it (blocked), the shape of an fp32 GEMM
//     micro-kernel: 12 accumulators, 2 loads and 6 broadcasts for 12 FMAs a k.
// Written with AVX2 and FMA only, in every build (build.py); tests/engine/test_bf16w_linear.py holds it to an fp64
// evaluation of the product and to itself across batch sizes.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>

#include "bf16w_rows.h"

namespace deploykit {
namespace {

using bf16w::COLS, bf16w::FEW_ROWS, bf16w::even_k, bf16w::odd_k;

// The blocked path. Measured on a 2-core Zen 3 (AVX2 FMA peak 44.6 GMAC/s a core): the model's 96 matrices cycled
// from memory, 2 threads, against groups(): 16 rows 44-47 against 35-38 GMAC/s, 64 rows 64-66 against 43-45, 5-12
// rows 1.1-1.2x, 4 rows the same (memory-bound, so groups() keeps them); one thread with the weights in cache, 41-42
// GMAC/s at 64-512 rows (MKL's fp32 GEMM on fp32 weights: 29-38).
constexpr int64_t KC = 128;  // k per widened chunk: [KC, 16] fp32 = 8 KiB, in L1 beside the rows' activations
constexpr int64_t MC = 64;   // rows per block: a chunk is widened once per group per block
constexpr int MR = 6;        // rows per register tile: 6 x 2 accumulators + 2 weight vectors + 1 broadcast

// buf [kn, 16] fp32 = group g's weights at k0 .. k0 + kn (k0 and kn even): half line h of k-pair j holds columns
// 8h .. 8h + 7 at k 2j (low halves) and 2j + 1 (high halves).
inline void widen(const at::BFloat16* w, int64_t K, int64_t g, int64_t k0, int64_t kn, float* buf) {
  const auto* line = reinterpret_cast<const __m256i*>(w + g * COLS * K + k0 * COLS);
  for (int64_t j = 0; j < kn / 2; ++j)
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(line + 2 * j + h);
      _mm256_store_ps(buf + 2 * j * COLS + 8 * h, even_k(v));
      _mm256_store_ps(buf + (2 * j + 1) * COLS + 8 * h, odd_k(v));
    }
}

// out[m, 0 .. 16) for MT rows over one chunk buf [kn, 16]: the chains resume from part [MT, 16] (or from 0 at the
// first chunk), go on in k order, and end in part again, or, at the last chunk, in out with the bias added as tile()
// does, so the result is tile()'s bit for bit.
template <int MT>
inline void micro(const float* buf, int64_t kn, const float* x, int64_t ldx, float* part, float* out, int64_t ldo,
                  bool first, bool last, const float* bias) {
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = first ? _mm256_setzero_ps() : _mm256_load_ps(part + m * COLS + 8 * h);
#pragma GCC unroll 4  // measured: 41-42 GMAC/s a core against 38-40 rolled
  for (int64_t k = 0; k < kn; ++k) {
    const __m256 w0 = _mm256_load_ps(buf + COLS * k), w1 = _mm256_load_ps(buf + COLS * k + 8);
    for (int m = 0; m < MT; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m)
      if (last) _mm256_storeu_ps(out + m * ldo + 8 * h, _mm256_add_ps(acc[m][h], b));
      else _mm256_store_ps(part + m * COLS + 8 * h, acc[m][h]);
  }
}

// Groups [g0, g1) for M > FEW_ROWS rows: per block of MC rows, per group, per chunk of KC k: widen the chunk, then
// run the block's rows over it in tiles of at most MR rows, as even as they go (16 rows as 6 + 5 + 5, not 6 + 6 + 4:
// a thin tile has fewer chains to hide the FMA latency; 0-5 % faster at 8-64 rows). Two things keep the tiles fed
// (measured on a 2-core Zen 3, the model's 96 matrices cycled from memory, 2 threads: 16 rows 46-47 -> 52-53 GMAC/s,
// 64 rows 58-61 -> 64-66, 512 rows 61-64 -> 66-70):
//   - the chains' partial sums between chunks stay in `part`, a [MC, 16] buffer in L1, and reach out only at the
//     last chunk: out's rows lie N * 4 bytes apart (N a multiple of 128 in these models), which maps a block's 64
//     rows onto a few of L1's 64 sets, so partial sums kept in out came back from L2 at every chunk;
//   - the next chunk (in memory order: past the group, the next group's first) is prefetched a few lines before each
//     tile rather than all 64 at once, which stalled on the core's outstanding-miss buffers; without any prefetch the
//     widening waits on memory at each chunk (8 rows 26 against 30 GMAC/s). A prefetch past the tensor is harmless.
void blocked(const at::BFloat16* w, int64_t K, int64_t g0, int64_t g1, const float* x, int64_t ldx, int64_t M,
             const float* bias, float* out, int64_t ldo) {
  alignas(64) float buf[KC * COLS];
  alignas(64) float part[MC * COLS];
  constexpr int64_t chunk_bytes = KC * COLS * 2, lines = chunk_bytes / 64;
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t rows = std::min(MC, M - m0);
    const int64_t tiles = (rows + MR - 1) / MR, small = rows / tiles, big = tiles - (tiles * (small + 1) - rows);
    const int64_t per_tile = (lines + tiles - 1) / tiles * 64;  // prefetched bytes before each tile
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kn = std::min(KC, K - k0);
        const bool first = k0 == 0, last = k0 + kn == K;
        widen(w, K, g, k0, kn, buf);
        const char* next = reinterpret_cast<const char*>(w + (g * K + k0 + kn) * COLS);
        int64_t fetched = 0;
        const float* bg = bias ? bias + g * COLS : nullptr;
        const float* xb = x + m0 * ldx + k0;
        float* ob = out + m0 * ldo + g * COLS;
        for (int64_t t = 0, m = 0; t < tiles; ++t) {
          for (const int64_t e = std::min(fetched + per_tile, chunk_bytes); fetched < e; fetched += 64)
            _mm_prefetch(next + fetched, _MM_HINT_T0);
          const int64_t mt = t < big ? small + 1 : small;
          const float* xt = xb + m * ldx;
          float* pt = part + m * COLS;
          float* ot = ob + m * ldo;
          switch (mt) {
            case 1: micro<1>(buf, kn, xt, ldx, pt, ot, ldo, first, last, bg); break;
            case 2: micro<2>(buf, kn, xt, ldx, pt, ot, ldo, first, last, bg); break;
            case 3: micro<3>(buf, kn, xt, ldx, pt, ot, ldo, first, last, bg); break;
            case 4: micro<4>(buf, kn, xt, ldx, pt, ot, ldo, first, last, bg); break;
            case 5: micro<5>(buf, kn, xt, ldx, pt, ot, ldo, first, last, bg); break;
            default: micro<MR>(buf, kn, xt, ldx, pt, ot, ldo, first, last, bg); break;
          }
          m += mt;
        }
      }
  }
}

bool cpu_runs_it() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

}  // namespace

// x [M, K] fp32 with contiguous rows, w packed bf16 [N/16, K/2, 16, 2], bias fp32 [N] or None -> fp32 [M, N].
at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(cpu_runs_it(), "linear_bf16w needs AVX2 and FMA; this CPU lacks them");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == COLS && w.size(3) == 2 && w.is_contiguous() &&
                  w.scalar_type() == at::kBFloat16,
              "the weight must be packed: a contiguous bf16 [N/16, K/2, 16, 2] tensor");
  const int64_t G = w.size(0), N = G * COLS, K = w.size(1) * 2;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D fp32 tensor");
  TORCH_CHECK(x.size(1) == K, "x has K=", x.size(1), ", the weight has K=", K);
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const float* xp = x.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  if (M < 2 * MC) {  // threads take contiguous runs of groups: one weight stream each
    at::parallel_for(0, G, M <= FEW_ROWS ? 4 : 1, [&](int64_t g0, int64_t g1) {
      if (M <= FEW_ROWS) bf16w::groups(wp, K, g0, g1, xp, ldx, M, bp, op, N);
      else blocked(wp, K, g0, g1, xp, ldx, M, bp, op, N);
    });
    return out;
  }
  // Prefill: threads take tasks of one row block x a few groups as they come free, so a core the host slows down
  // for a while holds no other back at the call's end (measured at 512 rows, Zen 3, 2 threads: 66-73 GMAC/s
  // against 64-67 with the groups split evenly up front; at 8-64 rows the even split was as fast or faster).
  const int64_t threads = at::get_num_threads();
  const int64_t per = std::clamp<int64_t>(G / (2 * threads), 1, 8);  // groups a task
  const int64_t tasks_a_block = (G + per - 1) / per, tasks = tasks_a_block * ((M + MC - 1) / MC);
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = taken.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t m0 = t / tasks_a_block * MC, g0 = t % tasks_a_block * per;
      blocked(wp, K, g0, std::min(G, g0 + per), xp + m0 * ldx, ldx, std::min(MC, M - m0), bp, op + m0 * N, N);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) { m.def("linear_bf16w(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("linear_bf16w", &linear_bf16w); }

}  // namespace deploykit
