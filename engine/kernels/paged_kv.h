// The paged KV cache as the decode attention ops read it (bf16: decode_attention.cpp and the decode step's
// attention.h; fp32: f32_ops.cpp): the checks on a call's tensors and block tables, and the walk to each key's row.
// No ISA code here, so every build includes it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace deploykit {
namespace paged {

// A decode attention call's shapes: q [B, Hq, D], kv [NB, bs, 2, Hkv, D], tables int32 [B, W], lens int32 [B].
struct Call {
  int64_t B, Hq, D, NB, bs, Hkv, W, G;  // G = Hq / Hkv query heads per KV head
  const int32_t* tables;
  const int32_t* lens;
};

// Checks q (contiguous heads, rows may be strided) and kv (contiguous) of `dtype` (`name` in messages), D a multiple
// of `multiple` up to `max_d`, and every index: each context length inside its table, each block id it uses inside
// the cache. All before any parallel region: an error cannot leave one, and a bad table would read outside the cache.
inline Call check(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables, const at::Tensor& lens,
                  at::ScalarType dtype, const char* name, int64_t multiple, int64_t max_d) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == dtype && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be a [B, Hq, D] ", name, " tensor with contiguous heads");
  TORCH_CHECK(kv.dim() == 5 && kv.size(2) == 2 && kv.scalar_type() == dtype && kv.is_contiguous(),
              "kv must be a contiguous [blocks, block_size, 2, Hkv, D] ", name, " tensor");
  Call c{q.size(0), q.size(1), q.size(2), kv.size(0), kv.size(1), kv.size(3), 0, 0, nullptr, nullptr};
  TORCH_CHECK(kv.size(4) == c.D, "q and kv head_dim differ");
  TORCH_CHECK(c.D % multiple == 0 && c.D <= max_d, "head_dim must be a multiple of ", multiple, " up to ", max_d);
  TORCH_CHECK(c.Hq % c.Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == c.B && tables.scalar_type() == at::kInt && tables.is_contiguous(),
              "tables must be a contiguous int32 [B, W] tensor");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == c.B && lens.scalar_type() == at::kInt && lens.is_contiguous(),
              "lens must be a contiguous int32 [B] tensor");
  c.W = tables.size(1);
  c.G = c.Hq / c.Hkv;
  c.tables = tables.data_ptr<int32_t>();
  c.lens = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < c.B; ++b) {
    const int32_t n = c.lens[b];
    TORCH_CHECK(n >= 1 && n <= c.W * c.bs, "context length ", n, " of row ", b, " is outside [1, ", c.W * c.bs, "]");
    for (int64_t j = 0; j < (n + c.bs - 1) / c.bs; ++j) {
      const int32_t id = c.tables[b * c.W + j];
      TORCH_CHECK(id >= 0 && id < c.NB, "block id ", id, " out of range");
    }
  }
  return c;
}

// keys[i] = the K row of token t0 + i of KV head h, for i < T (its V row follows kv_heads * D later), found by
// walking the blocks once: the attention loops visit a key several times, and a 64-bit division per visit cost
// about as much as the arithmetic. data: the cache [NB, bs, 2, Hkv, D]; row = 2 Hkv D, the elements between tokens.
template <class T>
inline void key_rows(const T* data, int64_t bs, int64_t row, int64_t h, int64_t D, const int32_t* table, int64_t t0,
                     int64_t n, const T** keys) {
  for (int64_t i = 0; i < n;) {
    const int64_t t = t0 + i;
    const T* block = data + (int64_t)table[t / bs] * bs * row + h * D;
    for (int64_t j = t % bs; j < bs && i < n; ++j, ++i) keys[i] = block + j * row;
  }
}

}  // namespace paged
}  // namespace deploykit
