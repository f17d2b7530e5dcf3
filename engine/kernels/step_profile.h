// Where the fused decode step's time goes, per thread and phase: off by default (one relaxed load per step),
// switched on by benchmarks/decode_profile.py through the step_profile op (step_profile.cpp). Both steps charge
// them: decode_step.cpp (bf16 activations) and decode_step_f32.cpp (fp32).
//
// A thread's time is split at the points where it changes work: each phase's compute, and separately the time
// it waits at the barrier that ends a phase (a thread that finishes early waits for the slowest one, so a
// large BARRIER share means imbalance or a preempted thread).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace deploykit {
namespace step_profile {

enum Phase { QKV, ATTENTION, O_PROJ, GATE_UP, DOWN, RESIDUAL, LM_HEAD, BARRIER, PHASES };
constexpr const char* NAMES[PHASES] = {"qkv",  "attention", "o_proj",  "gate_up",
                                       "down", "residual",  "lm_head", "barrier"};
constexpr int MAX_THREADS = 256;

inline std::atomic<bool> enabled{false};
inline std::atomic<int64_t> steps{0};

struct alignas(64) Row {  // one cache line per thread: no false sharing between the timers
  int64_t ns[PHASES];
  int64_t barriers;
};
inline Row rows[MAX_THREADS];

inline int64_t now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One per thread per step: mark(p) charges the time since the previous mark to phase p.
class Clock {
 public:
  explicit Clock(int tid)
      : row_(enabled.load(std::memory_order_relaxed) && tid < MAX_THREADS ? &rows[tid] : nullptr),
        last_(row_ ? now() : 0) {}
  void mark(Phase p) {
    if (!row_) return;
    const int64_t t = now();
    row_->ns[p] += t - last_;
    last_ = t;
    if (p == BARRIER) ++row_->barriers;
  }

 private:
  Row* row_;
  int64_t last_;
};

}  // namespace step_profile
}  // namespace deploykit
