// Streaming-read probe for the memory roofline: reads every 64-byte line of a tensor once with
// AVX-512 loads (two AVX2 loads in the AVX2 build) across torch's threads. torch's own reductions
// are compute-bound below DRAM speed on 2 cores, so they understate the roofline the GEMV kernels
// are held to.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>

namespace deploykit {
namespace {

#ifdef __AVX512F__
using Line = __m512i;  // one 64-byte line
inline Line load(const Line* p) { return _mm512_load_si512(p); }
inline Line either(Line a, Line b) { return _mm512_or_si512(a, b); }
inline Line none() { return _mm512_setzero_si512(); }
inline int64_t fold(Line v) { return _mm512_reduce_or_epi64(v); }
#else
struct Line {
  __m256i lo, hi;
};
inline Line load(const Line* p) {
  const auto* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_load_si256(q), _mm256_load_si256(q + 1)};
}
inline Line either(Line a, Line b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline Line none() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline int64_t fold(Line v) {
  const __m256i o = _mm256_or_si256(v.lo, v.hi);
  const __m128i h = _mm_or_si128(_mm256_castsi256_si128(o), _mm256_extracti128_si256(o, 1));
  return _mm_cvtsi128_si64(h) | _mm_extract_epi64(h, 1);
}
#endif

}  // namespace

// Returns the OR of all 64-bit words of t (contiguous, bytes % 512 == 0): a value the compiler
// cannot elide, so every line is really loaded. Each thread reads its share as `streams` concurrent
// sequential streams: which count reaches the highest rate depends on the CPU (gemv.h Streams: one
// on Zen 4, several on the Xeons measured), so the roofline is the best over the counts, never one.
// ahead: each stream also requests its lines this many bytes on into L2 (PREFETCHT1), as the quantized kernels do
// on Intel CPUs (quant_stream.h), which read faster than a probe without it there; 0: no software prefetch.
int64_t stream_read(const at::Tensor& t, int64_t streams, int64_t ahead) {
  TORCH_CHECK(t.is_contiguous() && t.nbytes() % 512 == 0, "stream_read needs a contiguous tensor of 512*n bytes");
  TORCH_CHECK(streams >= 1 && streams <= 16, "streams must be in [1, 16], not ", streams);
  TORCH_CHECK(ahead >= 0 && ahead <= 65536 && ahead % 64 == 0,
              "ahead is 0 or a multiple of 64 bytes up to 65536, not ", ahead);
  const auto* p = static_cast<const Line*>(t.data_ptr());
  const int64_t blocks = (int64_t)t.nbytes() / 512;  // 8 lines per block, 8 independent accumulators
  std::atomic<int64_t> result{0};
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    const int64_t len = (b1 - b0) / streams;
    Line acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = none();
    for (int64_t b = 0; b < len; ++b)
      for (int64_t s = 0; s < streams; ++s) {
        const Line* q = p + (b0 + s * len + b) * 8;
        if (ahead)
          for (int i = 0; i < 8; ++i) _mm_prefetch(reinterpret_cast<const char*>(q + i) + ahead, _MM_HINT_T1);
        for (int i = 0; i < 8; i += 2) {
          acc[i] = either(acc[i], load(q + i));
          acc[i + 1] = either(acc[i + 1], load(q + i + 1));
        }
      }
    for (int64_t b = b0 + streams * len; b < b1; ++b)
      for (int i = 0; i < 8; ++i) acc[i] = either(acc[i], load(p + b * 8 + i));
    for (int i = 1; i < 8; ++i) acc[0] = either(acc[0], acc[i]);
    result.fetch_or(fold(acc[0]));
  });
  return result.load();
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("stream_read(Tensor t, int streams=4, int ahead=0) -> int");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("stream_read", &stream_read);
}

}  // namespace deploykit
