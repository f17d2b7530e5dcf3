// quant_linear: x [M, K] (bf16 or fp32) times a quantized weight (quant_layout.h) -> [M, N], for every M.
// Compiled into every kernel build: with AVX512-VNNI's GEMV (quant_gemv.h) in the AVX-512 ones, with AVX2's
// (quant_gemv_avx2.h: the same int32 sums and fp32 steps per output) in the AVX2 one, which holds only the
// quantized-weight and fp32 ops.
//
// x is quantized to int8 per block of 32 once per call (quant_act.h). Up to 4 rows take the GEMV of quant_gemv.h
// with each weight line loaded once for all of them, the 16-row groups split evenly between threads (the fused
// decode step runs the same code). More rows (batched decode, prefill) go in tiles of 4 over a pair of groups at a
// time (quant_rows.h tiled_rows, which the fused step runs for 5-16 rows too); on AMX-INT8 CPUs from 16 rows they
// run on AMX tiles instead (quant_amx.h), with the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>

#include <optional>
#include <string>
#include <vector>

#include "op_args.h"
#include "runs.h"
#ifdef __AVX512F__
#include "quant_gemv.h"
#else
#include "quant_gemv_avx2.h"
#endif
#include "quant_amx.h"

namespace deploykit {
namespace {

using namespace quant;

#ifdef __AVX512F__
constexpr const char* NEEDS = "AVX512-VNNI";
bool cpu_runs_it() {
  static const bool yes = __builtin_cpu_supports("avx512vnni");
  return yes;
}
#else
constexpr const char* NEEDS = "AVX2, FMA and F16C";
bool cpu_runs_it() {
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
}
#endif

template <class In, class Out>
void run(const In* x, int64_t ldx, int64_t M, const Matrix& w, const float* bias, Out* out) {
  const int64_t K = w.K, N = w.N, NG = N / 16;
  const bool tiles = quant_amx::takes(M);
  const int64_t padded = tiles ? (M + 15) / 16 * 16 : M;  // the tiles take whole 16-row blocks; the rest stay zero
  ActBuffer buf(padded, K);
  std::vector<Act> acts(padded);
  for (int64_t m = 0; m < padded; ++m) acts[m] = buf.row(m);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize(x + m * ldx, K, acts[m]);
  });
  if (tiles) {
    quant_amx::linear(acts.data(), M, w, bias, out);
    return;
  }
  // Up to 4 rows the GEMV is bound by the weight stream: each thread one contiguous share. Past 4, compute-bound: the
  // groups in runs as threads come free (runs.h: why). On a 2-core Zen 3 (AVX2), against fixed shares: a 512-token
  // prefill 0.91x the time on Q4_0, 0.86x on Q4_K_M; a 64-token one 0.89x on Q4_0.
  const auto tiles_of = [&](int64_t b0, int64_t b1) { tiled_rows(M, acts.data(), w, b0, b1, bias, out, N); };
  if (M <= 4) at::parallel_for(0, NG, 8, tiles_of);
  else in_runs(NG, 2, tiles_of);
}

}  // namespace

// x [M, K] bf16/fp32 with contiguous rows, blob [N, K] quantized, bias fp32/bf16 [N] or None -> [M, N] in x's dtype,
// or fp32 with float_out (logits).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blob, const std::optional<at::Tensor>& bias,
                        bool float_out) {
  TORCH_CHECK(cpu_runs_it(), "this build's quantized kernels need ", NEEDS, "; this CPU lacks it (the engine "
              "dequantizes the weights at load instead)");
  const Matrix w = matrix(blob);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be a 2-D bf16 or fp32 tensor");
  TORCH_CHECK(x.size(1) == w.K, "x has K=", x.size(1), ", the quantized weight has K=", w.K);
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) == 1, "x rows must be contiguous");
  const at::Tensor b = op_args::float_bias(bias, w.N);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, w.N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (M == 0) return out;
  const int64_t ldx = x.stride(0);
  if (x.scalar_type() == at::kBFloat16) {
    if (float_out)
      run(x.data_ptr<at::BFloat16>(), ldx, M, w, bp, out.data_ptr<float>());
    else
      run(x.data_ptr<at::BFloat16>(), ldx, M, w, bp, out.data_ptr<at::BFloat16>());
  } else {
    run(x.data_ptr<float>(), ldx, M, w, bp, out.data_ptr<float>());
  }
  return out;
}

// Turns the AMX-INT8 path on (where the CPU has AMX-INT8, this build has its code and the OS grants tile state) or
// off; true if it is now on.
bool set_quant_amx(bool on) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1);  // CPUID.(7,0):EDX[25] AMX-INT8
  quant_amx::enabled.store(on && cpu && amx_init());
#else
  (void)on;
#endif
  return quant_amx::enabled.load();
}

// Turns GFNI for the 5-bit formats' fifth bits on (where the CPU has it and this build is an AVX-512 one) or off
// (quant_gemv.h or_fifth: both give the same bytes); true if it is now on.
bool set_quant_gfni(bool on) {
#ifdef __AVX512F__
  quant::fifth_gfni.store(on && quant::cpu_has_gfni());
  return quant::fifth_gfni.load();
#else
  (void)on;
  return false;
#endif
}

// format: a ggml type id (quant_layout.h), or none for every format.
void set_quant_stream_ahead(int64_t bytes, std::optional<int64_t> format) {
  TORCH_CHECK(bytes >= 0 && bytes <= 65536 && bytes % 64 == 0,
              "the quantized GEMV's prefetch distance is 0 (off) or a multiple of 64 bytes up to 65536, not ", bytes);
  TORCH_CHECK(!format || (*format >= 0 && *format < 16 && quant::known(static_cast<int32_t>(*format))),
              "not a quantized format's ggml type id: ", *format);
  for (int32_t f = 0; f < 16; ++f)
    if (!format || f == *format) quant::stream_ahead.bytes[f].store(bytes);
}

void reset_quant_stream_ahead() { quant::stream_ahead.reset(); }

// Where the requested lines go, for every format: "nta" or "l2" (quant_stream.h Hint).
void set_quant_stream_hint(c10::string_view hint) {
  TORCH_CHECK(hint == "nta" || hint == "l2", "the quantized kernels' prefetch hint is \"nta\" or \"l2\", not \"",
              std::string(hint), "\"");
  quant::stream_ahead.hint.store(hint == "l2" ? quant::Hint::L2 : quant::Hint::NTA);
}

std::string quant_stream_hint() { return quant::stream_ahead.hint.load() == quant::Hint::L2 ? "l2" : "nta"; }

int64_t quant_stream_ahead(int64_t format) {
  TORCH_CHECK(format >= 0 && format < 16 && quant::known(static_cast<int32_t>(format)),
              "not a quantized format's ggml type id: ", format);
  return quant::stream_ahead.bytes[format].load();
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("quant_linear(Tensor x, Tensor blob, Tensor? bias, bool float_out) -> Tensor");
  m.def("set_quant_stream_ahead(int bytes, int? format=None) -> ()", &set_quant_stream_ahead);
  m.def("reset_quant_stream_ahead() -> ()", &reset_quant_stream_ahead);
  m.def("quant_stream_ahead(int format) -> int", &quant_stream_ahead);
  m.def("set_quant_stream_hint(str hint) -> ()", &set_quant_stream_hint);
  m.def("quant_stream_hint() -> str", &quant_stream_hint);
  m.def("set_quant_amx(bool on) -> bool", &set_quant_amx);
  m.def("set_quant_gfni(bool on) -> bool", &set_quant_gfni);
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("quant_linear", &quant_linear); }

}  // namespace deploykit
