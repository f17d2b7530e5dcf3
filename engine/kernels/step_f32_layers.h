// What the fused fp32 decode step (decode_step_f32.cpp) reads, checked once before its parallel region: each layer's
// matrices (block-quantized, or bf16 packed for widening in registers), norms and biases, the token table its rows are
// looked up in, and the LM head it ends with; and the products of its B rows with one matrix, by the code of the
// per-op fp32 linears, so the step and the per-op path agree bitwise. Every build includes it (AVX2 + FMA code, or
// the AVX-512 GEMV where the build has it).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "argmax.h"
#include "bf16w_blocked.h"
#include "f32_rows.h"
#ifdef __AVX512F__
#include "quant_gemv.h"
#else
#include "quant_gemv_avx2.h"
#endif

namespace deploykit {
namespace step_f32 {

// Rows of one call, as the per-op linears take them: bf16 matrices through bf16w::rows (bf16w_blocked.h: the GEMV up to
// FEW_ROWS rows, each weight line loaded once for all, then the blocked GEMM over 128-k chunks widened into L1);
// quantized ones through quant_rows.h tiled_rows (the GEMV up to 4, then tiles of 4 rows over each pair of groups).
// Past 4 rows on bf16 matrices the step had gone per op: on a 2-core Zen 3 a 16-sequence step of the benchmark model
// spent ~10 % of its time beside the GEMMs (benchmarks/README.md, session 29).
constexpr int64_t MAX_ROWS = 16;

struct Weight {
  const at::BFloat16* packed = nullptr;  // bf16 packed [N/16, K/2, 16, 2], or
  quant::Matrix q{};                     // block-quantized (packed == nullptr)
};

struct Layer {
  const float *ln1, *qk_norm, *ln2, *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
  Weight qkv, o, gate_up, down;
  float* kv;
  int64_t window;
};

// layer < 0: a matrix outside the layers (the LM head), named alone.
inline Weight weight(const std::optional<at::Tensor>& t, int64_t N, int64_t K, int64_t layer, const char* name) {
  const std::string where = layer < 0 ? std::string(name) : "layer " + std::to_string(layer) + " " + name;
  TORCH_CHECK(t.has_value() && t->defined(), where, " is missing");
  const at::Tensor& w = *t;
  Weight out;
  if (quant::is_blob(w)) {
    out.q = quant::matrix(w);
    TORCH_CHECK(out.q.N == N && out.q.K == K, where, ": the quantized weight is [", out.q.N, ", ", out.q.K,
                "], expected [", N, ", ", K, "]");
    return out;
  }
  TORCH_CHECK(w.dim() == 4 && w.size(0) * bf16w::COLS == N && w.size(1) * 2 == K && w.size(2) == bf16w::COLS &&
                  w.size(3) == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              where, ": expected a packed bf16 [", N / bf16w::COLS, ", ", K / 2, ", 16, 2] weight or a quantized one");
  out.packed = w.data_ptr<at::BFloat16>();
  return out;
}

inline const float* vector_ptr(const std::optional<at::Tensor>& t, int64_t n, bool required, int64_t layer,
                               const char* name) {
  if (!required && (!t.has_value() || !t->defined())) return nullptr;
  const std::string where = layer < 0 ? std::string(name) : "layer " + std::to_string(layer) + " " + name;
  TORCH_CHECK(t.has_value() && t->defined() && t->numel() == n && t->scalar_type() == at::kFloat && t->is_contiguous(),
              where, ": expected a contiguous fp32 tensor of ", n, " elements");
  return t->data_ptr<float>();
}

// y[:, 16 g0 .. 16 g1) = x W^T + bias for B rows of x [B, K], as linear_bf16w and quant_linear compute them. A
// quantized matrix takes the rows quantized into `acts` first, unless `quantized` says x is already there.
inline void matvec(int64_t B, const float* x, int64_t K, const Weight& w, quant::ActBuffer& acts, int64_t g0,
                   int64_t g1, const float* bias, float* y, int64_t ldy, bool quantized = false) {
  if (g0 >= g1) return;
  if (w.packed) {
    bf16w::rows(w.packed, K, g0, g1, x, K, B, bias, y, ldy);
    return;
  }
  quant::Act a[MAX_ROWS];
  for (int64_t b = 0; b < B; ++b) {
    a[b] = acts.row(b);
    if (!quantized) quant::quantize(x + b * K, K, a[b]);
  }
  quant::tiled_rows(B, a, w.q, g0, g1, bias, y, ldy);
}

// gu[:, gate groups [j0, j1)] and gu[:, up groups J + [j0, j1)] = x [B, H] W_gate_up^T + bias ([B, 2I], I = 16 J).
// Interleaved quantized halves (quant_layout.h): gate group j, then up group j, the next group in memory, in one call
// a claim (up to 4 rows one stream, past 4 tiles of 4 rows over each pair), as the bf16 step reads them, where the
// step had made two matvec calls a group (14,592 a token of the benchmark model). On a 2-vCPU Zen 3, processes of each
// build alternated, 8 pairs at batch 1 on Q4_0: 1.05x the tokens a second (paired median; pairs 0.90-1.15x, this VM's
// noise), gate_up 0.98x the time (benchmarks/README.md, session 55).
inline void gate_up(int64_t B, const float* x, int64_t H, const Weight& w, quant::ActBuffer& acts, int64_t J,
                    int64_t j0, int64_t j1, const float* bias, float* gu, bool quantized) {
  if (w.packed != nullptr || !w.q.interleaved) {
    matvec(B, x, H, w, acts, j0, j1, bias, gu, 32 * J, quantized);
    matvec(B, x, H, w, acts, J + j0, J + j1, bias, gu, 32 * J, true);
    return;
  }
  if (j0 >= j1) return;
  quant::Act a[MAX_ROWS];
  for (int64_t b = 0; b < B; ++b) {
    a[b] = acts.row(b);
    if (!quantized) quant::quantize(x + b * H, H, a[b]);
  }
  quant::interleaved_tiles(B, a, w.q, j0, j1, bias, gu, 32 * J);
}

// The LM head's fp32 logits [B, V] for column groups [g0, g1), the bits kernels.logits gives under fp32 (quant_linear
// or linear_bf16w, no bias); with picks ([B]), each row's greedy token among them merged in (argmax.h: torch.argmax's
// answer once every thread's picks are merged), scanned while the thread's logits are still in L1.
inline void head(int64_t B, const float* x, int64_t K, const Weight& w, quant::ActBuffer& acts, int64_t g0,
                 int64_t g1, float* logits, int64_t V, bool quantized, argmax::Best* picks) {
  matvec(B, x, K, w, acts, g0, g1, nullptr, logits, V, quantized);
  for (int64_t b = 0; picks && g0 < g1 && b < B; ++b) {
    const float* row = logits + b * V + 16 * g0;
    const int64_t j = argmax::argmax_row(row, 16 * (g1 - g0));
    picks[b].merge(row[j], 16 * g0 + j);
  }
}

// The token table the step looks its rows up in, of the kinds layers.embed_rows takes under fp32: quantized (rows
// dequantized), plain [V, H] fp32 or bf16, or packed bf16 [V/16, H/2, 16, 2] (a tied table's lm_head copy); each row
// the bits embed_rows gives it (bf16 widens exactly).
struct Table {
  enum Kind { PLAIN, PLAIN_BF16, PACKED_BF16, QUANTIZED } kind = PLAIN;
  const float* dense = nullptr;
  const at::BFloat16* half = nullptr;
  quant::Matrix q{};
  int64_t V = 0;
  // Row id -> out [H] fp32.
  void row(int64_t id, int64_t H, float* out) const {
    if (kind == QUANTIZED) {
      dequant_row(q, id, out);
    } else if (kind == PACKED_BF16) {  // row id is column id % 16 of block id / 16: pairs of k
      const at::BFloat16* b = half + id / 16 * H * 16 + id % 16 * 2;
      for (int64_t k = 0; k < H; k += 2)
        out[k] = static_cast<float>(b[k * 16]), out[k + 1] = static_cast<float>(b[k * 16 + 1]);
    } else if (kind == PLAIN_BF16) {
      for (int64_t k = 0; k < H; ++k) out[k] = static_cast<float>(half[id * H + k]);
    } else {
      std::copy(dense + id * H, dense + (id + 1) * H, out);
    }
  }
};

inline Table table(const at::Tensor& t, int64_t H) {
  Table out;
  if (quant::is_blob(t)) {
    out.kind = Table::QUANTIZED, out.q = quant::matrix(t), out.V = out.q.N;
    TORCH_CHECK(out.q.K == H, "the token table is [", out.q.N, ", ", out.q.K, "], expected H = ", H);
    return out;
  }
  const bool packed = t.dim() == 4 && t.size(1) * 2 == H && t.size(2) == 16 && t.size(3) == 2 &&
                      t.scalar_type() == at::kBFloat16;
  const bool plain =
      t.dim() == 2 && t.size(1) == H && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat);
  TORCH_CHECK(t.is_contiguous() && (packed || plain), "the token table: expected a contiguous fp32 or bf16 [V, ", H,
              "] tensor, a packed bf16 [V/16, ", H / 2, ", 16, 2] one or a quantized one");
  if (packed) {
    out.kind = Table::PACKED_BF16, out.half = t.data_ptr<at::BFloat16>(), out.V = t.size(0) * 16;
  } else if (t.scalar_type() == at::kBFloat16) {
    out.kind = Table::PLAIN_BF16, out.half = t.data_ptr<at::BFloat16>(), out.V = t.size(0);
  } else {
    out.kind = Table::PLAIN, out.dense = t.data_ptr<float>(), out.V = t.size(0);
  }
  return out;
}

// The step's way from token ids to greedy tokens, each piece optional (decode_step.cpp describes them): the rows
// looked up in `tokens` from ids, the final norm and LM head into logits [B, V], each row's argmax into greedy, a run
// of `steps` ended by a pick in stops. Checked before the parallel region, where errors cannot leave.
struct Tail {
  bool head = false, pick = false, lookup = false;
  int64_t V = 0;
  Weight hw;
  const float* norm = nullptr;
  Table tokens;
  const int64_t* id = nullptr;
  const int64_t* stop_ids = nullptr;
  int64_t num_stops = 0;
};

inline Tail checked_tail(int64_t B, int64_t H, const std::optional<at::Tensor>& norm,
                         const std::optional<at::Tensor>& lm_head, const std::optional<at::Tensor>& logits,
                         const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& embed,
                         const std::optional<at::Tensor>& greedy, int64_t steps,
                         const std::optional<at::Tensor>& stops) {
  Tail t;
  t.head = logits.has_value() && logits->defined();
  if (t.head) {
    TORCH_CHECK(logits->dim() == 2 && logits->size(0) == B && logits->size(1) % 16 == 0 &&
                    logits->scalar_type() == at::kFloat && logits->is_contiguous(),
                "logits must be a contiguous fp32 [B, V] tensor, V a multiple of 16");
    t.V = logits->size(1);
    TORCH_CHECK(lm_head.has_value() && lm_head->defined(), "logits take the lm_head");
    t.hw = weight(*lm_head, t.V, H, -1, "lm_head");
    t.norm = vector_ptr(norm, H, true, -1, "the final norm");
  }
  t.pick = greedy.has_value() && greedy->defined();
  const bool shaped = t.pick && (greedy->dim() == 1
                                     ? steps == 1 && greedy->size(0) == B
                                     : greedy->dim() == 2 && greedy->size(0) == steps && greedy->size(1) == B);
  TORCH_CHECK(!t.pick || (t.head && greedy->scalar_type() == at::kLong && greedy->is_contiguous() && shaped),
              "greedy must be a contiguous int64 [B] tensor ([steps, B] for a run), beside logits");
  t.lookup = ids.has_value() && ids->defined();
  TORCH_CHECK(steps >= 1 && (steps == 1 || (t.lookup && t.pick)), "steps must be >= 1, and a run of more (got ", steps,
              ") feeds each step's greedy tokens to the next: it takes ids, embed, logits and greedy");
  if (stops.has_value() && stops->defined()) {
    TORCH_CHECK(stops->dim() == 1 && stops->scalar_type() == at::kLong && stops->is_contiguous(),
                "stops must be a contiguous int64 [S] tensor of token ids");
    t.stop_ids = stops->data_ptr<int64_t>();
    t.num_stops = stops->numel();
  }
  if (t.lookup) {
    TORCH_CHECK(embed.has_value() && embed->defined(), "ids take the token table (embed)");
    t.tokens = table(*embed, H);
    TORCH_CHECK(ids->dim() == 1 && ids->size(0) == B && ids->scalar_type() == at::kLong && ids->is_contiguous(),
                "ids must be a contiguous int64 [B] tensor");
    t.id = ids->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(t.id[b] >= 0 && t.id[b] < t.tokens.V, "token id ", t.id[b], " of row ", b,
                  " is outside the vocabulary [0, ", t.tokens.V, ")");
  }
  return t;
}

}  // namespace step_f32
}  // namespace deploykit
