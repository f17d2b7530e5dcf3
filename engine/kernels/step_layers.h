// decode_step.cpp's per-layer arguments, checked and resolved before its parallel region (errors cannot leave it):
// each layer's four matrices (step_matrix.h Weight), norms, fp32 biases, KV cache and sliding window.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "step_args.h"
#include "step_matrix.h"

namespace deploykit {
namespace step {

using step_args::Slot;

struct Layer {
  const bf16 *ln1, *qk_norm, *ln2;
  Weight qkv, o, gate_up, down;
  const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
  bf16* kv;
  int64_t window;
};

struct Matrix {
  Slot slot;
  int64_t rows, cols;
  const char* name;
};

inline const float* bias_ptr(const std::optional<at::Tensor>& b, int64_t N, int64_t layer, const char* name) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK(b->dim() == 1 && b->size(0) == N && b->scalar_type() == at::kFloat && b->is_contiguous(), "layer ",
              layer, " ", name, ": expected a contiguous fp32 [", N, "] bias");
  return b->data_ptr<float>();
}

inline const bf16* vector_ptr(const std::optional<at::Tensor>& t, int64_t n, int64_t layer, const char* name) {
  TORCH_CHECK(t.has_value() && t->defined() && t->numel() == n && t->scalar_type() == at::kBFloat16 &&
                  t->is_contiguous(),
              "layer ", layer, " ", name, ": expected a contiguous bf16 tensor of ", n, " elements");
  return t->data_ptr<bf16>();
}

struct Layers {
  std::vector<Layer> layers;
  int64_t NB, bs;  // the KV cache's blocks and tokens a block, alike in every layer
};

// weights: step_args::PER_LAYER entries per layer; kv: per layer [NB, bs, 2, Hkv, D] bf16; B rows, H hidden, Hq and
// Hkv heads of D, I the MLP's width.
inline Layers checked_layers(const std::vector<std::optional<at::Tensor>>& weights, const std::vector<at::Tensor>& kv,
                             const std::vector<int64_t>& windows, int64_t B, int64_t H, int64_t Hq, int64_t Hkv,
                             int64_t D, int64_t I) {
  using namespace step_args;
  const int64_t L = (int64_t)kv.size(), NQKV = (Hq + 2 * Hkv) * D;
  Layers out{std::vector<Layer>(L), -1, 0};
  int64_t &NB = out.NB, &bs = out.bs;
  for (int64_t l = 0; l < L; ++l) {
    auto w = [&](int s) -> const std::optional<at::Tensor>& { return weights[l * PER_LAYER + s]; };
    const Matrix matrices[] = {{QKV, NQKV, H, "qkv"}, {O, H, Hq * D, "o_proj"}, {GATE_UP, 2 * I, H, "gate_up"},
                               {DOWN, H, I, "down_proj"}};
    Layer& y = out.layers[l];
    Weight* dst[] = {&y.qkv, &y.o, &y.gate_up, &y.down};
    for (int i = 0; i < 4; ++i) {
      const Matrix& m = matrices[i];
      TORCH_CHECK(w(m.slot).has_value() && w(m.slot)->defined(), "layer ", l, " ", m.name, " is missing");
      *dst[i] = step::weight(*w(m.slot), m.rows, m.cols, l, m.name);
    }
    y.ln1 = vector_ptr(w(LN1), H, l, "input_layernorm");
    y.ln2 = vector_ptr(w(LN2), H, l, "post_attention_layernorm");
    y.qk_norm = w(QK_NORM).has_value() && w(QK_NORM)->defined()
                    ? vector_ptr(w(QK_NORM), (Hq + Hkv) * D, l, "qk_norm") : nullptr;
    y.qkv_bias = bias_ptr(w(QKV_BIAS), NQKV, l, "qkv bias");
    y.o_bias = bias_ptr(w(O_BIAS), H, l, "o_proj bias");
    y.gate_up_bias = bias_ptr(w(GATE_UP_BIAS), 2 * I, l, "gate_up bias");
    y.down_bias = bias_ptr(w(DOWN_BIAS), H, l, "down_proj bias");
    const at::Tensor& c = kv[l];
    TORCH_CHECK(c.dim() == 5 && c.size(2) == 2 && c.size(3) == Hkv && c.size(4) == D &&
                    c.scalar_type() == at::kBFloat16 && c.is_contiguous(),
                "layer ", l, " KV cache must be a contiguous bf16 [blocks, block_size, 2, ", Hkv, ", ", D, "] tensor");
    TORCH_CHECK(NB < 0 || (c.size(0) == NB && c.size(1) == bs), "KV cache layers differ in shape");
    NB = c.size(0);
    bs = c.size(1);
    y.kv = c.data_ptr<bf16>();
    y.window = windows[l];
    for (const Weight* m : {&y.qkv, &y.o, &y.gate_up, &y.down})
      TORCH_CHECK(B <= MAX_ROWS || m->wide(), "layer ", l, ": ", B, " rows take every matrix quantized or compact on "
                  "AMX tiles; with others 1 <= B <= ", MAX_ROWS);
  }
  return out;
}

}  // namespace step
}  // namespace deploykit
