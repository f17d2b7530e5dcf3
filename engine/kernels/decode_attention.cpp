// Decode attention straight from the paged KV cache: one query token per sequence, any context length.
//
// The PyTorch path gathers every sequence's blocks into a padded copy (index_select) and runs SDPA with
// an additive mask: ~100-250 us per layer at decode sizes, mostly dispatch and copying. Here each
// (sequence, KV head) task reads its blocks in place (attention.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention.h"

namespace deploykit {
using bf16 = at::BFloat16;
using attention::HEAD_DIM_MULTIPLE;
using attention::MAX_HEAD_DIM;

// q [B, Hq, D] (rows may be strided, heads D apart), kv [NB, bs, 2, Hkv, D] contiguous, tables int32
// [B, W] (block ids, padded with anything), lens int32 [B] (context length including this token, <= W * bs)
// -> [B, Hq, D] bf16. window > 0: attend only to the last `window` tokens (sliding-window attention, as
// Mistral's: key j is visible to query i when i - window < j <= i).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                            const at::Tensor& lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be a bf16 [B, Hq, D] tensor with contiguous heads");
  TORCH_CHECK(kv.dim() == 5 && kv.size(2) == 2 && kv.scalar_type() == at::kBFloat16 && kv.is_contiguous(),
              "kv must be a contiguous bf16 [blocks, block_size, 2, Hkv, D] tensor");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv.size(0), bs = kv.size(1), Hkv = kv.size(3);
  TORCH_CHECK(kv.size(4) == D, "q and kv head_dim differ");
  TORCH_CHECK(D % HEAD_DIM_MULTIPLE == 0 && D <= MAX_HEAD_DIM, "head_dim must be a multiple of ", HEAD_DIM_MULTIPLE,
              " up to ", MAX_HEAD_DIM);
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kInt && tables.is_contiguous(),
              "tables must be a contiguous int32 [B, W] tensor");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == at::kInt && lens.is_contiguous(),
              "lens must be a contiguous int32 [B] tensor");
  const int64_t W = tables.size(1), G = Hq / Hkv;
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  // Validate every index before the parallel region (errors cannot leave it): a bad table would read
  // outside the cache.
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * bs, "context length ", lp[b], " of row ", b, " is outside [1, ", W * bs,
                "]");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * W + j] >= 0 && tp[b * W + j] < NB, "block id ", tp[b * W + j], " out of range");
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const attention::PagedKV cache{kv.data_ptr<bf16>(), bs, Hkv, D};
  const int64_t qs0 = q.stride(0);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    attention::Scratch scratch;
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      attention::attend(qp + b * qs0 + h * G * D, cache, tp + b * W, lp[b], window, h, G, (float)scale, scratch,
                        op + (b * Hq + h * G) * D);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("decode_attention(Tensor q, Tensor kv, Tensor tables, Tensor lens, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}

}  // namespace deploykit
