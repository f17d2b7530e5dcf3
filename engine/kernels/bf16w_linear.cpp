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
//   - up to FEW_ROWS rows (decode): weights stream from memory once, widened in registers (bf16w_rows.h tile, groups);
//   - more rows (batched decode, prefill): compute-bound, so each 128-k chunk of a column group is widened once into
//     an L1 buffer and 6-row x 16-column register tiles run over it (bf16w_blocked.h blocked), the shape of an fp32
//     GEMM micro-kernel: 12 accumulators, 2 loads and 6 broadcasts for 12 FMAs a k. From 2 MC rows (a prompt) the
//     activations are packed tile by tile first, so that a tile reads them as one stream.
// The fused fp32 decode step runs both, up to 16 rows (bf16w_blocked.h rows).
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

#include "bf16w_blocked.h"
#include "runs.h"

namespace deploykit {
namespace {

using bf16w::COLS, bf16w::FEW_ROWS, bf16w::MC;

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
  if (M <= FEW_ROWS) {  // bound by the weight stream: each thread one contiguous share, one stream
    at::parallel_for(0, G, 4, [&](int64_t g0, int64_t g1) { bf16w::rows(wp, K, g0, g1, xp, ldx, M, bp, op, N); });
    return out;
  }
  if (M < 2 * MC) {  // compute-bound: the groups in runs as threads come free (runs.h: why; a 24-token prompt's
                     // prefill on a 2-core Zen 3 took 0.95x the time of fixed shares, a 100-token one 0.96x)
    in_runs(G, 2, [&](int64_t g0, int64_t g1) { bf16w::rows(wp, K, g0, g1, xp, ldx, M, bp, op, N); });
    return out;
  }
  // Prefill: threads take tasks of one row block x a few groups as they come free, so a core the host slows down
  // for a while holds no other back at the call's end (measured at 512 rows, Zen 3, 2 threads: 66-73 GMAC/s
  // against 64-67 with the groups split evenly up front; at 8-64 rows the even split was as fast or faster).
  const int64_t threads = at::get_num_threads();
  const int64_t per = std::clamp<int64_t>(G / (2 * threads), 1, 8);  // groups a task
  const int64_t tasks_a_block = (G + per - 1) / per, tasks = tasks_a_block * ((M + MC - 1) / MC);
  // The rows packed tile by tile first (bf16w_blocked.h pack: why), each block of MC rows by one thread.
  at::Tensor packed = at::empty({M * K}, x.options());
  float* pk = packed.data_ptr<float>();
  at::parallel_for(0, (M + MC - 1) / MC, 1, [&](int64_t b0, int64_t b1) {
    bf16w::pack(xp + b0 * MC * ldx, ldx, std::min(M, b1 * MC) - b0 * MC, K, pk + b0 * MC * K);
  });
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = taken.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t m0 = t / tasks_a_block * MC, g0 = t % tasks_a_block * per;
      bf16w::blocked(wp, K, g0, std::min(G, g0 + per), xp + m0 * ldx, ldx, std::min(MC, M - m0), bp, op + m0 * N, N,
                     pk + m0 * K);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) { m.def("linear_bf16w(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("linear_bf16w", &linear_bf16w); }

}  // namespace deploykit
