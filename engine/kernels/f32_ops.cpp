// fp32 ops of the per-op decoder path: RMSNorm with the residual add, SiLU-and-mul, rotary, the per-head norm, and
// decode attention read in place from an fp32 paged KV cache. The row code is f32_rows.h, which the fused fp32 decode
// step (decode_step_f32.cpp) runs too; these ops serve prefill, steps past its rows, and models whose matrices it
// does not read (an fp32 checkpoint's).
//
// fp32 runs where a CPU lacks AVX-512 (the AVX2 build: quantized weights on its int8 GEMV, float matmuls on
// PyTorch), and wherever a user asks for it. At decode sizes each of these replaced a chain of 3-8 eager PyTorch
// kernels costing dispatch and an OpenMP region apiece; on a 2-core Zen 3 at a Q4_0 model's batch-1 step they took
// ~4-5 ms of ~20 beside the GEMVs, attention the largest part (SDPA after gathering the context with index_select).
// Written with AVX2 and FMA only, so every build (build.py) holds the same code and computes the same bits; the
// PyTorch compositions in engine/kernels/__init__.py are the reference the tests compare against.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

#include "f32_rows.h"
#include "paged_kv.h"

namespace deploykit {
namespace {

using f32::MAX_HEAD_DIM, f32::rms_norm;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              " must be a [M, H] fp32 tensor with contiguous rows");
}

void check_heads(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1,
              "x must be a [M, heads, D] fp32 tensor with contiguous head rows");
}

// Rows per parallel task: enough work that a task outweighs an OpenMP hand-off (~1 us).
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace

// h [M, H] (updated in place to h + delta when delta is given), w [H] -> rms_norm(h) * w [M, H].
at::Tensor add_rms_norm_f32(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& w,
                            double eps) {
  check_rows(h, "h");
  const int64_t M = h.size(0), H = h.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w must be a contiguous fp32 [H] tensor");
  const bool add = delta.has_value() && delta->defined();
  if (add) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->size(0) == M && delta->size(1) == H, "delta must have h's shape");
  }
  at::Tensor out = at::empty({M, H}, h.options());
  float* hp = h.data_ptr<float>();
  const float* dp = add ? delta->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldh = h.stride(0), ldd = add ? delta->stride(0) : 0;
  at::parallel_for(0, M, grain(H), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* row = hp + m * ldh;
      if (add) f32::add_(row, dp + m * ldd, H);
      rms_norm(row, wp, H, (float)eps, op + m * H);
    }
  });
  return out;
}

// gate_up [M, 2I] (gate then up) -> silu(gate) * up [M, I], silu(x) = x / (1 + exp(-x)).
at::Tensor silu_mul_f32(const at::Tensor& gu) {
  check_rows(gu, "gate_up");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({M, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld = gu.stride(0);
  at::parallel_for(0, M, grain(I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) f32::silu_mul(gp + m * ld, gp + m * ld + I, I, op + m * I);
  });
  return out;
}

// In place on x [M, heads, D] (rows and heads may be strided views, D contiguous), HF rotate-half layout:
// x = x * cos + roll(x, D/2) * sin_signed, with cos, sin_signed [M, D] (rows of the tables).
void rotary_f32_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(x);
  const int64_t M = x.size(0), NH = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == M && t->size(1) == D && t->scalar_type() == at::kFloat &&
                    t->stride(1) == 1,
                "cos/sin must be [M, D] fp32 with contiguous rows");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), lc = cos.stride(0), ls = sin.stride(0);
  at::parallel_for(0, M * NH, grain(D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / NH;
      float* r = xp + m * s0 + (i % NH) * s1;
      f32::rotary(r, cp + m * lc, sp + m * ls, D);
    }
  });
}

// In place on x [M, heads, D]: each head row becomes rms_norm(row) * w[head], w [heads, D] (Qwen3's q/k norm).
void head_rms_norm_f32_(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_heads(x);
  const int64_t M = x.size(0), NH = x.size(1), D = x.size(2);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == NH && w.size(1) == D && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w must be a contiguous fp32 [heads, D] tensor");
  float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, M * NH, grain(D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* r = xp + (i / NH) * s0 + (i % NH) * s1;
      rms_norm(r, wp + (i % NH) * D, D, (float)eps, r);
    }
  });
}

// q [B, Hq, D] (rows may be strided, heads D apart), kv [NB, bs, 2, Hkv, D] contiguous fp32, tables int32 [B, W]
// (block ids, padded with anything), lens int32 [B] (context length including this token, <= W * bs) -> [B, Hq, D].
// window > 0: only the last `window` keys (key j visible to query i when i - window < j <= i).
at::Tensor decode_attention_f32(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                                const at::Tensor& lens, double scale, int64_t window) {
  const paged::Call c = paged::check(q, kv, tables, lens, at::kFloat, "fp32", 8, MAX_HEAD_DIM);
  const int64_t B = c.B, Hq = c.Hq, D = c.D, bs = c.bs, Hkv = c.Hkv, W = c.W, G = c.G;
  const int32_t *tp = c.tables, *lp = c.lens;
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    static thread_local f32::Scratch scratch;  // grown once per thread, not zero-filled anew on every call
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      f32::attend(qp + b * qs0 + h * G * D, kp, bs, Hkv, D, tp + b * W, lp[b], window, h, G, (float)scale, scratch,
             op + (b * Hq + h * G) * D);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("add_rms_norm_f32(Tensor(a!) h, Tensor? delta, Tensor w, float eps) -> Tensor");
  m.def("silu_mul_f32(Tensor gate_up) -> Tensor");
  m.def("rotary_f32_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("head_rms_norm_f32_(Tensor(a!) x, Tensor w, float eps) -> ()");
  m.def("decode_attention_f32(Tensor q, Tensor kv, Tensor tables, Tensor lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("add_rms_norm_f32", &add_rms_norm_f32);
  m.impl("silu_mul_f32", &silu_mul_f32);
  m.impl("rotary_f32_", &rotary_f32_);
  m.impl("head_rms_norm_f32_", &head_rms_norm_f32_);
  m.impl("decode_attention_f32", &decode_attention_f32);
}

}  // namespace deploykit
