// One (sequence, KV head) task of paged decode attention, shared by decode_attention.cpp and the fused batch-1
// decode step (decode_step.cpp), so both produce bitwise the same outputs.
//
// The G = Hq / Hkv query heads sharing a KV head are computed together (GQA), so every K/V row is loaded once:
// scores [G, T] = q . k * scale (vec::dot2, fp32 accumulation; on AMX CPUs 16 keys at a time on tiles, below), an
// exact softmax in fp32 (max-subtracted, two passes over the scores), then out [G, D] = sum_t p[g, t] * v_t in fp32,
// up to 28 sums (heads x 16-lane chunks of D) held in registers while each V row is read once (on AMX CPUs: p rounded
// to bf16 and the sums on tiles, 32 keys a k-step).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "gemv.h"
#include "paged_kv.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"
#define DEPLOYKIT_ATTENTION_TILES 1
#endif

namespace deploykit {
namespace attention {

using bf16 = at::BFloat16;
using namespace vec;

// Head sizes the attention kernels take: multiples of one 32-lane bf16 vector, up to MAX_HEAD_DIM.
constexpr int64_t HEAD_DIM_MULTIPLE = 32;
constexpr int64_t MAX_HEAD_DIM = 256;

// Cache geometry: kv [NB, bs, 2, Hkv, D] contiguous; token t of a sequence lives in block table[t / bs].
struct PagedKV {
  const bf16* data;
  int64_t block_size, kv_heads, head_dim;
  int64_t row() const { return 2 * kv_heads * head_dim; }  // elements between consecutive tokens of a block
};

// Per-thread buffers, grown on demand and reused across tasks; qt and c: the AMX scores' Q^T tiles and C tile.
struct Scratch {
  std::vector<float> scores, inv;
  std::vector<const bf16*> keys;
#ifdef DEPLOYKIT_ATTENTION_TILES
  std::vector<bf16> p;  // [16][Tp] bf16 probabilities for tile_pv (rows from G on: left as they are, never stored)
  alignas(64) uint32_t qt[MAX_HEAD_DIM / 32][16][16];
  alignas(64) bf16 vt[4][16][32];
  alignas(64) float c[16][16];
#endif
};

// Whether the scores and the sums over V take AMX tiles where they can (tile_scores, tile_pv): set once from Python
// on a CPU with AMX (set_attention_tiles, decode_attention.cpp); both settings are tested against each other and the
// reference.
inline std::atomic<bool> tiles_on{false};

// Query heads whose output sums one register pass keeps (GT of 32 registers, with V and the broadcast p).
constexpr int64_t GT = 8;

// Output sums the value pass keeps in registers (heads x 16-lane chunks; with V and the broadcast p, of 32).
constexpr int64_t PV_REGISTERS = 28;
constexpr int MAX_CHUNKS = 16;  // MAX_HEAD_DIM / 16

// A task's K or V rows are scattered one per token (512 bytes apart at 2 KV heads of 64), which the hardware
// prefetcher follows poorly: the key and value loops request their rows this many 16-key steps ahead. Measured
// with V read once (below), 16 sequences x 1,060 keys, 14 query heads on 2 KV heads of 64, DRAM-cold: 1.01 ms a
// layer (one 16-lane chunk of V at a time, no requests ahead: 1.78 ms); 4 steps ahead, or into L2 only, no faster.
constexpr int64_t KEYS_AHEAD = 2;

// Requests rows [t, t + n) (clipped to T): D elements of each from element offset `off`.
inline void prefetch_rows(const bf16* const* keys, int64_t t, int64_t T, int64_t n, int64_t off, int64_t D) {
  for (int64_t i = t; i < std::min(T, t + n); ++i)
    for (int64_t b = 0; b < D * (int64_t)sizeof(bf16); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(keys[i] + off) + b, _MM_HINT_T0);
}

// out[j, d0 + 16 c + lane] = sum_t p[j, t] * v_t[d0 + 16 c + lane] * inv[j] for N heads (p rows T apart, out rows D
// apart) and C chunks: N x C sums in registers, each an fmadd chain over t in order.
template <int N, int C>
inline void pv_sums(const float* p, int64_t T, const bf16* const* keys, int64_t voff, int64_t d0, const float* inv,
                    bf16* out, int64_t D) {
  __m512 a[N][C];
  for (int j = 0; j < N; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < T; ++t) {
    if (t % 16 == 0) prefetch_rows(keys, t + 16 * KEYS_AHEAD, T, 16, voff, D);
    const bf16* v = keys[t] + voff + d0;
    for (int c = 0; c < C; ++c) {
      const __m512 vv = load16(v + 16 * c);
      for (int j = 0; j < N; ++j) a[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * T + t]), vv, a[j][c]);
    }
  }
  for (int j = 0; j < N; ++j)
    for (int c = 0; c < C; ++c) store16(out + j * D + d0 + 16 * c, _mm512_mul_ps(a[j][c], _mm512_set1_ps(inv[j])));
}

// The largest of a head's T scores, broadcast.
inline __m512 row_max(const float* s, int64_t T) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < T; t += 16) {
    const __mmask16 mk = tail_mask(T - t);
    mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, s + t));
  }
  return _mm512_set1_ps(_mm512_reduce_max_ps(mv));
}

#ifdef DEPLOYKIT_ATTENTION_TILES
// scores[g, t..] = q_g . k_t * scale for the keys from t on, 16 at a time while 16 remain, on AMX tiles; returns where
// it stopped. The vector loop below spends ~40 cycles a key at G = 7, D = 64 (two dot2 and a lane reduction per key and
// head); a tile pass is two tdpbf16ps per 16 keys. S^T [16 keys, 16 heads] = K [16 keys, D] . Q^T: the A tile is 16
// K rows read in place (one block's tokens, `row` elements apart: the caller takes groups that start at a multiple
// of 16 in a block of a multiple of 16 tokens), the B tiles Q^T packed once per task (tile c: row kp, column n holds
// q_n[32 c + 2 kp], q_n[32 c + 2 kp + 1]; heads from G on zero). Tiles as the caller's amx::Tiles(32) configures them
// (all 16 x 64 bytes): C 0, A 4, B 6.
inline int64_t tile_scores(const bf16* q, const bf16* const* keys, int64_t t, int64_t T, int64_t G, int64_t D,
                           int64_t row, float scale, Scratch& s, float* scores) {
  if (t + 16 > T) return t;
  const int64_t chunks = D / 32;
  std::memset(s.qt, 0, chunks * sizeof(s.qt[0]));
  for (int64_t n = 0; n < G; ++n)
    for (int64_t c = 0; c < chunks; ++c)
      for (int kp = 0; kp < 16; ++kp) std::memcpy(&s.qt[c][kp][n], q + n * D + 32 * c + 2 * kp, 4);
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));  // key i's score of head g at c[i][g]
  const __m512 sc = _mm512_set1_ps(scale);
  for (; t + 16 <= T; t += 16) {
    prefetch_rows(keys, t + 16 * KEYS_AHEAD, T, 16, 0, D);
    _tile_zero(0);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, keys[t] + 32 * c, row * (int64_t)sizeof(bf16));
      _tile_loadd(6, &s.qt[c][0][0], 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, &s.c[0][0], 64);
    for (int64_t g = 0; g < G; ++g)
      _mm512_storeu_ps(scores + g * T + t, _mm512_mul_ps(_mm512_i32gather_ps(rows, &s.c[0][g], 4), sc));
  }
  return t;
}

// Interleaves 16 bf16 of a with 16 of b (a[i], b[i], ...): the low halves (lo) or the high ones (hi).
inline __m512i pair_index(int from) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) idx[2 * i] = (int16_t)(from + i), idx[2 * i + 1] = (int16_t)(32 + from + i);
  return _mm512_load_si512(idx);
}

// out[g, :] = sum_t p[g, t] v_t * inv[g] on AMX tiles, 32 keys a k-step. A: p [16 heads, Tp] bf16 (p rounded to bf16,
// as the prefill's tiles take it; the zero columns from T on pad the last k-step). B: 32 V rows interleaved by pairs
// of keys into s.vt (row kp, column n: v_{t+2kp}[d0 + n], v_{t+2kp+1}[d0 + n]), one tile per 16 columns of D. Four C
// tiles hold 64 columns, so a D past 64 takes the keys again per 64. Against the fp32 loop (pv_sums: G x D / 16 fmadds
// a key) this is ~4 permutes a key and the tiles' k-steps. Tiles as the caller's amx::Tiles(32) configures them.
inline void tile_pv(const bf16* p, int64_t Tp, const bf16* const* keys, int64_t T, int64_t voff, int64_t D,
                    int64_t G, const float* inv, Scratch& s, bf16* out) {
  const __m512i lo = pair_index(0), hi = pair_index(16), zero = _mm512_setzero_si512();
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const bool four = D - d0 >= 64;  // else 32 columns (D is a multiple of 32)
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t = 0; t < Tp; t += 32) {
      prefetch_rows(keys, t + 32, T, 32, voff + d0, std::min<int64_t>(64, D - d0));
      for (int kp = 0; kp < 16; ++kp) {
        const int64_t ta = t + 2 * kp;
        for (int h = 0; h < (four ? 2 : 1); ++h) {  // 32 columns of D a load
          const __m512i a = ta < T ? _mm512_loadu_si512(keys[ta] + voff + d0 + 32 * h) : zero;
          const __m512i b = ta + 1 < T ? _mm512_loadu_si512(keys[ta + 1] + voff + d0 + 32 * h) : zero;
          _mm512_store_si512(&s.vt[2 * h][kp][0], _mm512_permutex2var_epi16(a, lo, b));
          _mm512_store_si512(&s.vt[2 * h + 1][kp][0], _mm512_permutex2var_epi16(a, hi, b));
        }
      }
      _tile_loadd(4, p + t, Tp * (int64_t)sizeof(bf16));
      _tile_loadd(6, &s.vt[0][0][0], 64);
      _tile_loadd(7, &s.vt[1][0][0], 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (four) {
        _tile_loadd(6, &s.vt[2][0][0], 64);
        _tile_loadd(7, &s.vt[3][0][0], 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    auto store = [&](int c) {  // C tile c: [16 heads, 16 columns from d0 + 16 c] in s.c
      for (int64_t g = 0; g < G; ++g)
        store16(out + g * D + d0 + 16 * c, _mm512_mul_ps(_mm512_load_ps(s.c[g]), _mm512_set1_ps(inv[g])));
    };
    _tile_stored(0, &s.c[0][0], 64);
    store(0);
    _tile_stored(1, &s.c[0][0], 64);
    store(1);
    if (four) {
      _tile_stored(2, &s.c[0][0], 64);
      store(2);
      _tile_stored(3, &s.c[0][0], 64);
      store(3);
    }
  }
}
#endif

// q: the G query heads of KV head h (D apart); table: the sequence's block ids; end: context length including
// this token; window > 0: only the last `window` keys. out: G rows of D, D apart.
inline void attend(const bf16* q, const PagedKV& kv, const int32_t* table, int64_t end, int64_t window, int64_t h,
                   int64_t G, float scale, Scratch& s, bf16* out) {
  const int64_t D = kv.head_dim, bs = kv.block_size, row = kv.row(), chunks = D / 32;
  const int64_t t0 = window > 0 ? std::max<int64_t>(0, end - window) : 0, T = end - t0;  // visible keys
  // Each visible key's K row, found once (the loops below visit a key up to 1 + D / 16 times).
  s.keys.resize(T);
  paged::key_rows(kv.data, bs, row, h, D, table, t0, T, s.keys.data());
  const bf16* const* keys = s.keys.data();
  auto token = [&](int64_t i) { return keys[i]; };
  s.scores.resize(G * T);
  s.inv.resize(G);
  float* scores = s.scores.data();
  // One key: its K row in registers, the G query rows from L1.
  auto one_key = [&](int64_t t) {
    const bf16* k = token(t);
    __m512i kc[MAX_HEAD_DIM / 32];
    for (int64_t c = 0; c < chunks; ++c) kc[c] = _mm512_loadu_si512(k + 32 * c);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) acc = vec::dot2(acc, kc[c], _mm512_loadu_si512(q + g * D + 32 * c));
      scores[g * T + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  };
  int64_t t = 0;  // the key loops' shared position
#ifdef DEPLOYKIT_ATTENTION_TILES
  // The switch read once a task, and the tiles configured once for both tile_scores and tile_pv.
  const bool tiled = G <= 16 && tiles_on.load(std::memory_order_relaxed);
  std::optional<amx::Tiles> tiles;
  if (tiled) tiles.emplace(32);
  // On tiles, 16 keys at a time from the first key at a multiple of 16 in the sequence (the keys before it one at a
  // time), so a key's path depends on its position and the context length alone, never on the block table.
  if (tiled && bs % 16 == 0) {
    for (const int64_t lead = std::min(T, (16 - t0 % 16) % 16); t < lead; ++t) one_key(t);
    t = tile_scores(q, keys, t, T, G, D, row, scale, s, scores);
  }
#endif
  // scores[g, t], 16 keys at a time: per query head, the 16 keys' partial-sum vectors are summed across lanes by one
  // transposed reduction (vec::reduce16, ~3 ops a key) instead of one _mm512_reduce_add_ps each (~10); its
  // pairing is that reduction's tree, so every score is bitwise the same. The 16 K rows stay in L1 across heads.
  for (; t + 16 <= T; t += 16) {
    const bf16* ks[16];
    for (int i = 0; i < 16; ++i) ks[i] = token(t + i);
    prefetch_rows(keys, t + 16 * KEYS_AHEAD, T, 16, 0, D);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c)
          acc[i] = vec::dot2(acc[i], _mm512_loadu_si512(ks[i] + 32 * c), _mm512_loadu_si512(q + g * D + 32 * c));
      }
      _mm512_storeu_ps(scores + g * T + t, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
    }
  }
  for (; t < T; ++t) one_key(t);  // the last T % 16 keys
  const int64_t voff = kv.kv_heads * D;
#ifdef DEPLOYKIT_ATTENTION_TILES
  // On tiles, p rounded to bf16 into s.p (the sum over the rounded values, so a row's weights sum to 1), then tile_pv.
  if (tiled) {
    const int64_t Tp = (T + 31) / 32 * 32;
    s.p.resize(16 * Tp);
    for (int64_t g = 0; g < G; ++g) {
      const float* sg = scores + g * T;
      bf16* pg = s.p.data() + g * Tp;
      const __m512 m = row_max(sg, T);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < Tp; t += 16) {  // zeros from T on
        const __mmask16 mk = tail_mask(std::max<int64_t>(0, T - t));
        const __m512 e = vec::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + t), m));
        const __m256i pb = to_bf16(_mm512_maskz_mov_ps(mk, e));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pg + t), pb);
        sum = _mm512_add_ps(sum, widen(pb));
      }
      s.inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    tile_pv(s.p.data(), Tp, keys, T, voff, D, G, s.inv.data(), s, out);
    return;
  }
#endif
  // Softmax per query head: p = exp(s - max) in place, 1 / sum kept for the output.
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * T;
    const __m512 m = row_max(sg, T);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; t += 16) {
      const __mmask16 mk = tail_mask(T - t);
      const __m512 p = vec::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + t), m));
      _mm512_mask_storeu_ps(sg + t, mk, p);
      sum = _mm512_mask_add_ps(sum, mk, sum, p);
    }
    s.inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // out[g] = sum_t p[g, t] * v_t / sum[g]: up to GT query heads x as many 16-lane chunks of D as PV_REGISTERS allows
  // in registers over all t, so each V row is read once for all of them (one chunk at a time read V D / 16 times,
  // and with 1,000+ keys a task's V rows do not fit L1). Each sum is the same fmadd chain over t whatever the
  // grouping, so the outputs are bitwise what one chunk at a time gave.
  for (int64_t g = 0; g < G; g += GT) {
    const int64_t n = std::min<int64_t>(GT, G - g);
    for (int64_t d = 0; d < D;) {
      const int64_t c = std::min<int64_t>((D - d) / 16, PV_REGISTERS / n);
      gemv::with_rows<GT>(n, [&](auto gt) {  // n heads and c chunks made compile-time
        gemv::with_rows<MAX_CHUNKS>(c, [&](auto ct) {
          constexpr int N = decltype(gt)::value, C = decltype(ct)::value;
          if constexpr (N * C <= PV_REGISTERS)  // c <= PV_REGISTERS / n: the others are never called
            pv_sums<N, C>(scores + g * T, T, keys, voff, d, s.inv.data() + g, out + g * D, D);
        });
      });
      d += 16 * c;
    }
  }
}

}  // namespace attention
}  // namespace deploykit
