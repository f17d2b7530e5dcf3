// Decode attention straight from the paged KV cache: one query token per sequence, any context length.
//
// The PyTorch path gathers every sequence's blocks into a padded copy (index_select) and runs SDPA with
// an additive mask: ~100-250 us per layer at decode sizes, mostly dispatch and copying. Here each
// (sequence, KV head) task reads its blocks in place (attention.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention.h"
#include "paged_kv.h"

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
  const paged::Call c = paged::check(q, kv, tables, lens, at::kBFloat16, "bf16", HEAD_DIM_MULTIPLE, MAX_HEAD_DIM);
  const int64_t B = c.B, Hq = c.Hq, D = c.D, bs = c.bs, Hkv = c.Hkv, W = c.W, G = c.G;
  const int32_t *tp = c.tables, *lp = c.lens;
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

// Turns the decode attention's AMX scores (attention.h tile_scores) on or off for every caller, the fused step too;
// true if they are now on (never in a build without AMX code: the caller also checks that the CPU has it).
bool set_attention_tiles(bool on) {
#ifdef DEPLOYKIT_ATTENTION_TILES
  attention::tiles_on.store(on && amx_init());  // the OS grants tile state first, as the other AMX switches ask
  return attention::tiles_on.load();
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("decode_attention(Tensor q, Tensor kv, Tensor tables, Tensor lens, float scale, int window=0) -> Tensor");
  m.def("set_attention_tiles(bool on) -> bool", &set_attention_tiles);
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}

}  // namespace deploykit
