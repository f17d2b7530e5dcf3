// argmax_rows: the greedy token of each row of fp32 logits in one pass, with torch.argmax's answer (the first
// maximum; a NaN counts as the maximum, the first NaN wins).
//
// Why native: greedy decoding takes an argmax every step, and after a step has streamed the weights through the
// caches the ~12 small PyTorch ops of the two-level argmax (engine/sampling.py `_argmax`) cost ~150 us a token
// (measured on Zen 4, a 1,024-token vocabulary), 2-3 % of a 4-bit batch-1 step; this op, call included, takes 14 us
// there. The PyTorch argmax stays the reference the tests compare against.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "argmax.h"

namespace deploykit {

using argmax::argmax_row;

// x [R, V] fp32 with contiguous rows -> int64 [R].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows takes [R, V] fp32 logits with contiguous rows");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) <= std::numeric_limits<int32_t>::max(), "argmax_rows: bad vocabulary size");
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) o[r] = argmax_row(p + r * ld, V);
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("argmax_rows", &argmax_rows); }

}  // namespace deploykit
