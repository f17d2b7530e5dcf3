// Fused bf16 element-wise ops of a decoder layer (RMSNorm with the residual add, SiLU-and-mul, rotary).
//
// Each replaces a chain of 3-5 eager PyTorch kernels. At decode sizes ([1..16, 896]) those kernels
// cost microseconds of dispatch and an OpenMP region each and move almost no data, so per token they
// added up to ~20 % of a step beside the weight-streaming GEMVs. Arithmetic is fp32 inside; the
// PyTorch compositions in engine/kernels/__init__.py are the reference the tests compare against.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>

#include "vec.h"

namespace deploykit {
namespace {

using bf16 = at::BFloat16;
using namespace vec;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kBFloat16 && t.stride(1) == 1, name,
              " must be a [M, H] bf16 tensor with contiguous rows");
}

// Rows per parallel task: enough work that a task outweighs an OpenMP hand-off (~1 us).
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace

// h [M, H] (updated in place to h + delta when delta is given), w [H] -> rms_norm(h) * w [M, H].
at::Tensor add_rms_norm(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& w,
                        double eps) {
  check_rows(h, "h");
  const int64_t M = h.size(0), H = h.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "w must be a contiguous bf16 [H] tensor");
  const bool add = delta.has_value() && delta->defined();
  if (add) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->size(0) == M && delta->size(1) == H, "delta must have h's shape");
  }
  at::Tensor out = at::empty({M, H}, h.options());
  bf16* hp = h.data_ptr<bf16>();
  const bf16* dp = add ? delta->data_ptr<bf16>() : nullptr;
  const bf16* wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t ldh = h.stride(0), ldd = add ? delta->stride(0) : 0;
  at::parallel_for(0, M, grain(H), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      bf16* row = hp + m * ldh;
      __m512 ss = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= H; k += 16) {
        __m512 v = load16(row + k);
        if (add) {
          // Round the sum to bf16 first: the residual stream is stored in bf16, as in the reference.
          store16(row + k, _mm512_add_ps(v, load16(dp + m * ldd + k)));
          v = load16(row + k);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      float tail = 0.0f;
      for (; k < H; ++k) {
        if (add) row[k] = bf16(float(row[k]) + float(dp[m * ldd + k]));
        tail += float(row[k]) * float(row[k]);
      }
      const float r = 1.0f / std::sqrt((_mm512_reduce_add_ps(ss) + tail) / (float)H + (float)eps);
      const __m512 rv = _mm512_set1_ps(r);
      for (k = 0; k + 16 <= H; k += 16)
        store16(op + m * H + k, _mm512_mul_ps(_mm512_mul_ps(load16(row + k), rv), load16(wp + k)));
      if (k < H) {
        const __mmask16 mk = tail_mask(H - k);
        store16_masked(op + m * H + k,
                       _mm512_mul_ps(_mm512_mul_ps(load16_masked(row + k, mk), rv), load16_masked(wp + k, mk)), mk);
      }
    }
  });
  return out;
}

// gate_up [M, 2I] (gate then up) -> silu(gate) * up [M, I].
at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "gate_up");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, "gate_up must have an even number of columns");
  at::Tensor out = at::empty({M, I}, gu.options());
  const bf16* gp = gu.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t ld = gu.stride(0);
  const __m512 one = _mm512_set1_ps(1.0f);
  at::parallel_for(0, M, grain(I), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const bf16* g = gp + m * ld;
      const bf16* u = g + I;
      bf16* o = op + m * I;
      for (int64_t k = 0; k < I; k += 16) {
        const __mmask16 mk = k + 16 <= I ? (__mmask16)0xFFFF : tail_mask(I - k);
        const __m512 x = load16_masked(g + k, mk);
        const __m512 e = vec::exp(_mm512_sub_ps(_mm512_setzero_ps(), x));  // silu(x) = x / (1 + exp(-x))
        // x / d through a reciprocal estimate and one Newton step (2^-28 relative): a zmm divide would
        // make this op divider-bound.
        const __m512 d = _mm512_add_ps(one, e);
        __m512 r = _mm512_rcp14_ps(d);
        r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
        const __m512 s = _mm512_mul_ps(x, r);
        store16_masked(o + k, _mm512_mul_ps(s, load16_masked(u + k, mk)), mk);
      }
    }
  });
  return out;
}

// In place on x [M, heads, D] (rows and heads may be strided views, D contiguous), HF rotate-half
// layout: x = x * cos + roll(x, D/2) * sin_signed, with cos, sin_signed [M, D] (rows of the tables).
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1,
              "x must be a [M, heads, D] bf16 tensor with contiguous head rows");
  const int64_t M = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == M && t->size(1) == D && t->scalar_type() == at::kBFloat16 &&
                    t->stride(1) == 1,
                "cos/sin must be [M, D] bf16 with contiguous rows");
  bf16* xp = x.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), lc = cos.stride(0), ls = sin.stride(0);
  at::parallel_for(0, M * NH, grain(D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / NH;
      bf16* r = xp + m * s0 + (i % NH) * s1;
      const bf16* c = cp + m * lc;
      const bf16* s = sp + m * ls;
      for (int64_t k = 0; k < half; k += 16) {
        const __mmask16 mk = k + 16 <= half ? (__mmask16)0xFFFF : tail_mask(half - k);
        const __m512 a = load16_masked(r + k, mk), b = load16_masked(r + half + k, mk);
        // out[:half] = a*cos[:half] + b*sin[:half] (sin[:half] = -sin); out[half:] = b*cos[half:] + a*sin[half:]
        const __m512 lo = _mm512_fmadd_ps(b, load16_masked(s + k, mk), _mm512_mul_ps(a, load16_masked(c + k, mk)));
        const __m512 hi = _mm512_fmadd_ps(a, load16_masked(s + half + k, mk),
                                          _mm512_mul_ps(b, load16_masked(c + half + k, mk)));
        store16_masked(r + k, lo, mk);
        store16_masked(r + half + k, hi, mk);
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_", &rotary_);
}

}  // namespace deploykit
