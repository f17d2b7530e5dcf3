// How far ahead the quantized GEMVs (quant_gemv.h on AVX-512, quant_gemv_avx2.h on AVX2) request the weight stream,
// per format: one setting both kernels read, set and listed by the ops in qlinear.cpp.
#pragma once

#include <atomic>
#include <cstdint>

#include "quant_layout.h"

namespace deploykit {
namespace quant {

// Streaming ahead (the GEMV of up to 4 rows, whose weights are read once): each unit requests its share of the lines
// stream_ahead bytes further down its group's stream with PREFETCHNTA, a few lines per unit rather than a chunk's worth
// at once. First measured on Zen 4 in the batch-1 engine step (benchmarks/decode_profile.py --gguf, variants alternated
// in one process; superseded for Q8_0 and Q4_0 below): 3-12 % less time a token on Q4_0, Q8_0 and Q4_K_M at 3-4 KiB
// ahead, from both the GEMV and the work between steps, which finds more of its own lines still cached when the weights
// went through as non-temporal. Whole chunks requested at once instead cost Q4_K_M 5-8 % (37 lines in one burst), and
// T0/T1/T2 prefetches 1-4 KiB ahead were erratic (-5 to +28 %). Tiles of a wider call re-read a group pair from L1/L2
// after the first tile, so they do not stream ahead: non-temporal lines would be gone by then. Per format: Q8_0 and
// Q4_0 stream without it. Across sessions 10 and 12 (decode_profile.py --gguf --stream-ahead 0,4096,
// benchmarks/README.md) their step was faster without it in 8 of the 13 runs (1.5-7.5 %), faster with it in 3 (0.9-4.6
// %; two with DRAM slow, one mixed) and tied in 2; through quant_linear, without it Q8_0 was faster in 17 of 18 runs
// and Q4_0 in most, by the most when DRAM was fast. Q4_K_M was faster with it in all 3 of its runs (7-16 %). The
// formats not measured (Q4_1, Q5_0, Q5_1) keep it.
// All of the above was measured on AMD CPUs. On Intel's the same PREFETCHNTA requests slow the stream down instead, so
// no format streams ahead there: on a 2-vCPU Sapphire Rapids-class Xeon (benchmarks/README.md, session 20,
// decode_profile.py --gguf --stream-ahead 0,4096, paired medians) 4 KiB ahead took 1.60x the time a token on Q4_K_M,
// 2.6x on SmolLM2-135M's Q4_1 and 2.1x on Q4_0.
// Settable at run time (set_quant_stream_ahead, for all formats or one; 0 turns it off) so distances can be compared in
// one process; reset_quant_stream_ahead restores these defaults.
constexpr int64_t STREAM_AHEAD = 4096;
inline bool amd_cpu() {
  __builtin_cpu_init();  // the defaults are set during static initialisation, maybe before libgcc's own
  return __builtin_cpu_is("amd");
}
#ifdef __AVX512F__
inline int64_t default_stream_ahead(int32_t format) {
  return format == Q8_0 || format == Q4_0 || !amd_cpu() ? 0 : STREAM_AHEAD;
}
#else
// The AVX2 build streams every format ahead on AMD CPUs. Measured on a 2-vCPU Zen 3 EPYC (benchmarks/README.md,
// "Quantized weights on AVX2"), the batch-1 engine step with 0, 1, 2, 4 and 8 KiB alternated in one process, median of
// 4: 4 KiB against none, Q4_0 43.5 against 39.5 tok/s, Q8_0 29.9 against 27.4, Q4_K_M 35.6 against 21.2; 1-8 KiB were
// within each other's spread.
inline int64_t default_stream_ahead(int32_t) { return amd_cpu() ? STREAM_AHEAD : 0; }
#endif
struct StreamAhead {
  std::atomic<int64_t> bytes[16];  // by ggml type id (quant_layout.h Format)
  static_assert(Q8_0 < 16 && Q4_K < 16 && Q6_K < 16);
  StreamAhead() { reset(); }
  void reset() {
    for (int32_t f = 0; f < 16; ++f) bytes[f].store(default_stream_ahead(f));
  }
};
inline StreamAhead stream_ahead;

}  // namespace quant
}  // namespace deploykit
