// Work handed out as threads come free: Runs, which the fused fp32 decode step's phases take their column groups from
// past 4 rows, in_runs(), the same for one compute-bound op (linear_bf16w past 4 rows, quant_linear at 5-15 rows or
// where the CPU has no AMX-INT8), and
// tile_pairs(), for the AMX matmuls past a few rows; and Shares, the fixed shares of a phase that a thread done with
// its own takes over from (the fused bf16 step's quantized and compact matrices). No ISA code here, so every build
// includes it.
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
#include <chrono>
#include <cstdint>
#include <vector>

#include "step_args.h"

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

// Hooks of the fused bf16 step's take-overs, read and set by runs_ops.cpp: how many happened (decode_profile.py
// reports them a token), and how long thread 0 spins before each of its claims, and before each run of the AMX
// matmuls (tile_pairs below): 0 in service; the tests slow it so that the other thread takes over, and compare the
// bits.
inline std::atomic<int64_t> take_overs{0};
inline std::atomic<double> first_thread_delay_us{0.0};

inline void spin_for(double us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
  while (std::chrono::steady_clock::now() < end) {
  }
}

// Fixed shares that a thread done with its own takes work over from: each thread walks its contiguous share of
// [0, n) forward, `step` items a claim; one whose share is done takes the back half of what is left of the share with
// the most left, as its own share, and walks that. Each thread's weight stream then breaks once a take-over rather
// than at every run, as Runs would break it (one row of Q4_0 took 1.07x the time in runs on Zen 3), and a thread
// the host slows for a while (another tenant, or the front end on a 2-CPU host) no longer holds the other back at
// the phase's barrier. Measured in the fused bf16 step at one row on a 2-vCPU Emerald Rapids-class Xeon
// (benchmarks/decode_profile.py --shares, alternated in one process): with fixed shares one thread spent 7.97 ms a
// token in gate_up and the other 4.92, then waited 5.5 ms at the barriers (which vCPU was slow changed between runs);
// fixed shares took 1.074x the time of taking over on Q4_K_M (barrier waits 1.38 -> 0.33 ms a token), 1.018x on
// compact bf16, and 1.062x on Q4_K_M with a process busy 5 % of one CPU; in quiet stretches the two tied (0.995-1.018).
// A claim is one atomic add on the owner's cache line; a take-over one compare-and-swap on the victim's.
// Which thread computes an item changes nothing in it: each item's result depends on the item alone.
class Shares {
 public:
  explicit Shares(int max_threads) : slots_(max_threads) {}

  // The shares of [0, n) for nt <= max_threads threads, as step_args::share splits them: before any thread walks,
  // and without allocating (it may run inside a parallel region, once the team is known).
  void reset(int64_t n, int nt) {
    n_ = n;
    nt_ = std::min<int>(nt, static_cast<int>(slots_.size()));
    for (int t = 0; t < nt_; ++t) {
      const auto [begin, end] = step_args::share(n, t, nt_);
      slots_[t].v.store(pack(begin, end), std::memory_order_relaxed);
    }
  }

  int64_t items() const { return n_; }

  // fn(i0, i1) over the items thread tid claims, `step` at a time, its own share first; then over the back halves
  // it takes over while some share has at least `least` items left (fewer: its owner is about to finish them).
  template <class F>
  void walk(int tid, int64_t step, int64_t least, const F& fn) {
    const double delay = tid == 0 ? first_thread_delay_us.load(std::memory_order_relaxed) : 0.0;
    for (;;) {
      for (;;) {
        const uint64_t was = slots_[tid].v.fetch_add(step, std::memory_order_relaxed);
        const int64_t next = lo(was), end = hi(was);
        if (next >= end) break;
        if (delay > 0) spin_for(delay);
        fn(next, std::min(next + step, end));
      }
      if (!take_over(tid, least)) return;
    }
  }

 private:
  struct alignas(64) Slot {  // [next, end) of one thread's share, next in the low half: one line per thread
    std::atomic<uint64_t> v{0};
  };
  static uint64_t pack(int64_t next, int64_t end) { return static_cast<uint64_t>(end) << 32 | uint64_t(next); }
  static int64_t lo(uint64_t v) { return static_cast<int64_t>(v & 0xffffffffu); }
  static int64_t hi(uint64_t v) { return static_cast<int64_t>(v >> 32); }

  // Moves the back half of the longest share left to thread tid's slot; false when none has `least` items left.
  bool take_over(int tid, int64_t least) {
    for (;;) {
      int victim = -1;
      uint64_t seen = 0;
      int64_t most = least - 1;
      for (int t = 0; t < nt_; ++t) {
        if (t == tid) continue;
        const uint64_t v = slots_[t].v.load(std::memory_order_relaxed);
        if (hi(v) - lo(v) > most) most = hi(v) - lo(v), victim = t, seen = v;
      }
      if (victim < 0) return false;
      const int64_t mid = lo(seen) + (hi(seen) - lo(seen)) / 2;  // the owner keeps [next, mid), at least 1 item goes
      if (slots_[victim].v.compare_exchange_weak(seen, pack(lo(seen), mid), std::memory_order_relaxed)) {
        slots_[tid].v.store(pack(mid, hi(seen)), std::memory_order_relaxed);
        take_overs.fetch_add(1, std::memory_order_relaxed);
        return true;
      }
    }
  }

  std::vector<Slot> slots_;
  int64_t n_ = 0;
  int nt_ = 0;
};

// Whether the fused bf16 step takes work over in Shares (the default); off only to measure fixed shares against it
// (decode_profile.py --shares; set_step_take_over in runs_ops.cpp).
inline std::atomic<bool> take_over_on{true};

// The AMX matmuls past a few rows hand their column-block pairs (or 16-column groups) out in Runs as threads come
// free (the default), or, off, as the fixed shares they had before (to measure one against the other: set_tile_runs
// in runs_ops.cpp): a prompt's rows and batched decode (amx_slices.h, amx_bf16.cpp), plain [N, K] weights at 2-64
// rows (amx_plain_bf16.cpp) and quantized rows from 16 outside the fused step (quant_amx.h linear). Why: a 2-vCPU VM's
// two vCPUs ran one thread of the compact bf16 gate_up at 512 rows at 0.46 and 0.95 TFLOP/s at the same time (an
// Emerald Rapids-class Xeon, session 43; which one was slow changed within minutes), so with fixed shares the fast one
// idled for half the call. Counted for the tests and prompt_split.py: the items taken in runs, and by thread 0.
inline std::atomic<bool> tile_runs_on{true};
inline std::atomic<int64_t> tile_runs_items{0}, tile_runs_first{0};

// fn(r0, r1) over the items of [0, n) that threads [t0, t1) of nt take (one thread each, as at::parallel_for(0, nt,
// 1, ...) hands them out; all of them on one inside another parallel region): runs of at least `least` items from
// `runs` while any are left (tile_runs_on), else each thread's fixed share (step_args::share, as at::parallel_for
// splits). Thread 0 spins first_thread_delay_us before each run (tests only). Which thread computes an item changes
// nothing in it.
template <class F>
inline void tile_pairs(Runs& runs, int64_t n, int64_t t0, int64_t t1, int nt, int64_t least, const F& fn) {
  // Read once here: a switch while threads are inside may have an item computed twice (same bits), never skipped.
  const bool on = tile_runs_on.load(std::memory_order_relaxed);
  for (int64_t t = t0; t < t1; ++t) {
    const int tid = static_cast<int>(t);
    if (!on) {
      const auto [p0, p1] = step_args::share(n, tid, nt);
      if (p0 < p1) fn(p0, p1);
      continue;
    }
    const double delay = tid == 0 ? first_thread_delay_us.load(std::memory_order_relaxed) : 0.0;
    for (int64_t r0, r1; runs.take(n, nt, least, r0, r1);) {
      tile_runs_items.fetch_add(r1 - r0, std::memory_order_relaxed);
      if (tid == 0) tile_runs_first.fetch_add(r1 - r0, std::memory_order_relaxed);
      if (delay > 0) spin_for(delay);
      fn(r0, r1);
    }
  }
}

}  // namespace deploykit
