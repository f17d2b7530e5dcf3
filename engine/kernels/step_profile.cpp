// The fused decode steps' profile ops (step_profile.h), in every build: both steps (decode_step.cpp under bf16
// activations, decode_step_f32.cpp under fp32) charge their phases to the same per-thread timers, and
// benchmarks/decode_profile.py reads them here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "step_profile.h"

namespace deploykit {
namespace {

// The profile since the last call: int64 [threads, phases + 1], nanoseconds per phase then the barrier count, and
// the number of steps; resets the counters and switches profiling on or off.
std::tuple<at::Tensor, int64_t> step_profile_(bool enable) {
  namespace sp = step_profile;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), sp::MAX_THREADS);
  at::Tensor out = at::empty({threads, sp::PHASES + 1}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t t = 0; t < threads; ++t) {
    std::copy(sp::rows[t].ns, sp::rows[t].ns + sp::PHASES, o + t * (sp::PHASES + 1));
    o[t * (sp::PHASES + 1) + sp::PHASES] = sp::rows[t].barriers;
  }
  const int64_t steps = sp::steps.exchange(0);
  for (auto& r : sp::rows) r = sp::Row{};
  sp::enabled.store(enable);
  return {out, steps};
}

std::vector<std::string> step_profile_phases() {
  return {step_profile::NAMES, step_profile::NAMES + step_profile::PHASES};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("step_profile_(bool enable) -> (Tensor, int)", &step_profile_);
  m.def("step_profile_phases() -> str[]", &step_profile_phases);
}

}  // namespace deploykit
