// The ops around runs.h, in every build: the fused bf16 step's take-over switch (Shares; benchmarks/decode_profile.py
// --shares measures it against fixed shares) and count, the AMX matmuls' runs switch and count (tile_pairs), a delay
// of thread 0 that makes the other take over, and a walk of Shares with one thread slowed, which the tests drive.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "runs.h"

namespace deploykit {
namespace {

// Whether the fused bf16 step's threads take work over from a slower one (the default) or keep fixed shares;
// returns the previous setting.
bool set_step_take_over(bool on) { return take_over_on.exchange(on); }

// The take-overs since the last call (and resets the count).
int64_t step_take_overs() { return take_overs.exchange(0); }

// How long thread 0 spins before each claim of every Shares walk, in microseconds (0: not at all, the default);
// returns the previous setting. For tests only: a slowed thread 0 makes the other take over.
double set_first_thread_delay(double us) { return first_thread_delay_us.exchange(us); }

// Whether the AMX matmuls past a few rows (runs.h tile_pairs) hand their pairs out in runs (the default) or keep fixed
// shares; returns the previous setting.
bool set_tile_runs(bool on) { return tile_runs_on.exchange(on); }

// [items (pairs or groups) taken in runs, of them by thread 0] by the AMX matmuls since the last call (and resets
// both counts).
std::vector<int64_t> tile_runs_taken() { return {tile_runs_items.exchange(0), tile_runs_first.exchange(0)}; }

// Which of `threads` threads computed each of n items walked in Shares (`step` items a claim, take-overs of at least
// `least`), where thread `slow` spins slow_us microseconds an item: int32 [n], -2 where more than one did.
at::Tensor shares_walk(int64_t n, int64_t threads, int64_t step, int64_t least, int64_t slow, double slow_us) {
  constexpr int64_t most = int64_t{1} << 30;  // next, end and a claim's overshoot stay in the low 32 bits
  TORCH_CHECK(n >= 0 && n < most && threads >= 1 && threads <= 64 && step >= 1 && step < most && least >= 1,
              "shares_walk: 0 <= n < 2^30, 1 <= threads <= 64, 1 <= step < 2^30 and least >= 1");
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
        if (tid == slow) spin_for(slow_us);
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
  m.def("step_take_overs() -> int", &step_take_overs);
  m.def("set_first_thread_delay(float us) -> float", &set_first_thread_delay);
  m.def("set_tile_runs(bool on) -> bool", &set_tile_runs);
  m.def("tile_runs_taken() -> int[]", &tile_runs_taken);
  m.def("shares_walk(int n, int threads, int step, int least, int slow, float slow_us) -> Tensor", &shares_walk);
}

}  // namespace deploykit
