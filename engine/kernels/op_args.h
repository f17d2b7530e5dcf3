// Argument checks every matmul op makes (packed GEMV, AMX packed and plain, row kernel): one message per
// mistake wherever it is made, and the fp32 bias the kernels add.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace deploykit {
namespace op_args {

// x [M, K] bf16 with contiguous rows (any row stride).
inline void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-D bf16 tensor");
  TORCH_CHECK(x.size(1) == K, "x has K=", x.size(1), ", weight has K=", K);
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) == 1, "x rows must be contiguous");
}

// The kernels add an fp32 bias [N]; undefined when there is none.
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be [N]");
  return bias->to(at::kFloat).contiguous();
}

// Weights are packed in blocks of BLOCK_N output columns; AMX tiles (packed and plain) take K in steps of BLOCK_K
// (one 64-byte tile row of bf16), and the plain AMX path N in steps of BLOCK_N.
constexpr int64_t BLOCK_N = 16;
constexpr int64_t BLOCK_K = 32;

// Packed weights [N/16, K/2, 16, 2] (one 64-byte line = k-pair j of 16 output columns).
inline void check_packed(const at::Tensor& wp) {
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == BLOCK_N && wp.size(3) == 2 && wp.is_contiguous() &&
                  wp.scalar_type() == at::kBFloat16,
              "packed weight must be a contiguous bf16 [N/16, K/2, 16, 2] tensor");
}

// Plain weights [N, K].
inline void check_plain(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "weight must be a contiguous 2-D bf16 tensor");
}

// Checked x [M, K] and bias [N], and the output [M, N] they produce, as the raw pointers the kernels walk.
struct Operands {
  at::Tensor out;   // [M, N] bf16
  at::Tensor bias;  // [N] fp32, or undefined
  const at::BFloat16* x;
  int64_t ldx;      // x's row stride
  const float* b;   // nullptr without a bias
  at::BFloat16* o;
};

inline Operands operands(const at::Tensor& x, int64_t K, int64_t N, const std::optional<at::Tensor>& bias) {
  check_x(x, K);
  Operands a;
  a.bias = float_bias(bias, N);
  a.out = at::empty({x.size(0), N}, x.options());
  a.x = x.data_ptr<at::BFloat16>();
  a.ldx = x.stride(0);
  a.b = a.bias.defined() ? a.bias.data_ptr<float>() : nullptr;
  a.o = a.out.data_ptr<at::BFloat16>();
  return a;
}

}  // namespace op_args
}  // namespace deploykit
