// The whole forward pass of a decode step of up to MAX_ROWS sequences under fp32 activations, in one native call:
// decode_step.cpp's twin for a model run in fp32 (every CPU without AVX-512, or a user's choice), its matrices
// block-quantized (the int8 GEMV) or bf16 widened in registers (bf16w_blocked.h).
//
// Why: on a 2-core Zen 3 (AVX2) at batch 1 on the Q4_0 benchmark model, the per-op path ran 97 quant_linear calls and
// ~9 other ops a layer from Python, each a PyTorch dispatch, an allocation and most an OpenMP fork/join: ~1.7 ms of
// a ~11.5 ms token beside the GEMVs (torch.profiler). Here one OpenMP region runs every layer, and threads meet at a
// barrier only where a phase needs the whole result of the previous one. Every value comes from the code of the
// per-op fp32 path (f32_rows.h, bf16w_blocked.h, the quantized GEMV of quant_rows.h), in the same order, so the two
// agree bitwise; tests/engine/test_decode_step_f32.py compares them.
//
// Per layer, for B rows; the residual h [B, H] and the normed x [B, H] are private to each thread, which computes
// them itself (B H floats: cheaper than a barrier):
//   qkv = x W_qkv^T + b                     column groups split between threads          | barrier
//   per (row, KV head): q/k norm, rotary, K/V into the row's cache slot, attention -> o  | barrier
//   d = o W_o^T + b                         column groups split                          | barrier
//   h += d; x = rms_norm(h) * ln2           every thread
//   y = silu(x W_gate^T) * (x W_up^T)       gate group j and up group j on one thread    | barrier
//   d = y W_down^T + b                      column groups split                          | barrier
//   h += d; x = rms_norm(h) * ln1 of the next layer
// and, when asked for, the way from token ids to greedy tokens and runs of steps, as decode_step.cpp does them (why
// there): before the first layer each thread looks the rows up in the token table itself; after the last,
//   x = rms_norm(h) * norm; logits = x W_lm_head^T    column groups split, each thread's argmax among its own
// and every thread merges the threads' picks alike into the next step's token ids.
// A phase's column groups (or attention tasks) are split between threads in fixed shares up to 4 rows, and past 4
// handed out in runs as threads come free (STREAM_ROWS below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "runs.h"
#include "step_args.h"
#include "step_f32_layers.h"
#include "step_profile.h"

namespace deploykit {
namespace {

// Past STREAM_ROWS rows (where both the bf16 and the quantized GEMV give way to tiles) a phase is compute-bound and
// hands its items out in Runs as threads come free (runs.h: why). Measured on a 2-core Zen 3, fixed shares and
// runs alternated in one process: 16 rows 0.92-0.96x the time of a step (bf16 and Q4_0), 8 rows 0.93-0.96x, 4 rows the
// same. Up to 4 rows a phase is bound by the weight stream, and each thread keeps one contiguous share: in runs, Q4_0
// at one row took 1.07x the time.
constexpr int64_t STREAM_ROWS = 4;
constexpr int64_t PHASES = 5;        // qkv, attention, o_proj, gate_up, down: a Runs counter each, per layer
constexpr int64_t LEAST_GROUPS = 2;  // the shortest run of column groups (2 x 16 columns)
static_assert(STREAM_ROWS == bf16w::FEW_ROWS);

using namespace step_args;  // Slot, share, checked_rows
using step_f32::Layer, step_f32::MAX_ROWS, step_f32::Tail, step_f32::Weight, step_f32::matvec, step_f32::vector_ptr;
using step_f32::checked_tail;

}  // namespace

// h [B, H] fp32, B <= MAX_ROWS sequences: each one's token
// embedding in, the last layer's residual stream out (before the final norm). weights: PER_LAYER entries per layer
// (see Slot): matrices quantized or packed bf16, norms and biases fp32, qk_norm [Hq + Hkv, D]. kv: per layer fp32
// [NB, bs, 2, Hkv, D]. cos, sin: the rotary tables [max_len, D] fp32 (sin signed, rotate-half). Per row: position
// int64 [B], table int32 [B, W] block ids (padded with anything), length int32 [B] context incl. this token, slot
// int64 [B] where this token's K/V go. norm, lm_head, logits, ids, embed, greedy, steps and stops as decode_step.cpp
// takes them, in fp32 (norm fp32 [H]; lm_head a matrix as above; embed a table as step_f32::table reads it). Returns
// the steps run.
int64_t decode_step_f32_(const at::Tensor& h, const std::vector<std::optional<at::Tensor>>& weights,
                         const std::vector<at::Tensor>& kv, const std::vector<int64_t>& windows, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& position, const at::Tensor& table,
                         const at::Tensor& length, const at::Tensor& slot, int64_t num_heads, int64_t num_kv_heads,
                         double eps, double scale, const std::optional<at::Tensor>& norm,
                         const std::optional<at::Tensor>& lm_head, const std::optional<at::Tensor>& logits,
                         const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& embed,
                         const std::optional<at::Tensor>& greedy, int64_t steps,
                         const std::optional<at::Tensor>& stops) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1 && h.size(0) <= MAX_ROWS && h.scalar_type() == at::kFloat &&
                  h.is_contiguous(),
              "h must be a contiguous fp32 [B, H] tensor with 1 <= B <= ", MAX_ROWS);
  const int64_t B = h.size(0), L = (int64_t)kv.size(), H = h.size(1), Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(L > 0 && (int64_t)weights.size() == L * PER_LAYER && (int64_t)windows.size() == L,
              "expected ", PER_LAYER, " weights and one window per KV cache layer");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin must be contiguous fp32 [max_len, D] tables");
  const int64_t D = cos.size(1), G = Hq / Hkv, NQKV = (Hq + 2 * Hkv) * D;
  TORCH_CHECK(D % 8 == 0 && D <= f32::MAX_HEAD_DIM, "head_dim must be a multiple of 8 up to ", f32::MAX_HEAD_DIM);
  TORCH_CHECK(H % bf16w::COLS == 0 && (Hq * D) % bf16w::COLS == 0, "hidden size and q width must be multiples of 16");
  const auto& gu0 = weights[GATE_UP];
  TORCH_CHECK(gu0.has_value() && gu0->defined(), "layer 0 gate_up is missing");
  const int64_t I = quant::is_blob(*gu0) ? quant::matrix(*gu0).N / 2 : gu0->size(0) * bf16w::COLS / 2;
  TORCH_CHECK(I % bf16w::COLS == 0, "intermediate size must be a multiple of ", bf16w::COLS);

  std::vector<Layer> layers(L);
  int64_t NB = -1, bs = 0;
  bool any_quantized = false;
  for (int64_t l = 0; l < L; ++l) {
    auto w = [&](int s) -> const std::optional<at::Tensor>& { return weights[l * PER_LAYER + s]; };
    Layer& y = layers[l];
    y.qkv = step_f32::weight(w(QKV), NQKV, H, l, "qkv");
    y.o = step_f32::weight(w(O), H, Hq * D, l, "o_proj");
    y.gate_up = step_f32::weight(w(GATE_UP), 2 * I, H, l, "gate_up");
    y.down = step_f32::weight(w(DOWN), H, I, l, "down_proj");
    for (const Weight* m : {&y.qkv, &y.o, &y.gate_up, &y.down}) any_quantized |= m->packed == nullptr;
    y.ln1 = vector_ptr(w(LN1), H, true, l, "input_layernorm");
    y.ln2 = vector_ptr(w(LN2), H, true, l, "post_attention_layernorm");
    y.qk_norm = vector_ptr(w(QK_NORM), (Hq + Hkv) * D, false, l, "qk_norm");
    y.qkv_bias = vector_ptr(w(QKV_BIAS), NQKV, false, l, "qkv bias");
    y.o_bias = vector_ptr(w(O_BIAS), H, false, l, "o_proj bias");
    y.gate_up_bias = vector_ptr(w(GATE_UP_BIAS), 2 * I, false, l, "gate_up bias");
    y.down_bias = vector_ptr(w(DOWN_BIAS), H, false, l, "down_proj bias");
    const at::Tensor& c = kv[l];
    TORCH_CHECK(c.dim() == 5 && c.size(2) == 2 && c.size(3) == Hkv && c.size(4) == D && c.scalar_type() == at::kFloat &&
                    c.is_contiguous(),
                "layer ", l, " KV cache must be a contiguous fp32 [blocks, block_size, 2, ", Hkv, ", ", D, "] tensor");
    TORCH_CHECK(NB < 0 || (c.size(0) == NB && c.size(1) == bs), "KV cache layers differ in shape");
    NB = c.size(0);
    bs = c.size(1);
    y.kv = c.data_ptr<float>();
    y.window = windows[l];
  }
  const Tail tail = checked_tail(B, H, norm, lm_head, logits, ids, embed, greedy, steps, stops);
  any_quantized |= tail.head && tail.hw.packed == nullptr;
  const RowIndices ix = step_args::checked_rows(position, table, length, slot, B, cos.size(0), NB, bs, steps);
  const int64_t *pos = ix.pos, W = ix.W, longest = ix.longest;
  const int32_t *end = ix.end, *tbl = ix.table;
  // Shared activations [B, ...]; every element has one writer per phase.
  std::vector<float> qkv(B * NQKV), o(B * Hq * D), d(B * H), gu(B * 2 * I), act(B * I);
  // Per thread: its copy of the residual stream and its norm, its quantized rows and attention scratch, all sized
  // up front, so nothing inside the parallel region allocates (an exception there could not be caught).
  const int max_threads = at::get_num_threads();
  const int64_t stride = (2 * B * H + 15) / 16 * 16;  // whole 64-byte lines per thread
  std::vector<float> own(stride * max_threads + 16);
  float* own0 = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(own.data()) + 63) & ~uintptr_t{63});
  std::vector<quant::ActBuffer> acts(max_threads);
  if (any_quantized)
    for (auto& a : acts) a.reserve(B, std::max({H, Hq * D, I}));
  std::vector<f32::Scratch> scratches(max_threads);
  const int64_t padded = (longest + 7) / 8 * 8;
  for (auto& s : scratches) {
    s.scores.reserve(G * padded);
    s.probs.reserve(G * longest);
    s.keys.reserve(longest);
    s.inv.reserve(G);
  }
  float* hp = h.data_ptr<float>();
  const float* cos_table = cos.data_ptr<float>();
  const float* sin_table = sin.data_ptr<float>();
  const float fscale = (float)scale, feps = (float)eps;
  const int64_t row = 2 * Hkv * D;
  // One hand-out counter per phase of each layer and step, and one per step for the head, so none is reset while a
  // thread may still read it.
  const int64_t per_step = L * PHASES + 1, V = tail.V;
  std::vector<Runs> runs(per_step * steps);
  std::vector<argmax::Best> picks(tail.pick ? B * max_threads : 0);  // per thread, each row's best of its columns
  float* lp = tail.head ? logits->data_ptr<float>() : nullptr;
  int64_t* out = tail.pick ? greedy->data_ptr<int64_t>() : nullptr;
  int64_t done = 0;  // steps run: all of them, or up to the first whose greedy token of some row is in stops

#pragma omp parallel num_threads(max_threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    float* res = own0 + stride * tid;
    float* x = res + B * H;
    int64_t tok[MAX_ROWS];  // this step's token ids: ids, then the step before's greedy tokens
    std::copy(tail.id, tail.id + (tail.lookup ? B : 0), tok);
    quant::ActBuffer& room = acts[tid];
    f32::Scratch& scratch = scratches[tid];
    const int64_t J = I / 16;
    for (int64_t s = 0; s < steps; ++s) {
      // This thread's part of a phase's n column groups (or attention tasks): its share, or its runs; `fresh` is true
      // for its first, where a quantized matrix's rows are quantized into `room` (a later run reads them there).
      auto each_run = [&](Runs& runs, int64_t n, int64_t least, auto&& run) {
        if (B <= STREAM_ROWS) {
          const auto [r0, r1] = share(n, tid, nt);
          run(r0, r1, true);
          return;
        }
        bool fresh = true;
        for (int64_t r0, r1; runs.take(n, nt, least, r0, r1); fresh = false) run(r0, r1, fresh);
      };
      if (tail.lookup)
        for (int64_t b = 0; b < B; ++b) tail.tokens.row(tok[b], H, res + b * H);
      else
        std::copy(hp, hp + B * H, res);
      step_profile::Clock clock(tid);
      for (int64_t b = 0; b < B; ++b) f32::rms_norm(res + b * H, layers[0].ln1, H, feps, x + b * H);
      for (int64_t l = 0; l < L; ++l) {
        const Layer& y = layers[l];
        Runs* phase = runs.data() + s * per_step + l * PHASES;
        each_run(phase[0], NQKV / 16, LEAST_GROUPS, [&](int64_t g0, int64_t g1, bool fresh) {
          matvec(B, x, H, y.qkv, room, g0, g1, y.qkv_bias, qkv.data(), NQKV, !fresh);
        });
        clock.mark(step_profile::QKV);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        each_run(phase[1], B * Hkv, 1, [&](int64_t t0, int64_t t1, bool) {
          for (int64_t task = t0; task < t1; ++task) {  // (row, KV head)
            const int64_t b = task / Hkv, kh = task % Hkv, p = pos[b] + s;  // this step's position
            const int64_t at = step_args::run_slot(ix, b, s, bs);  // its K/V slot
            float* q = qkv.data() + b * NQKV;  // this row's q heads, then k heads, then v heads
            const float* c = cos_table + p * D;
            const float* sn = sin_table + p * D;
            for (int64_t g = 0; g <= G; ++g) {  // the G query heads of this KV head, then the key head
              const int64_t head = g < G ? kh * G + g : Hq + kh;
              float* r = q + head * D;
              if (y.qk_norm) f32::rms_norm(r, y.qk_norm + head * D, D, feps, r);
              f32::rotary(r, c, sn, D);
            }
            std::memcpy(y.kv + at * row + kh * D, q + (Hq + kh) * D, D * sizeof(float));
            std::memcpy(y.kv + at * row + (Hkv + kh) * D, q + (Hq + Hkv + kh) * D, D * sizeof(float));
            f32::attend(q + kh * G * D, y.kv, bs, Hkv, D, tbl + b * W, end[b] + s, y.window, kh, G, fscale, scratch,
                        o.data() + (b * Hq + kh * G) * D);
          }
        });
        clock.mark(step_profile::ATTENTION);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        each_run(phase[2], H / 16, LEAST_GROUPS, [&](int64_t g0, int64_t g1, bool fresh) {
          matvec(B, o.data(), Hq * D, y.o, room, g0, g1, y.o_bias, d.data(), H, !fresh);
        });
        clock.mark(step_profile::O_PROJ);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        for (int64_t b = 0; b < B; ++b) {
          f32::add_(res + b * H, d.data() + b * H, H);
          f32::rms_norm(res + b * H, y.ln2, H, feps, x + b * H);
        }
        // Gate groups [g0, g1) and the up groups J later, then silu(gate) * up of those columns.
        each_run(phase[3], J, LEAST_GROUPS, [&](int64_t g0, int64_t g1, bool fresh) {
          step_f32::gate_up(B, x, H, y.gate_up, room, J, g0, g1, y.gate_up_bias, gu.data(), !fresh);
          for (int64_t b = 0; b < B; ++b) {
            const float* g = gu.data() + b * 2 * I;
            f32::silu_mul(g + g0 * 16, g + I + g0 * 16, (g1 - g0) * 16, act.data() + b * I + g0 * 16);
          }
        });
        clock.mark(step_profile::GATE_UP);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        each_run(phase[4], H / 16, LEAST_GROUPS, [&](int64_t g0, int64_t g1, bool fresh) {
          matvec(B, act.data(), I, y.down, room, g0, g1, y.down_bias, d.data(), H, !fresh);
        });
        clock.mark(step_profile::DOWN);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        for (int64_t b = 0; b < B; ++b) {
          f32::add_(res + b * H, d.data() + b * H, H);
          if (l + 1 < L) f32::rms_norm(res + b * H, layers[l + 1].ln1, H, feps, x + b * H);
          else if (tail.head) f32::rms_norm(res + b * H, tail.norm, H, feps, x + b * H);
        }
        clock.mark(step_profile::RESIDUAL);
      }
      if (tail.head) {
        argmax::Best* mine = tail.pick ? picks.data() + tid * B : nullptr;
        std::fill(mine, mine + (tail.pick ? B : 0), argmax::Best{});
        each_run(runs[s * per_step + L * PHASES], V / 16, LEAST_GROUPS, [&](int64_t g0, int64_t g1, bool fresh) {
          step_f32::head(B, x, H, tail.hw, room, g0, g1, lp, V, !fresh, mine);
        });
        clock.mark(step_profile::LM_HEAD);
      }
      bool last = s + 1 == steps;
      if (tail.pick) {
        // Every thread merges every thread's picks alike (the first maximum, NaN first) into the next step's ids, so
        // all of them leave the run after the same step.
#pragma omp barrier
        last = argmax::merge_picks(picks.data(), nt, B, tok, tail.stop_ids, tail.num_stops) || last;
        if (tid == 0) std::copy(tok, tok + B, out + s * B);
      }
      if (tid == 0) done = s + 1;
      if (last) break;
    }
    if (tid == 0) std::copy(res, res + B * H, hp);
  }
  if (step_profile::enabled.load(std::memory_order_relaxed)) step_profile::steps += done;
  return done;
}

// The most rows a step takes.
int64_t decode_step_f32_max_rows() { return MAX_ROWS; }

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("decode_step_f32_max_rows() -> int", &decode_step_f32_max_rows);
  m.def(
      "decode_step_f32_(Tensor(a!) h, Tensor?[] weights, Tensor(b!)[] kv, int[] windows, Tensor cos, Tensor sin, "
      "Tensor position, Tensor table, Tensor length, Tensor slot, int num_heads, int num_kv_heads, float eps, "
      "float scale, Tensor? norm=None, Tensor? lm_head=None, Tensor(c!)? logits=None, Tensor? ids=None, "
      "Tensor? embed=None, Tensor(d!)? greedy=None, int steps=1, Tensor? stops=None) -> int");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("decode_step_f32_", &decode_step_f32_); }

}  // namespace deploykit
