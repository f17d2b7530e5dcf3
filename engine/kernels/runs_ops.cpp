// The ops around runs.h, in every build: the fused bf16 step's take-over switch (Shares; benchmarks/decode_profile.py
// --shares measures it against fixed shares), and a walk of Shares with one thread slowed, which the tests drive.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#include "runs.h"

namespace deploykit {
namespace {

// Whether the fused bf16 step's threads take work over from a slower one (the default) or keep fixed shares;
// returns the previous setting.
bool set_step_take_over(bool on) { return take_over_on.exchange(on); }

void spin(double us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
  while (std::chrono::steady_clock::now() < end) {
  }
}

// Which of `threads` threads computed each of n items walked in Shares (`step` items a claim, take-overs of at least
// `least`), where thread `slow` spins slow_us microseconds an item: int32 [n], -2 where more than one did.
at::Tensor shares_walk(int64_t n, int64_t threads, int64_t step, int64_t least, int64_t slow, double slow_us) {
  TORCH_CHECK(n >= 0 && n < (int64_t{1} << 31) && threads >= 1 && threads <= 64 && step >= 1 && least >= 1,
              "shares_walk: 0 <= n < 2^31, 1 <= threads <= 64, step >= 1 and least >= 1");
  at::Tensor who = at::full({n}, -1, at::kInt);
  int32_t* w = who.data_ptr<int32_t>();
  Shares shares(static_cast<int>(threads));
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int tid = omp_get_thread_num();
#pragma omp single
    shares.reset(n, omp_get_num_threads());
    shares.walk(tid, step, least, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        if (tid == slow) spin(slow_us);
        std::atomic_ref<int32_t> cell(w[i]);
        int32_t none = -1;
        if (!cell.compare_exchange_strong(none, tid)) cell.store(-2);
      }
    });
  }
  return who;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("set_step_take_over(bool on) -> bool", &set_step_take_over);
  m.def("shares_walk(int n, int threads, int step, int least, int slow, float slow_us) -> Tensor", &shares_walk);
}

}  // namespace deploykit
