// Streaming-read probe for the memory roofline: reads every 64-byte line of a tensor once with
// AVX-512 loads across torch's threads. torch's own reductions are compute-bound below DRAM
// speed on 2 cores, so they understate the roofline the GEMV kernels are held to.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>

namespace deploykit {

// Returns the OR of all 64-bit words of t (contiguous, bytes % 512 == 0): a value the compiler
// cannot elide, so every line is really loaded. Each thread reads its share as `streams` concurrent
// sequential streams: which count reaches the highest rate depends on the CPU (gemv.h Streams: one
// on Zen 4, several on the Xeons measured), so the roofline is the best over the counts, never one.
int64_t stream_read(const at::Tensor& t, int64_t streams) {
  TORCH_CHECK(t.is_contiguous() && t.nbytes() % 512 == 0, "stream_read needs a contiguous tensor of 512*n bytes");
  TORCH_CHECK(streams >= 1 && streams <= 16, "streams must be in [1, 16], not ", streams);
  const auto* p = static_cast<const __m512i*>(t.data_ptr());
  const int64_t blocks = (int64_t)t.nbytes() / 512;  // 8 lines per block, 8 independent accumulators
  std::atomic<int64_t> result{0};
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    const int64_t len = (b1 - b0) / streams;
    __m512i acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_si512();
    for (int64_t b = 0; b < len; ++b)
      for (int64_t s = 0; s < streams; ++s) {
        const __m512i* q = p + (b0 + s * len + b) * 8;
        for (int i = 0; i < 8; i += 2) {
          acc[i] = _mm512_or_si512(acc[i], _mm512_load_si512(q + i));
          acc[i + 1] = _mm512_or_si512(acc[i + 1], _mm512_load_si512(q + i + 1));
        }
      }
    for (int64_t b = b0 + streams * len; b < b1; ++b)
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_or_si512(acc[i], _mm512_load_si512(p + b * 8 + i));
    for (int i = 1; i < 8; ++i) acc[0] = _mm512_or_si512(acc[0], acc[i]);
    result.fetch_or(_mm512_reduce_or_epi64(acc[0]));
  });
  return result.load();
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("stream_read(Tensor t, int streams=4) -> int");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("stream_read", &stream_read);
}

}  // namespace deploykit
