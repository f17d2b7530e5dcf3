// The whole forward pass of one decoding sequence (batch 1, one new token) in one native call.
//
// At batch 1 a step streams every weight once (~25 ms for the 717 MB benchmark model on 2 cores) and the
// per-op path adds ~25 PyTorch dispatches and OpenMP fork/joins per layer (~100 us, ~10 % of the step). Here
// one OpenMP region runs every layer and threads meet at a barrier only where a phase needs the whole result of
// the previous one. Every value is computed by the same code as the per-op native path (gemv.h, row_ops.h,
// attention.h), in the same order, so the two agree bitwise; tests compare them. (The one exception is the last
// residual add, which the per-op path leaves to PyTorch: it keeps bf16 denormals that vec.h flushes to zero.)
//
// Per layer; the residual h [H] and the normed x [H] are private to each thread, which computes them itself:
//   qkv = x W_qkv^T + b                     column blocks split between threads          | barrier
//   per KV head: q/k norm, rotary, K/V written to the cache slot, attention -> o [Hq D]  | barrier
//   d = o W_o^T + b                         column blocks split                          | barrier
//   h += d; x = rms_norm(h) * ln2           every thread
//   y = silu(x W_gate^T) * (x W_up^T)       gate block j and up block j on one thread    | barrier
//   d = y W_down^T + b                      column blocks split                          | barrier
//   h += d; x = rms_norm(h) * ln1 of the next layer
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "attention.h"
#include "gemv.h"
#include "row_ops.h"

namespace deploykit {
namespace {

using bf16 = at::BFloat16;

// Per-layer entries of the `weights` list, in this order (None where the model has no such tensor).
enum Slot { LN1, QKV, QKV_BIAS, QK_NORM, O, O_BIAS, LN2, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, PER_LAYER };

struct Layer {
  const bf16 *ln1, *qkv, *qk_norm, *o, *ln2, *gate_up, *down;
  const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
  bf16* kv;
  int64_t window;
};

struct Matrix {
  Slot slot;
  int64_t rows, cols;
  const char* name;
};

void check_packed(const at::Tensor& w, int64_t N, int64_t K, int64_t layer, const char* name) {
  TORCH_CHECK(w.dim() == 4 && w.size(0) * 16 == N && w.size(1) * 2 == K && w.size(2) == 16 && w.size(3) == 2 &&
                  w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "layer ", layer, " ", name, ": expected a packed bf16 [", N / 16, ", ", K / 2, ", 16, 2] weight");
}

const float* bias_ptr(const std::optional<at::Tensor>& b, int64_t N, int64_t layer, const char* name) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK(b->dim() == 1 && b->size(0) == N && b->scalar_type() == at::kFloat && b->is_contiguous(), "layer ",
              layer, " ", name, ": expected a contiguous fp32 [", N, "] bias");
  return b->data_ptr<float>();
}

const bf16* vector_ptr(const std::optional<at::Tensor>& t, int64_t n, int64_t layer, const char* name) {
  TORCH_CHECK(t.has_value() && t->defined() && t->numel() == n && t->scalar_type() == at::kBFloat16 &&
                  t->is_contiguous(),
              "layer ", layer, " ", name, ": expected a contiguous bf16 tensor of ", n, " elements");
  return t->data_ptr<bf16>();
}

// [begin, end) of n items for thread tid of nt, contiguous and as equal as possible.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt) {
  const int64_t chunk = (n + nt - 1) / nt;
  return {std::min<int64_t>(n, tid * chunk), std::min<int64_t>(n, (tid + 1) * chunk)};
}

}  // namespace

// h [1, H] bf16: the token's embedding in, the last layer's residual stream out (before the final norm).
// weights: PER_LAYER entries per layer (see Slot), matrices packed as gemv.h describes, biases fp32.
// kv: per layer [NB, bs, 2, Hkv, D]. cos, sin: the rotary tables [max_len, D] (sin signed, rotate-half).
// position int64 [1], table int32 [1, W] block ids, length int32 [1] context incl. this token, slot int64 [1].
void decode_step_(const at::Tensor& h, const std::vector<std::optional<at::Tensor>>& weights,
                  const std::vector<at::Tensor>& kv, const std::vector<int64_t>& windows, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& position, const at::Tensor& table,
                  const at::Tensor& length, const at::Tensor& slot, int64_t num_heads, int64_t num_kv_heads,
                  double eps, double scale) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && h.scalar_type() == at::kBFloat16 && h.is_contiguous(),
              "h must be a contiguous bf16 [1, H] tensor");
  const int64_t L = (int64_t)kv.size(), H = h.size(1), Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(L > 0 && (int64_t)weights.size() == L * PER_LAYER && (int64_t)windows.size() == L,
              "expected ", PER_LAYER, " weights and one window per KV cache layer");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin must be contiguous bf16 [max_len, D] tables");
  const int64_t D = cos.size(1), G = Hq / Hkv, NQKV = (Hq + 2 * Hkv) * D;
  TORCH_CHECK(D % 32 == 0 && D <= attention::MAX_HEAD_DIM, "head_dim must be a multiple of 32 up to ",
              attention::MAX_HEAD_DIM);
  const auto& gu0 = weights[GATE_UP];
  TORCH_CHECK(gu0.has_value() && gu0->dim() == 4, "layer 0 gate_up: expected a packed weight");
  const int64_t I = gu0->size(0) * 8;
  TORCH_CHECK(I % 16 == 0, "intermediate size must be a multiple of 16");
  for (const at::Tensor* t : {&position, &slot})
    TORCH_CHECK(t->numel() == 1 && t->scalar_type() == at::kLong, "position and slot must be int64 [1]");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == 1 && table.scalar_type() == at::kInt && table.is_contiguous(),
              "table must be a contiguous int32 [1, W] tensor");
  TORCH_CHECK(length.numel() == 1 && length.scalar_type() == at::kInt, "length must be int32 [1]");

  std::vector<Layer> layers(L);
  int64_t NB = -1, bs = 0;
  for (int64_t l = 0; l < L; ++l) {
    auto w = [&](int s) -> const std::optional<at::Tensor>& { return weights[l * PER_LAYER + s]; };
    const Matrix matrices[] = {{QKV, NQKV, H, "qkv"}, {O, H, Hq * D, "o_proj"}, {GATE_UP, 2 * I, H, "gate_up"},
                               {DOWN, H, I, "down_proj"}};
    for (const Matrix& m : matrices) {
      TORCH_CHECK(w(m.slot).has_value() && w(m.slot)->defined(), "layer ", l, " ", m.name, " is missing");
      check_packed(*w(m.slot), m.rows, m.cols, l, m.name);
    }
    Layer& y = layers[l];
    y.ln1 = vector_ptr(w(LN1), H, l, "input_layernorm");
    y.ln2 = vector_ptr(w(LN2), H, l, "post_attention_layernorm");
    y.qk_norm = w(QK_NORM).has_value() && w(QK_NORM)->defined()
                    ? vector_ptr(w(QK_NORM), (Hq + Hkv) * D, l, "qk_norm") : nullptr;
    y.qkv = w(QKV)->data_ptr<bf16>();
    y.o = w(O)->data_ptr<bf16>();
    y.gate_up = w(GATE_UP)->data_ptr<bf16>();
    y.down = w(DOWN)->data_ptr<bf16>();
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
  }
  // Validate every index before the parallel region (errors cannot leave it): a bad one would read or write
  // outside the tables and the cache.
  const int64_t pos = position.data_ptr<int64_t>()[0], dst = slot.data_ptr<int64_t>()[0];
  const int64_t end = length.data_ptr<int32_t>()[0], W = table.size(1);
  const int32_t* tbl = table.data_ptr<int32_t>();
  TORCH_CHECK(pos >= 0 && pos < cos.size(0), "position ", pos, " is outside the rotary table [0, ", cos.size(0), ")");
  TORCH_CHECK(end >= 1 && end <= W * bs, "context length ", end, " is outside [1, ", W * bs, "]");
  TORCH_CHECK(dst >= 0 && dst < NB * bs, "slot ", dst, " is outside the cache [0, ", NB * bs, ")");
  for (int64_t j = 0; j < (end + bs - 1) / bs; ++j)
    TORCH_CHECK(tbl[j] >= 0 && tbl[j] < NB, "block id ", tbl[j], " out of range");

  // Shared activations; every element has one writer per phase.
  std::vector<bf16> qkv(NQKV), o(Hq * D), d(H), gu(2 * I), act(I);
  // Per thread: its copy of the residual stream and its norm, and attention scratch sized up front, so nothing
  // inside the parallel region allocates (an exception there could not be caught).
  const int max_threads = at::get_num_threads();
  const int64_t stride = (2 * H + 31) / 32 * 32;  // a multiple of 64 bytes per thread
  std::vector<bf16> own(stride * max_threads);
  std::vector<attention::Scratch> scratches(max_threads);
  for (auto& s : scratches) {
    s.scores.reserve(G * end);
    s.acc.reserve(G * D);
    s.inv.reserve(G);
  }
  bf16* hp = h.data_ptr<bf16>();
  const bf16* cr = cos.data_ptr<bf16>() + pos * D;
  const bf16* sr = sin.data_ptr<bf16>() + pos * D;
  const float fscale = (float)scale, feps = (float)eps;
  const int64_t row = 2 * Hkv * D;

#pragma omp parallel num_threads(max_threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    bf16* res = own.data() + stride * tid;
    bf16* x = res + H;
    std::copy(hp, hp + H, res);
    attention::Scratch& scratch = scratches[tid];
    const auto [qb0, qb1] = share(NQKV / 16, tid, nt);
    const auto [ob0, ob1] = share(H / 16, tid, nt);
    const auto [jb0, jb1] = share(I / 16, tid, nt);
    const auto [kh0, kh1] = share(Hkv, tid, nt);
    const int64_t J = I / 16;
    rows::rms_norm(res, layers[0].ln1, H, feps, x);
    for (int64_t l = 0; l < L; ++l) {
      const Layer& y = layers[l];
      gemv::packed_range<1>(x, 0, y.qkv, H / 2, qb0, qb1, y.qkv_bias, qkv.data(), 0);
#pragma omp barrier
      const attention::PagedKV cache{y.kv, bs, Hkv, D};
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        bf16* k = qkv.data() + (Hq + kh) * D;
        const bf16* v = qkv.data() + (Hq + Hkv + kh) * D;
        for (int64_t g = 0; g <= G; ++g) {  // the G query heads of this KV head, then the key head
          const int64_t head = g < G ? kh * G + g : Hq + kh;
          bf16* r = qkv.data() + head * D;
          if (y.qk_norm) rows::rms_norm(r, y.qk_norm + head * D, D, feps, r);
          rows::rotary(r, cr, sr, D);
        }
        std::memcpy(y.kv + dst * row + kh * D, k, D * sizeof(bf16));
        std::memcpy(y.kv + dst * row + (Hkv + kh) * D, v, D * sizeof(bf16));
        attention::attend(qkv.data() + kh * G * D, cache, tbl, end, y.window, kh, G, fscale, scratch,
                          o.data() + kh * G * D);
      }
#pragma omp barrier
      gemv::packed_range<1>(o.data(), 0, y.o, Hq * D / 2, ob0, ob1, y.o_bias, d.data(), 0);
#pragma omp barrier
      rows::add_(res, d.data(), H);
      rows::rms_norm(res, y.ln2, H, feps, x);
      // Gate block j and up block J + j on the same thread, so it can apply silu(gate) * up to its own columns
      // without waiting; 4 + 4 blocks at a time keep 8 weight streams in flight, as packed_range does.
      int64_t j = jb0;
      for (; j + 4 <= jb1; j += 4) {
        const int64_t ids[8] = {j, j + 1, j + 2, j + 3, J + j, J + j + 1, J + j + 2, J + j + 3};
        gemv::packed_blocks<8, 1>(x, 0, y.gate_up, H / 2, ids, y.gate_up_bias, gu.data(), 0);
      }
      for (; j < jb1; ++j) {
        const int64_t ids[2] = {j, J + j};
        gemv::packed_blocks<2, 1>(x, 0, y.gate_up, H / 2, ids, y.gate_up_bias, gu.data(), 0);
      }
      rows::silu_mul(gu.data() + jb0 * 16, gu.data() + I + jb0 * 16, (jb1 - jb0) * 16, act.data() + jb0 * 16);
#pragma omp barrier
      gemv::packed_range<1>(act.data(), 0, y.down, I / 2, ob0, ob1, y.down_bias, d.data(), 0);
#pragma omp barrier
      rows::add_(res, d.data(), H);
      if (l + 1 < L) rows::rms_norm(res, layers[l + 1].ln1, H, feps, x);
    }
    if (tid == 0) std::copy(res, res + H, hp);
  }
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def(
      "decode_step_(Tensor(a!) h, Tensor?[] weights, Tensor(b!)[] kv, int[] windows, Tensor cos, Tensor sin, "
      "Tensor position, Tensor table, Tensor length, Tensor slot, int num_heads, int num_kv_heads, float eps, "
      "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("decode_step_", &decode_step_);
}

}  // namespace deploykit
