// The whole forward pass of a decode step of up to MAX_ROWS sequences (MAX_TILE_ROWS where every matrix is
// quantized or on AMX tiles; one new token each) in one native call, or a run of such steps.
//
// At such batches a step streams every weight once and the per-op path adds ~25 PyTorch dispatches and OpenMP
// fork/joins per layer (~100 us, ~10 % of a step of the 717 MB benchmark model on 2 cores). Here one OpenMP region
// runs every layer and threads meet at a barrier only where a phase needs the whole result of the previous one. Every
// value is computed by the same code as the per-op native path (gemv.h, row_ops.h, attention.h), in the same order,
// so the two agree bitwise; tests compare them. (The one exception is the last residual add, which the per-op path
// leaves to PyTorch: it keeps bf16 denormals that vec.h flushes to zero.)
//
// Per layer, for B rows; the residual h [B, H] and the normed x [B, H] are private to each thread, which computes
// them itself:
//   qkv = x W_qkv^T + b                     column blocks split between threads          | barrier
//   per (row, KV head): q/k norm, rotary, K/V into the row's cache slot, attention -> o  | barrier
//   d = o W_o^T + b                         column blocks split                          | barrier
//   h += d; x = rms_norm(h) * ln2           every thread
//   y = silu(x W_gate^T) * (x W_up^T)       gate block j and up block j on one thread    | barrier
//   d = y W_down^T + b                      column blocks split                          | barrier
//   h += d; x = rms_norm(h) * ln1 of the next layer
// and, when asked for, the way from token ids to greedy tokens: before the first layer each thread looks the rows up
// in the token table itself; after the last,
//   x = rms_norm(h) * norm; logits = x W_lm_head^T in fp32   column blocks split, each thread's argmax among its own
// and every thread merges the threads' picks alike. Python would otherwise run the lookup, the final norm, the LM head
// and the argmax as four more calls, each a PyTorch dispatch whose code and data a step's time evicts from the caches
// (after 15 ms streaming 256 MB, an add_rms_norm call that takes 10 us warm took 200): on a 2-vCPU Zen 4 a Q4_0
// token of the benchmark model spent ~0.39 ms outside this call where it spent ~0.56 (benchmarks/README.md, session
// 53). A run of steps feeds each step's greedy tokens to the next one, at the next position, and ends after a step
// that picks one of `stops` for some row: the Python around a step (scheduling, inputs, sampling, outputs) then runs
// once a run, which made a Q4_0 token ~8 % faster there (session 54).
// A thread's column blocks are its fixed share, walked in claims; one done with its own takes over the back half of
// what the other has left (runs.h Shares), on every matrix but packed bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention.h"
#include "op_args.h"
#include "row_ops.h"
#include "step_args.h"
#include "step_layers.h"
#include "step_matrix.h"
#include "step_profile.h"

namespace deploykit {
namespace {

using bf16 = at::BFloat16;
using step::Layer, step::MAX_ROWS, step::MAX_TILE_ROWS, step::Weight;

using namespace step_args;  // Slot, share, checked_rows

}  // namespace

// h [B, H] bf16, B <= MAX_ROWS (MAX_TILE_ROWS) sequences: each one's token embedding in, the last layer's residual
// stream out (before the final norm). weights: PER_LAYER entries per layer (see Slot), matrices packed as gemv.h
// describes, biases fp32. kv: per layer [NB, bs, 2, Hkv, D]. cos, sin: the rotary tables [max_len, D] (sin signed,
// rotate-half). Per row: position int64 [B], table int32 [B, W] block ids (padded with anything), length int32
// [B] context incl. this token, slot int64 [B] where this token's K/V go. With ids (int64 [B]) and embed (a token
// table, step::Table), h's rows are not read but looked up there (and h still gets the last residual stream). With
// logits (fp32 [B, V]), also the final norm (bf16 [H]) and the LM head (a matrix as above, [V, H]; quantized, compact
// on AMX tiles or B <= MAX_ROWS): the logits kernels.logits(rms_norm(h) * norm, lm_head) gives, bit for bit; with
// greedy (int64 [B]) as well, each row's argmax of them, as kernels.argmax gives it. steps > 1 (with ids, embed,
// logits and greedy [steps, B]): a run, step s at position + s with length + s, its K/V in the slot the table gives
// that position, its rows the greedy tokens of step s - 1; it ends after a step that picks a token in stops (int64
// [S]) for some row, or after all. Returns the steps run; greedy's first rows, logits and h are theirs (the last's).
int64_t decode_step_(const at::Tensor& h, const std::vector<std::optional<at::Tensor>>& weights,
                  const std::vector<at::Tensor>& kv, const std::vector<int64_t>& windows, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& position, const at::Tensor& table,
                  const at::Tensor& length, const at::Tensor& slot, int64_t num_heads, int64_t num_kv_heads,
                  double eps, double scale, const std::optional<at::Tensor>& norm,
                  const std::optional<at::Tensor>& lm_head, const std::optional<at::Tensor>& logits,
                  const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& embed,
                  const std::optional<at::Tensor>& greedy, int64_t steps,
                  const std::optional<at::Tensor>& stops) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1 && h.size(0) <= MAX_TILE_ROWS && h.scalar_type() == at::kBFloat16 &&
                  h.is_contiguous(),
              "h must be a contiguous bf16 [B, H] tensor with 1 <= B <= ", MAX_TILE_ROWS);
  const int64_t B = h.size(0), L = (int64_t)kv.size(), H = h.size(1), Hq = num_heads, Hkv = num_kv_heads;
  TORCH_CHECK(L > 0 && (int64_t)weights.size() == L * PER_LAYER && (int64_t)windows.size() == L,
              "expected ", PER_LAYER, " weights and one window per KV cache layer");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16 && cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin must be contiguous bf16 [max_len, D] tables");
  const int64_t D = cos.size(1), G = Hq / Hkv, NQKV = (Hq + 2 * Hkv) * D;
  TORCH_CHECK(D % attention::HEAD_DIM_MULTIPLE == 0 && D <= attention::MAX_HEAD_DIM, "head_dim must be a multiple of ",
              attention::HEAD_DIM_MULTIPLE, " up to ", attention::MAX_HEAD_DIM);
  const auto& gu0 = weights[GATE_UP];
  TORCH_CHECK(gu0.has_value() && gu0->defined() &&
                  (gu0->dim() == 4 || quant::is_blob(*gu0) || compact::is_blob(*gu0)),
              "layer 0 gate_up: expected a packed, compact or quantized weight");
  const int64_t I = quant::is_blob(*gu0)     ? quant::matrix(*gu0).N / 2
                    : compact::is_blob(*gu0) ? compact::matrix(*gu0).N / 2
                                             : gu0->size(0) * 8;
  TORCH_CHECK(I % op_args::BLOCK_N == 0, "intermediate size must be a multiple of ", op_args::BLOCK_N);

  const step::Layers checked = step::checked_layers(weights, kv, windows, B, H, Hq, Hkv, D, I);
  const std::vector<Layer>& layers = checked.layers;
  const int64_t NB = checked.NB, bs = checked.bs;
  const bool head = logits.has_value() && logits->defined();
  int64_t V = 0;
  Weight hw;
  const bf16* final_norm = nullptr;
  if (head) {
    TORCH_CHECK(logits->dim() == 2 && logits->size(0) == B && logits->size(1) % 16 == 0 &&
                    logits->scalar_type() == at::kFloat && logits->is_contiguous(),
                "logits must be a contiguous fp32 [B, V] tensor, V a multiple of 16");
    V = logits->size(1);
    TORCH_CHECK(lm_head.has_value() && lm_head->defined(), "logits take the lm_head");
    hw = step::weight(*lm_head, V, H, -1, "lm_head");
    TORCH_CHECK(B <= MAX_ROWS || hw.wide(), B, " rows take the lm_head quantized or compact on AMX tiles; with others "
                "1 <= B <= ", MAX_ROWS);
    TORCH_CHECK(norm.has_value() && norm->defined() && norm->numel() == H && norm->scalar_type() == at::kBFloat16 &&
                    norm->is_contiguous(),
                "the final norm: expected a contiguous bf16 tensor of ", H, " elements");
    final_norm = norm->data_ptr<bf16>();
  }
  const bool pick = greedy.has_value() && greedy->defined();
  TORCH_CHECK(!pick || (head && greedy->scalar_type() == at::kLong && greedy->is_contiguous() &&
                        (greedy->dim() == 1 ? steps == 1 && greedy->size(0) == B
                                            : greedy->dim() == 2 && greedy->size(0) == steps && greedy->size(1) == B)),
              "greedy must be a contiguous int64 [B] tensor ([steps, B] for a run), beside logits");
  const bool lookup = ids.has_value() && ids->defined();
  TORCH_CHECK(steps >= 1 && (steps == 1 || (lookup && pick)), "steps must be >= 1, and a run of more (got ", steps,
              ") feeds each step's greedy tokens to the next: it takes ids, embed, logits and greedy");
  const bool stopping = stops.has_value() && stops->defined();
  TORCH_CHECK(!stopping || (stops->dim() == 1 && stops->scalar_type() == at::kLong && stops->is_contiguous()),
              "stops must be a contiguous int64 [S] tensor of token ids");
  const int64_t* stop_ids = stopping ? stops->data_ptr<int64_t>() : nullptr;
  const int64_t num_stops = stopping ? stops->numel() : 0;
  step::Table tokens;
  const int64_t* id = nullptr;
  if (lookup) {
    TORCH_CHECK(embed.has_value() && embed->defined(), "ids take the token table (embed)");
    tokens = step::table(*embed, H);
    TORCH_CHECK(ids->dim() == 1 && ids->size(0) == B && ids->scalar_type() == at::kLong && ids->is_contiguous(),
                "ids must be a contiguous int64 [B] tensor");
    id = ids->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(id[b] >= 0 && id[b] < tokens.V, "token id ", id[b], " of row ", b, " is outside the vocabulary [0, ",
                  tokens.V, ")");
  }
  const RowIndices ix = step_args::checked_rows(position, table, length, slot, B, cos.size(0), NB, bs, steps);
  const int64_t *pos = ix.pos, W = ix.W, longest = ix.longest;
  const int32_t *end = ix.end, *tbl = ix.table;

  // Shared activations [B, ...]; every element has one writer per phase.
  std::vector<bf16> qkv(B * NQKV), o(B * Hq * D), d(B * H), gu(B * 2 * I), act(B * I);
  std::vector<bf16> rounded(head && !hw.quantized() ? B * V : 0);  // a bf16 head's logits before widening
  // Per thread: its copy of the residual stream and its norm, and attention scratch sized up front, so nothing
  // inside the parallel region allocates (an exception there could not be caught).
  const int max_threads = at::get_num_threads();
  std::vector<float> widened(lookup ? H * max_threads : 0);  // a quantized table's row in fp32, per thread
  std::vector<argmax::Best> picks(pick ? B * max_threads : 0);  // per thread, each row's best of its columns
  const int64_t stride = (2 * B * H + 31) / 32 * 32;  // whole 64-byte lines per thread, from a 64-byte boundary
  std::vector<bf16> own(stride * max_threads + 32);
  bf16* own0 = reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(own.data()) + 63) & ~uintptr_t{63});
  std::vector<attention::Scratch> scratches(max_threads);
  std::vector<step::Room> rooms(max_threads);
  for (auto& r : rooms) r.reserve(B, std::max({H, Hq * D, I}));
  for (auto& s : scratches) {
    s.scores.reserve(G * longest);
    s.keys.reserve(longest);
    s.inv.reserve(G);
  }
  bf16* hp = h.data_ptr<bf16>();
  const bf16* cos_table = cos.data_ptr<bf16>();
  const bf16* sin_table = sin.data_ptr<bf16>();
  const float fscale = (float)scale, feps = (float)eps;
  const int64_t row = 2 * Hkv * D;
  // A thread done with its share of a phase takes work over from a slower one (runs.h Shares), on every matrix but
  // packed bf16 (step::shared). Per layer, the Shares of its qkv, o_proj, gate_up and down, made for the team the
  // region gets. Read once: every thread must split a phase alike.
  bool take_over = false;
  if (take_over_on.load(std::memory_order_relaxed))
    for (const Layer& y : layers)
      for (const Weight* m : {&y.qkv, &y.o, &y.gate_up, &y.down}) take_over = take_over || step::shared(*m);
  enum { QKV_SHARES, O_SHARES, GATE_UP_SHARES, DOWN_SHARES, SHARED_PHASES };
  std::vector<Shares> shares;
  if (take_over) {
    shares.reserve(L * SHARED_PHASES);
    for (int64_t i = 0; i < L * SHARED_PHASES; ++i) shares.emplace_back(max_threads);
  }
  std::vector<Shares> head_shares;  // the LM head's, where it takes over as the layers' matrices do
  if (head && step::shared(hw) && take_over_on.load(std::memory_order_relaxed)) head_shares.emplace_back(max_threads);
  float* lp = head ? logits->data_ptr<float>() : nullptr;
  int64_t* out = pick ? greedy->data_ptr<int64_t>() : nullptr;
  int64_t done = 0;  // steps run: all of them, or up to the first whose greedy token of some row is in stops

#pragma omp parallel num_threads(max_threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    bf16* res = own0 + stride * tid;
    bf16* x = res + B * H;
    int64_t tok[MAX_TILE_ROWS];  // this step's token ids: ids, then the step before's greedy tokens
    std::copy(id, id + (lookup ? B : 0), tok);
    attention::Scratch& scratch = scratches[tid];
    step::Room& room = rooms[tid];
    const auto [qb0, qb1] = share(NQKV / 16, tid, nt);
    const auto [ob0, ob1] = share(H / 16, tid, nt);
    const auto [jb0, jb1] = share(I / 16, tid, nt);
    const auto [t0, t1] = share(B * Hkv, tid, nt);  // attention tasks: (row, KV head)
    const int64_t J = I / 16;
    for (int64_t s = 0; s < steps; ++s) {
#pragma omp single
      {
        for (int64_t l = 0; l < (take_over ? L : 0); ++l) {
          const int64_t items[SHARED_PHASES] = {NQKV / 16, H / 16, I / 16, H / 16};
          for (int p = 0; p < SHARED_PHASES; ++p) shares[l * SHARED_PHASES + p].reset(items[p], nt);
        }
        for (Shares& sh : head_shares) sh.reset(V / 16, nt);
      }
      if (lookup)
        for (int64_t b = 0; b < B; ++b) tokens.row(tok[b], H, res + b * H, widened.data() + tid * H);
      else
        std::copy(hp, hp + B * H, res);
      step_profile::Clock clock(tid);
      for (int64_t b = 0; b < B; ++b) rows::rms_norm(res + b * H, layers[0].ln1, H, feps, x + b * H);
      for (int64_t l = 0; l < L; ++l) {
        const Layer& y = layers[l];
        Shares* split = shares.empty() ? nullptr : &shares[l * SHARED_PHASES];
        if (split && step::shared(y.qkv))
          step::matvec_shares(B, x, H, y.qkv, room, split[QKV_SHARES], tid, y.qkv_bias, qkv.data(), NQKV);
        else
          step::matvec(B, x, H, y.qkv, room, qb0, qb1, y.qkv_bias, qkv.data(), NQKV);
        clock.mark(step_profile::QKV);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        const attention::PagedKV cache{y.kv, bs, Hkv, D};
        for (int64_t task = t0; task < t1; ++task) {
          const int64_t b = task / Hkv, kh = task % Hkv, p = pos[b] + s;  // this step's position
          const int64_t at = step_args::run_slot(ix, b, s, bs);  // its K/V slot
          bf16* q = qkv.data() + b * NQKV;  // this row's q heads, then k heads, then v heads
          const bf16* c = cos_table + p * D;
          const bf16* sn = sin_table + p * D;
          for (int64_t g = 0; g <= G; ++g) {  // the G query heads of this KV head, then the key head
            const int64_t head = g < G ? kh * G + g : Hq + kh;
            bf16* r = q + head * D;
            if (y.qk_norm) rows::rms_norm(r, y.qk_norm + head * D, D, feps, r);
            rows::rotary(r, c, sn, D);
          }
          std::memcpy(y.kv + at * row + kh * D, q + (Hq + kh) * D, D * sizeof(bf16));
          std::memcpy(y.kv + at * row + (Hkv + kh) * D, q + (Hq + Hkv + kh) * D, D * sizeof(bf16));
          attention::attend(q + kh * G * D, cache, tbl + b * W, end[b] + s, y.window, kh, G, fscale, scratch,
                            o.data() + (b * Hq + kh * G) * D);
        }
        clock.mark(step_profile::ATTENTION);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        if (split && step::shared(y.o))
          step::matvec_shares(B, o.data(), Hq * D, y.o, room, split[O_SHARES], tid, y.o_bias, d.data(), H);
        else
          step::matvec(B, o.data(), Hq * D, y.o, room, ob0, ob1, y.o_bias, d.data(), H);
        clock.mark(step_profile::O_PROJ);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        for (int64_t b = 0; b < B; ++b) {
          rows::add_(res + b * H, d.data() + b * H, H);
          rows::rms_norm(res + b * H, y.ln2, H, feps, x + b * H);
        }
        const auto silu_mul = [&](int64_t j0, int64_t j1) {  // act = silu(gate) * up for column blocks [j0, j1)
          for (int64_t b = 0; b < B; ++b) {
            const bf16* g = gu.data() + b * 2 * I;
            rows::silu_mul(g + j0 * 16, g + I + j0 * 16, (j1 - j0) * 16, act.data() + b * I + j0 * 16);
          }
        };
        if (split && step::shared(y.gate_up)) {
          step::gate_up_shares(B, x, H, y.gate_up, J, split[GATE_UP_SHARES], tid, y.gate_up_bias, room, gu.data(),
                               silu_mul);
        } else {
          step::gate_up(B, x, H, y.gate_up, J, jb0, jb1, y.gate_up_bias, room, gu.data());
          silu_mul(jb0, jb1);
        }
        clock.mark(step_profile::GATE_UP);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        if (split && step::shared(y.down))
          step::matvec_shares(B, act.data(), I, y.down, room, split[DOWN_SHARES], tid, y.down_bias, d.data(), H);
        else
          step::matvec(B, act.data(), I, y.down, room, ob0, ob1, y.down_bias, d.data(), H);
        clock.mark(step_profile::DOWN);
#pragma omp barrier
        clock.mark(step_profile::BARRIER);
        for (int64_t b = 0; b < B; ++b) {
          rows::add_(res + b * H, d.data() + b * H, H);
          if (l + 1 < L) rows::rms_norm(res + b * H, layers[l + 1].ln1, H, feps, x + b * H);
          else if (head) rows::rms_norm(res + b * H, final_norm, H, feps, x + b * H);
        }
        clock.mark(step_profile::RESIDUAL);
      }
      if (head) {
        const auto [vb0, vb1] = share(V / 16, tid, nt);
        std::fill(picks.begin() + tid * (pick ? B : 0), picks.begin() + (tid + 1) * (pick ? B : 0), argmax::Best{});
        step::head(B, x, H, hw, room, head_shares.empty() ? nullptr : &head_shares[0], tid, vb0, vb1, rounded.data(),
                   lp, V, pick ? picks.data() + tid * B : nullptr);
        clock.mark(step_profile::LM_HEAD);
      }
      bool last = s + 1 == steps;
      if (pick) {
        // Every thread merges every thread's picks alike (the first maximum, NaN first) into the next step's ids, so
        // all of them leave the run after the same step.
#pragma omp barrier
        last = argmax::merge_picks(picks.data(), nt, B, tok, stop_ids, num_stops) || last;
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

// The shape limits above, by name: Python reads them once at load (engine/kernels/__init__.py) instead of repeating
// the numbers.
c10::Dict<std::string, int64_t> limits() {
  c10::Dict<std::string, int64_t> out;
  out.insert("step_max_rows", MAX_ROWS);
  out.insert("step_max_tile_rows", MAX_TILE_ROWS);
  out.insert("head_dim_multiple", attention::HEAD_DIM_MULTIPLE);
  out.insert("max_head_dim", attention::MAX_HEAD_DIM);
  out.insert("block_n", op_args::BLOCK_N);
  out.insert("block_k", op_args::BLOCK_K);
  return out;
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("limits() -> Dict(str, int)", &limits);
  m.def(
      "decode_step_(Tensor(a!) h, Tensor?[] weights, Tensor(b!)[] kv, int[] windows, Tensor cos, Tensor sin, "
      "Tensor position, Tensor table, Tensor length, Tensor slot, int num_heads, int num_kv_heads, float eps, "
      "float scale, Tensor? norm=None, Tensor? lm_head=None, Tensor(c!)? logits=None, Tensor? ids=None, "
      "Tensor? embed=None, Tensor(d!)? greedy=None, int steps=1, Tensor? stops=None) -> int");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("decode_step_", &decode_step_);
}

}  // namespace deploykit
