// Prefill attention on AMX-BF16 tiles, straight from the paged KV cache: one chunk of a prompt's queries against
// every key before them (causal; optionally a sliding window), GQA heads sharing their KV head's keys.
//
// The PyTorch path (engine/models/layers.py) runs SDPA on 64-query tiles with an additive mask, one call per tile,
// so that a query's result depends on its position alone: 0.30-0.46 TFLOP/s on a 2-core Sapphire Rapids-class Xeon
// at 512-4,096 tokens, against 0.36-0.70 for one causal SDPA call (benchmarks/README.md, session 21). Here, per
// (query head, 16 queries), a flash-attention loop over 64-key blocks from key 0:
//   S [16 q, 64 k] = Q K^T by tdpbf16ps (fp32), unscaled; hidden keys (key > query, or outside the window) masked
//   only in a block that holds the diagonal or the window's edge, every key of any other block being visible;
//   an online softmax per query row: m = max of S so far, P = e^((S - m) scale) rounded to bf16, computed as
//   2^(S scale log2 e - m scale log2 e) (one FMA into the exponent, vec::exp2_below's bf16-precision polynomial);
//   O [16 q, D] = O e^((m_old - m) scale) + P V by tdpbf16ps (fp32); l = l e^((m_old - m) scale) + sum P, the row
//   sums also by tdpbf16ps (P times a column of ones, tile 7 into the one-column tile 6);  out = O / l in bf16.
// The softmax's vector work bounds this loop, not the tiles: scaling S into the exponent and skipping the masks of
// whole blocks took 0.78-0.82 of the time at 512-2,000 tokens (benchmarks/README.md, session 35); handing the row
// sums to the tiles, the shorter polynomial and one conversion per 32 P took 0.79-0.94 more (session 39: 0.79-0.83
// in the host's quieter minutes, up to 0.94 while a neighbour slowed its tile loads).
// K is transposed and V interleaved in key pairs once per call into the tiles' B layouts, shared by all heads.
//
// A query's result is a function of its position and the keys alone: its row runs the same blocks from key 0 in the
// same order whichever chunk or tile it is in (a C row is its A row's alone, amx_tiles.h), and a block that hides
// every key from it (past its position, or wholly before its window) leaves its row untouched. So chunked prefill
// and prefix-cache hits compute bitwise the same K/V, as the tiled SDPA path does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "paged_kv.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "amx_tiles.h"
#include "vec.h"
#endif

namespace deploykit {
namespace {

using bf16 = at::BFloat16;
constexpr int64_t KEYS = 64;  // keys per block: S in 4 C tiles of 16 keys, P V in 2 steps of 32 keys

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

// A 64-byte aligned buffer, left uninitialised: make_tiles writes every element (zero-filling a std::vector first,
// two bytes a step, cost more than the tiles themselves).
struct TileBuf {
  struct Free {
    void operator()(bf16* p) const { std::free(p); }
  };
  std::unique_ptr<bf16[], Free> p;
  void alloc(int64_t n) {
    p.reset(static_cast<bf16*>(std::aligned_alloc(64, (n * (int64_t)sizeof(bf16) + 63) / 64 * 64)));
    TORCH_CHECK(p, "prefill_attention: out of memory");
  }
  const bf16* data() const { return p.get(); }
  bf16* data() { return p.get(); }
};

// B tiles of one KV head, made once per call (1 KiB each): kt[block][d/32][4 quarters of 16 keys] (16 d-pairs x 16
// keys x 2 bf16) for Q K^T, and vp[block][2 halves of 32 keys][d/16] (16 key pairs x 16 d x 2 bf16) for P V.
struct HeadTiles {
  TileBuf kt, vp;
};

// r[i]: row i of a 16 x 16 matrix of 32-bit elements -> r[i]: its column i (64 shuffles).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // t[i], t[i + 1], lane L: rows i, i + 1 interleaved, elements 4L .. 4L + 3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k], lane L: element 4L + k of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), b = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i c = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE), d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(a, b, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(a, b, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(c, d, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(c, d, 0xDD);
  }
}

// keys[i]: key i's row (its value row voff elements on). Keys past T read as zeros: their scores are masked, and a
// zero V row keeps 0 x garbage (possibly NaN) out of P V.
void make_tiles(const bf16* const* keys, int64_t voff, int64_t T, int64_t D, HeadTiles& t) {
  const int64_t blocks = (T + KEYS - 1) / KEYS, dk = D / 32, dv = D / 16;
  t.kt.alloc(blocks * dk * 4 * 512);
  t.vp.alloc(blocks * 2 * dv * 512);
  alignas(64) static const uint16_t zero[256] = {};  // a key row of D <= 256 zeros
  const bf16* none = reinterpret_cast<const bf16*>(zero);
  alignas(64) int16_t order[32];  // element n of key 2i, then of key 2i + 1
  for (int n = 0; n < 16; ++n) order[2 * n] = (int16_t)n, order[2 * n + 1] = (int16_t)(16 + n);
  const __m512i pairs = _mm512_load_si512(order);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto key = [&](int64_t j) { return b * KEYS + j < T ? keys[b * KEYS + j] : none; };
    const auto value = [&](int64_t j) { return b * KEYS + j < T ? keys[b * KEYS + j] + voff : none; };
    // K^T: 16 keys of 16 d-pairs (32 bits each) transposed to 16 d-pairs of 16 keys, per quarter and d-chunk.
    for (int64_t quarter = 0; quarter < 4; ++quarter)
      for (int64_t c = 0; c < dk; ++c) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(key(quarter * 16 + j) + c * 32);
        transpose16(r);
        bf16* dst = t.kt.data() + ((b * dk + c) * 4 + quarter) * 512;
        for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + p * 32, r[p]);
      }
    // V: keys (j, j + 1) interleaved element by element, 16 d of each a tile row: row (j % 32) / 2 of half j / 32.
    for (int64_t j = 0; j < KEYS; j += 2) {
      const bf16 *v0 = value(j), *v1 = value(j + 1);
      for (int64_t c = 0; c < dv; ++c) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c * 16));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c * 16));
        _mm512_store_si512(t.vp.data() + ((b * 2 + j / 32) * dv + c) * 512 + (j % 32 / 2) * 32,
                           _mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)));
      }
    }
  }
}

// C tiles 0-3 += A tile 4 times the four 1 KiB B tiles from b, each through tile 5.
[[gnu::always_inline]] inline void times_four(const bf16* b) {
  _tile_loadd(5, b, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(5, b + 512, 64);
  _tile_dpbf16ps(1, 4, 5);
  _tile_loadd(5, b + 1024, 64);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(5, b + 1536, 64);
  _tile_dpbf16ps(3, 4, 5);
}
[[gnu::always_inline]] inline void zero_four() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
// C tiles 0-3 -> dst [16 rows][64 floats] (tile i: columns 16 i .. 16 i + 15).
[[gnu::always_inline]] inline void store_four(float (*dst)[64]) {
  _tile_stored(0, &dst[0][0], sizeof(dst[0]));
  _tile_stored(1, &dst[0][16], sizeof(dst[0]));
  _tile_stored(2, &dst[0][32], sizeof(dst[0]));
  _tile_stored(3, &dst[0][48], sizeof(dst[0]));
}

// Query head rows [0, rows) of q (positions pos0 + r, rows ldq apart) -> out rows (ldo apart). lo, hi: the key
// blocks to visit. The 16 rows' softmax state lives in vectors (lane r: row r).
void tile_task(const bf16* q, int64_t ldq, int64_t rows, int64_t pos0, int64_t window, float scale, int64_t D,
               const HeadTiles& t, int64_t lo, int64_t hi, float* o, bf16* out, int64_t ldo) {
  const int64_t dk = D / 32, dv = D / 16;
  alignas(64) float s[16][KEYS];
  alignas(64) bf16 p[16][KEYS];
  alignas(64) float pv[16][64];
  alignas(64) float alpha[16];
  alignas(64) bf16 qpad[16][32];  // rows past `rows` are zero (their results are dropped)
  std::fill(o, o + 16 * D, 0.0f);
  const float inf = std::numeric_limits<float>::infinity();
  __m512 m = _mm512_set1_ps(-inf), l = _mm512_setzero_ps();
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __mmask16 real = (__mmask16)((1u << rows) - 1);
  for (int64_t b = lo; b < hi; ++b) {
    // S = Q K^T over the D/32 d-chunks: keys 16 i .. 16 i + 15 in C tile i.
    zero_four();
    for (int64_t c = 0; c < dk; ++c) {
      if (rows == 16) {
        _tile_loadd(4, q + c * 32, ldq * (int64_t)sizeof(bf16));
      } else {
        std::memset(qpad, 0, sizeof(qpad));
        for (int64_t r = 0; r < rows; ++r) std::memcpy(qpad[r], q + r * ldq + c * 32, 64);
        _tile_loadd(4, qpad, 64);
      }
      times_four(t.kt.data() + (b * dk + c) * 4 * 512);
    }
    store_four(s);
    // Which keys each row sees: every key of the block, for every row of the tile, unless the block holds the
    // diagonal or the window's edge; then each row compares key and query positions. The scores stay unscaled and
    // the scale goes into the exponent, 2^((s - m) scale log2 e), so a visible key's P is the same bits either way:
    // a query's result may not depend on which tile it is in (see above).
    const int64_t k0 = b * KEYS;
    const bool whole = k0 + KEYS - 1 <= pos0 && (window == 0 || k0 > pos0 + 15 - window);
    __mmask16 vis[16][4], live = 0;
    __m512 mx[16];
    const __m512 ninf = _mm512_set1_ps(-inf);
    if (whole) {
      for (int r = 0; r < 16; ++r) {
        const __m512 a = _mm512_max_ps(_mm512_load_ps(s[r]), _mm512_load_ps(s[r] + 16));
        mx[r] = _mm512_max_ps(a, _mm512_max_ps(_mm512_load_ps(s[r] + 32), _mm512_load_ps(s[r] + 48)));
      }
      live = 0xFFFF;
    } else {
      __m512i k[4];
      for (int i = 0; i < 4; ++i) k[i] = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(k0 + 16 * i)));
      for (int r = 0; r < 16; ++r) {
        const __m512i last = _mm512_set1_epi32((int)(pos0 + r)), first = _mm512_set1_epi32((int)(pos0 + r - window));
        __mmask16 any = 0;
        mx[r] = ninf;
        for (int i = 0; i < 4; ++i) {
          vis[r][i] = _mm512_cmple_epi32_mask(k[i], last);
          if (window > 0) vis[r][i] &= _mm512_cmpgt_epi32_mask(k[i], first);
          any |= vis[r][i];
          mx[r] = _mm512_max_ps(mx[r], _mm512_mask_mov_ps(ninf, vis[r][i], _mm512_load_ps(s[r] + 16 * i)));
        }
        if (any) live |= (__mmask16)(1u << r);
      }
    }
    live &= real;
    const auto max = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
    const __m512 mnew = _mm512_mask_max_ps(m, live, m, vec::reduce16(mx, max));  // lane r: row r's max (unscaled)
    // e^((m_old - m_new) scale): exactly 1 where the max did not move; ~1e-38 (vec::exp's floor) where nothing was
    // seen yet, which multiplies O = l = 0.
    _mm512_store_ps(alpha, _mm512_maskz_mov_ps(live, vec::exp(_mm512_mul_ps(_mm512_sub_ps(m, mnew),
                                                                             _mm512_set1_ps(scale)))));
    alignas(64) float mrow[16];
    _mm512_store_ps(mrow, mnew);
    const float c = scale * 1.44269504f;  // scale log2(e)
    const __m512 cv = _mm512_set1_ps(c);
    for (int r = 0; r < 16; ++r) {
      if (!(live >> r & 1)) {
        std::memset(p[r], 0, sizeof(p[r]));
        continue;
      }
      // Hidden keys get exactly 0. P is rounded to bf16 for the P V product (32 at a time: keys 32 h .. 32 h + 31
      // from two vectors in one vcvtne2ps2bf16), and l sums the rounded values, so O / l normalises what was
      // multiplied.
      const __m512 nmc = _mm512_set1_ps(-mrow[r] * c);
      for (int i = 0; i < 4; i += 2) {
        __m512 e0 = vec::exp2_below(_mm512_fmadd_ps(_mm512_load_ps(s[r] + 16 * i), cv, nmc));
        __m512 e1 = vec::exp2_below(_mm512_fmadd_ps(_mm512_load_ps(s[r] + 16 * i + 16), cv, nmc));
        if (!whole) {
          e0 = _mm512_maskz_mov_ps(vis[r][i], e0);
          e1 = _mm512_maskz_mov_ps(vis[r][i + 1], e1);
        }
        _mm512_store_si512(p[r] + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      }
    }
    m = mnew;
    // O = O alpha + P V, 64 d at a time (4 C tiles of 16 d), the block's two 32-key halves summed in the tiles; with
    // the first 64 d, the rows' sums of P: tile 6 [16 rows, 1 fp32] += P half [16, 32 keys] x ones [32 keys, 1].
    _tile_zero(6);
    for (int64_t c0 = 0; c0 < dv; c0 += 4) {
      zero_four();
      for (int half = 0; half < 2; ++half) {
        _tile_loadd(4, &p[0][32 * half], sizeof(p[0]));
        times_four(t.vp.data() + ((b * 2 + half) * dv + c0) * 512);
        if (c0 == 0) _tile_dpbf16ps(6, 4, 7);
      }
      store_four(pv);
      if (c0 == 0) {
        alignas(64) float sums[16];  // lane r: row r's sum of P (one fp32 a tile row)
        _tile_stored(6, sums, sizeof(float));
        l = _mm512_mask_fmadd_ps(l, live, _mm512_load_ps(alpha), _mm512_load_ps(sums));
      }
      for (int r = 0; r < 16; ++r) {
        if (!(live >> r & 1)) continue;
        const __m512 a = _mm512_set1_ps(alpha[r]);
        float* orow = o + r * D + c0 * 16;
        for (int i = 0; i < 4; ++i) {
          const __m512 scaled = _mm512_fmadd_ps(_mm512_load_ps(orow + 16 * i), a, _mm512_load_ps(&pv[r][16 * i]));
          _mm512_store_ps(orow + 16 * i, scaled);
        }
      }
    }
  }
  alignas(64) float lrow[16];
  _mm512_store_ps(lrow, l);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / lrow[r]);  // a query always sees itself, so l > 0
    for (int64_t d = 0; d < D; d += 16)
      vec::store16(out + r * ldo + d, _mm512_mul_ps(_mm512_load_ps(o + r * D + d), inv));
  }
}

// Tiles 0-5 16 rows of 64 bytes; 6 and 7 16 rows of one 32-bit column: the rows' sums of P, and 16 key pairs of
// ones (bf16 1.0 = 0x3F80), which stays loaded for the thread's tasks.
void configure() {
  static constexpr uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  static constexpr uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 4, 4};
  amx::configure(rows, colsb);
  alignas(64) static constexpr uint32_t ones[16] = {
      0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u,
      0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
  _tile_loadd(7, ones, sizeof(uint32_t));
}

#endif

}  // namespace

// q [L, Hq, D] bf16 (rows may be strided, heads contiguous) at positions [position, position + L), their K/V already
// in the cache; kv [NB, bs, 2, Hkv, D] contiguous; table int32 [W]: the sequence's blocks covering keys
// [0, position + L). window > 0: key j is visible to query i when i - window < j <= i. -> [L, Hq, D] bf16.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table, int64_t position,
                             double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.size(0) >= 1, "q must be a [L, Hq, D] tensor with L >= 1");
  TORCH_CHECK(position >= 0 && window >= 0, "position and window must be >= 0");
  TORCH_CHECK(scale > 0, "scale must be > 0 (the softmax takes each row's max before scaling), not ", scale);
  const int64_t L = q.size(0), end = position + L;
  const at::Tensor tables = table.view({1, -1}), lens = at::full({1}, end, table.options());
  // The decode op's checks, as one sequence (q's first row stands for the chunk: the rows share strides and heads).
  const paged::Call c = paged::check(q.narrow(0, 0, 1), kv, tables, lens, at::kBFloat16, "bf16", 64, 256);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  TORCH_CHECK(amx_init(), "AMX tile state was not granted by the OS");
  TORCH_CHECK(end < (int64_t{1} << 30), "context too long for 32-bit key indices");
  const int64_t Hq = c.Hq, Hkv = c.Hkv, D = c.D, G = c.G, bs = c.bs, row = 2 * Hkv * D;
  const bf16* data = kv.data_ptr<bf16>();
  // Keys a query of this chunk may see: from the first query's window start (block-aligned) to the end.
  const int64_t kfirst = window > 0 ? std::max<int64_t>(0, position - window + 1) / KEYS * KEYS : 0;
  const int64_t T = end - kfirst;
  std::vector<HeadTiles> heads(Hkv);
  at::parallel_for(0, Hkv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<const bf16*> keys(T);
    for (int64_t h = h0; h < h1; ++h) {
      paged::key_rows(data, bs, row, h, D, c.tables, kfirst, T, keys.data());
      make_tiles(keys.data(), Hkv * D, T, D, heads[h]);
    }
  });
  at::Tensor out = at::empty({L, Hq, D}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t ldq = q.stride(0), tiles = (L + 15) / 16, tasks = tiles * Hq;
  // Later tiles see more keys: threads take tasks from the last tile down, as they come free.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    float* o = static_cast<float*>(std::aligned_alloc(64, 16 * D * sizeof(float)));  // the tile's O [16, D]
    TORCH_CHECK(o, "prefill_attention: out of memory");
    configure();
    for (int64_t i = next++; i < tasks; i = next++) {
      const int64_t tile = tiles - 1 - i / Hq, hq = i % Hq, r0 = tile * 16, rows = std::min<int64_t>(16, L - r0);
      const int64_t p0 = position + r0, plast = p0 + rows - 1;
      const int64_t lo = window > 0 ? (std::max<int64_t>(0, p0 - window + 1) - kfirst) / KEYS : 0;
      const int64_t hi = (plast - kfirst) / KEYS + 1;
      tile_task(qp + r0 * ldq + hq * D, ldq, rows, p0 - kfirst, window, (float)scale, D, heads[hq / G], lo, hi,
                o, op + (r0 * Hq + hq) * D, Hq * D);
    }
    _tile_release();
    std::free(o);
  });
  return out;
#else
  (void)c;
  TORCH_CHECK(false, "this kernel library was built without AMX-BF16");
#endif
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("prefill_attention(Tensor q, Tensor kv, Tensor table, int position, float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) { m.impl("prefill_attention", &prefill_attention); }

}  // namespace deploykit
