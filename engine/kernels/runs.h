// Work handed out as threads come free: Runs, which the fused fp32 decode step's phases take their column groups from
// past 4 rows, and in_runs(), the same for one compute-bound op (linear_bf16w and quant_linear past 4 rows). No ISA
// code here, so every build includes it.
//
// Why: with fixed shares, a thread the host slows for a while (another tenant on the VM, or the front end sharing the
// CPU) holds every other thread back at the end of each op or phase. Measured on a 2-core Zen 3 (benchmarks/README.md,
// session 31): the fast thread of a 16-row fused step waited 5-19 ms of a ~105 ms step at its barriers. Up to 4 rows
// the ops are bound by the weight stream, and they keep one contiguous share per thread (a run breaks the stream: Q4_0
// at one row took 1.07x the time in runs).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace deploykit {

// n items handed out in runs: each run is a 1 / (2 nt) share of what is left, at least `least` items, so runs start
// long (few breaks in a weight stream, few hand-outs) and end short (the threads finish together). Which thread takes
// which run changes nothing a caller computes: each item's result depends on the item alone.
class Runs {
 public:
  // The next run [r0, r1) of [0, n) for one of nt threads; false once every item is taken.
  bool take(int64_t n, int nt, int64_t least, int64_t& r0, int64_t& r1) {
    int64_t at = next_.load(std::memory_order_relaxed);
    while (at < n) {
      const int64_t len = std::min(n - at, std::max(least, (n - at) / (2 * nt)));
      if (next_.compare_exchange_weak(at, at + len, std::memory_order_relaxed)) {
        r0 = at;
        r1 = at + len;
        return true;
      }
    }
    return false;
  }

 private:
  std::atomic<int64_t> next_{0};
};

// fn(r0, r1) over the runs of [0, n), one task a thread of ATen's pool (inside another parallel region: all on the
// caller's thread).
template <class F>
inline void in_runs(int64_t n, int64_t least, const F& fn) {
  const int nt = at::get_num_threads();
  Runs runs;
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t r0, r1; runs.take(n, nt, least, r0, r1);) fn(r0, r1);
  });
}

}  // namespace deploykit
