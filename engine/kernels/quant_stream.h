// How far ahead the quantized kernels (the GEMVs of quant_gemv.h on AVX-512 and quant_gemv_avx2.h on AVX2, the
// tiles' decode in quant_amx.h) request the weight stream, per format, and into which cache level: one setting they
// all read, set and listed by the ops in qlinear.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
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
// after the first tile, so they do not stream ahead: non-temporal lines would be gone by then. Per format: Q4_0 streams
// without it. Across sessions 10 and 12 (decode_profile.py --gguf --stream-ahead 0,4096, benchmarks/README.md) Q8_0's
// and Q4_0's step was faster without it in 8 of the 13 runs (1.5-7.5 %), faster with it in 3 and tied in 2. Since
// then the kernels changed (embedded broadcasts, gate_up interleaved, down in segmented panels, runs of steps), and in
// session 56 Q8_0's step took 0.887x the time with 4 KiB NTA (12 rounds alternated, paired median; 2 KiB 0.911, 6 KiB
// 0.926; probe 35-56 GB/s) and 0.886x in another run (8 rounds), while Q4_0's took 1.024x (2 KiB 1.039, 8 KiB 1.141,
// L2 4 KiB 1.256; 10 rounds) and Q4_K_M's (Q4_K, Q6_K and Q5_0) without it 1.174x. The formats not measured (Q4_1,
// Q5_1, Q5_K) keep it.
// All of the above was measured on AMD CPUs. On Intel's, PREFETCHNTA slows the stream down and PREFETCHT1 (into L2)
// speeds it up, so there every format streams 8 KiB ahead into L2. On a 2-vCPU Sapphire Rapids-class Xeon with AMX
// (benchmarks/README.md, session 21, decode_profile.py --gguf, distances alternated in one process, best of 3 rounds):
//   PREFETCHNTA 256 B-4 KiB ahead: 1.6-1.9x the time a token (Q4_K_M), 2.1x (Q4_0), 2.6x (SmolLM2-135M's Q4_1);
//   PREFETCHT0 1-2 KiB: 7 % faster; PREFETCHT2 4 KiB: 1.45x faster;
//   PREFETCHT1 1, 2, 4, 6, 8, 16 KiB on Q4_K_M: 85 -> 100, 115, 128-132, 131, 128, 132 tok/s; Q4_0 2, 4, 8 KiB: 108 ->
//   137, 164, 172; Q8_0: 65 -> 83, 90, 90.
// L2 lines stay for the later 4-row tiles of a wider call (qlinear.cpp) and the tiles' decode (quant_amx.h), which
// stream ahead too where the hint is L2; NTA lines would be gone by then.
// Settable at run time (set_quant_stream_ahead for all formats or one, 0 turns it off; set_quant_stream_hint) so
// distances and hints can be compared in one process; reset_quant_stream_ahead restores these defaults.
constexpr int64_t STREAM_AHEAD = 4096, STREAM_AHEAD_L2 = 8192;
inline bool amd_cpu() {
  __builtin_cpu_init();  // the defaults are set during static initialisation, maybe before libgcc's own
  return __builtin_cpu_is("amd");
}
// Where a requested line goes: NTA (PREFETCHNTA, close to the core and out of the way of the other caches) or L2
// (PREFETCHT1).
enum class Hint : int32_t { NTA = 0, L2 = 1 };
inline Hint default_hint() { return amd_cpu() ? Hint::NTA : Hint::L2; }
#ifdef __AVX512F__
inline int64_t default_stream_ahead(int32_t format) {
  if (!amd_cpu()) return STREAM_AHEAD_L2;
  return format == Q4_0 ? 0 : STREAM_AHEAD;
}
#else
// The AVX2 build streams every format ahead on AMD CPUs. Measured on a 2-vCPU Zen 3 EPYC (benchmarks/README.md,
// "Quantized weights on AVX2"), the batch-1 engine step with 0, 1, 2, 4 and 8 KiB alternated in one process, median of
// 4: 4 KiB against none, Q4_0 43.5 against 39.5 tok/s, Q8_0 29.9 against 27.4, Q4_K_M 35.6 against 21.2; 1-8 KiB were
// within each other's spread.
inline int64_t default_stream_ahead(int32_t) { return amd_cpu() ? STREAM_AHEAD : STREAM_AHEAD_L2; }
#endif
struct StreamAhead {
  std::atomic<int64_t> bytes[16];  // by ggml type id (quant_layout.h Format)
  std::atomic<Hint> hint;
  static_assert(Q8_0 < 16 && Q4_K < 16 && Q6_K < 16);
  StreamAhead() { reset(); }
  void reset() {
    for (int32_t f = 0; f < 16; ++f) bytes[f].store(default_stream_ahead(f));
    hint.store(default_hint());
  }
};
inline StreamAhead stream_ahead;

// Requests unit u's share of the lines of the chunk at `chunk` (one 16-row group's chunk of format F), `ahead` bytes
// further down the stream: a few lines per unit rather than a chunk's worth at once (measured on Zen 4: whole chunks
// at once cost Q4_K_M 5-8 %, 37 lines in one burst). A prefetch never faults, so past the end of the weights is fine.
template <int F>
[[gnu::always_inline]] inline void request_ahead(const uint8_t* chunk, int u, int64_t ahead, Hint hint) {
  constexpr Info inf = info_of(F);
  constexpr int lines = inf.chunk_bytes / 64, per = (lines + inf.units - 1) / inf.units;
  const char* p = reinterpret_cast<const char*>(chunk + ahead);
  for (int i = u * per; i < std::min(lines, (u + 1) * per); ++i) {
    if (hint == Hint::L2)
      _mm_prefetch(p + i * 64, _MM_HINT_T1);
    else
      _mm_prefetch(p + i * 64, _MM_HINT_NTA);
  }
}

}  // namespace quant
}  // namespace deploykit
