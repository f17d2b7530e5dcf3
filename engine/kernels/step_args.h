// What the two fused decode steps (decode_step.cpp in bf16, decode_step_f32.cpp in fp32) take alike: the per-layer
// order of their weight list, the checks on each row's position, block table, context length and cache slot, and
// each thread's fixed share of a phase's items. No ISA code here, so every build includes it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace deploykit {
namespace step_args {

// Per-layer entries of the `weights` list, in this order (None where the model has no such tensor).
enum Slot { LN1, QKV, QKV_BIAS, QK_NORM, O, O_BIAS, LN2, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, PER_LAYER };

// Per row: position int64 [B], table int32 [B, W] block ids (padded with anything), length int32 [B] context incl.
// this token, slot int64 [B] where this token's K/V go; longest: the longest context.
struct RowIndices {
  const int64_t* pos;
  const int32_t* table;
  const int32_t* end;
  const int64_t* slot;
  int64_t W, longest;
};

// Checks every row's indices before the parallel region (errors cannot leave it): a bad one would read or write
// outside the rotary tables (max_len rows) and the cache (NB blocks of bs tokens). steps: a run of that many decode
// steps (decode_step.cpp), step s at position + s with length + s, its K/V in the table's slot for that position:
// the last step's position, length and blocks are checked too; longest counts it.
inline RowIndices checked_rows(const at::Tensor& position, const at::Tensor& table, const at::Tensor& length,
                               const at::Tensor& slot, int64_t B, int64_t max_len, int64_t NB, int64_t bs,
                               int64_t steps = 1) {
  for (const at::Tensor* t : {&position, &slot})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong && t->is_contiguous(),
                "position and slot must be contiguous int64 [B]");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && table.scalar_type() == at::kInt && table.is_contiguous(),
              "table must be a contiguous int32 [B, W] tensor");
  TORCH_CHECK(length.dim() == 1 && length.size(0) == B && length.scalar_type() == at::kInt && length.is_contiguous(),
              "length must be a contiguous int32 [B] tensor");
  RowIndices r{position.data_ptr<int64_t>(), table.data_ptr<int32_t>(), length.data_ptr<int32_t>(),
         slot.data_ptr<int64_t>(), table.size(1), 0};
  const int64_t more = steps - 1;  // the last step's position and length are this much further
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(r.pos[b] >= 0 && r.pos[b] + more < max_len, "position ", r.pos[b] + more, " of row ", b,
                " is outside the rotary table [0, ", max_len, ")");
    TORCH_CHECK(r.end[b] >= 1 && r.end[b] + more <= r.W * bs, "context length ", r.end[b] + more, " of row ", b,
                " is outside [1, ", r.W * bs, "]");
    TORCH_CHECK(r.slot[b] >= 0 && r.slot[b] < NB * bs, "slot ", r.slot[b], " of row ", b, " is outside the cache [0, ",
                NB * bs, ")");
    for (int64_t j = 0; j < (r.end[b] + more + bs - 1) / bs; ++j)
      TORCH_CHECK(r.table[b * r.W + j] >= 0 && r.table[b * r.W + j] < NB, "block id ", r.table[b * r.W + j],
                  " of row ", b, " out of range");
    r.longest = std::max<int64_t>(r.longest, r.end[b] + more);
  }
  return r;
}

// Where step s of a run (decode_step.cpp) writes row b's K/V: its slot for the first step, then the block table's slot
// for position + s, as ModelRunner._prepare lays a run's blocks out.
inline int64_t run_slot(const RowIndices& r, int64_t b, int64_t s, int64_t bs) {
  const int64_t p = r.pos[b] + s;
  return s == 0 ? r.slot[b] : (int64_t)r.table[b * r.W + p / bs] * bs + p % bs;
}

// [begin, end) of n items for thread tid of nt, contiguous and as equal as possible.
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt) {
  const int64_t chunk = (n + nt - 1) / nt;
  return {std::min<int64_t>(n, tid * chunk), std::min<int64_t>(n, (tid + 1) * chunk)};
}

}  // namespace step_args
}  // namespace deploykit
