// Compact bf16 matrices (compact_bf16.h) on AMX-BF16 tiles (amx_tiles.h), for every row count, on CPUs with AMX.
//
// Every k-tile of a column block (4 compact groups: 16 k-pairs x 16 columns) is decoded into a 1 KiB buffer in L1
// and loaded from there as a B tile, so the 12-bit stream is read once and never written out as 16 bits (unpacking
// a matrix for the packed AMX kernel cost ~1 ms, 93 of a 512-token prefill's 345 ms, and kept 5-63 rows off AMX).
// A long prefill (compact_amx.cpp) decodes a pair of blocks once, a k-slice at a time into L1, for a chunk's 32-row
// blocks instead.
//
// Either way a row gets the same sequence of tdpbf16ps (amx_tiles.h): on an AMX CPU a row's output is a function of
// that row alone, for one row (the fused decode step), a batch, or a prefill chunk of any size. That is what keeps
// greedy outputs identical with the prefix cache on and off, whatever the chunks. The AVX-512 compact kernels sum
// in another order, so a process uses one or the other for every compact matrix (`enabled`).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>

#include "amx_tiles.h"
#include "compact_bf16.h"
#include "gemv.h"

namespace deploykit {
namespace compact_amx {

// On for compact matrices with K % 32 == 0 once set_compact_amx(true) found AMX granted (engine/kernels at load);
// runtime-settable so that tests compare both paths in one process.
inline std::atomic<bool> enabled{false};

inline bool on(const compact::Matrix& w) { return w.K % 32 == 0 && enabled.load(std::memory_order_relaxed); }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

using bf16 = at::BFloat16;

// B tiles decoded from up to 2 compact blocks k-tile by k-tile (an amx::tile_block source), into `buf`
// (2 x 2 x 512 bf16, 64-byte aligned: the two blocks' tiles, double-buffered so a decode never waits on the tile
// load of the last k-tile). Each group's bytes are requested as far ahead as compact::blocks requests them, a group
// at a time: the same DRAM stream as the AVX-512 GEMV (requesting a k-tile's 12 lines at once, 3 k-tiles ahead,
// was 6 % slower in a batch-1 decode step).
struct CompactB {
  const compact::Matrix& w;
  const uint8_t* src[2];
  const compact::Exception* e[2];
  const compact::Exception* end[2];
  bf16* buf;

  CompactB(const compact::Matrix& m, const int64_t* nb, int n, bf16* b) : w(m), buf(b) {
    for (int g = 0; g < 2; ++g) {
      const int64_t id = nb[std::min(g, n - 1)];
      src[g] = w.data + id * w.groups * compact::GROUP_BYTES;
      e[g] = w.exceptions + w.index[id];
      end[g] = w.exceptions + w.index[id + 1];
    }
  }

  template <int NB>
  [[gnu::always_inline]] inline void load(int64_t kp) {
    using namespace compact;
    const int64_t q0 = kp / GROUP_PAIRS;  // kp is a multiple of 16: groups q0 .. q0 + 3
    bf16* dst = buf + ((kp / 16) & 1) * 1024;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
      for (int g = 0; g < NB; ++g) {
        const uint8_t* p = src[g] + (q0 + i) * GROUP_BYTES;
        for (int l = 0; l < 3; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(p) + gemv::PACKED_PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
        __m512i lines[GROUP_PAIRS];
        decode(p, w.table, lines);
        if (__builtin_expect(e[g] != end[g] && e[g]->group == q0 + i, 0)) patch(lines, e[g], end[g], q0 + i);
        for (int j = 0; j < GROUP_PAIRS; ++j) _mm512_store_si512(dst + g * 512 + (GROUP_PAIRS * i + j) * 32, lines[j]);
      }
    _tile_loadd(6, dst, 64);
    if constexpr (NB > 1) _tile_loadd(7, dst + 512, 64);
  }
};

using Tiles = amx::Tiles;

// out[m, 16 nb[j] + c] for M <= 32 rows of x read in place (tiles configured for them: Tiles(M))
// and n = 1 or 2 column blocks of any ids; silu: a gate block and its up block, out[m, 16 nb[0] + c] = silu(g) * u.
inline void blocks(int64_t M, const bf16* x, int64_t ldx, const compact::Matrix& w, const int64_t* nb, int n,
                   const float* bias, bf16* out, int64_t ldo, bool silu = false) {
  alignas(64) bf16 buf[2 * 1024];
  CompactB b(w, nb, n, buf);
  const int rows0 = (int)std::min<int64_t>(M, 16);
  amx::tile_blocks(amx::plain_a(x, ldx), rows0, (int)M - rows0, b, w.K / 2, nb, n, bias, out, ldo, nullptr, silu);
}

// Column blocks [b0, b1) for M <= 32 rows, two at a time; configures this thread's tiles for the call.
inline void rows(int64_t M, const bf16* x, int64_t ldx, const compact::Matrix& w, int64_t b0, int64_t b1,
                 const float* bias, bf16* out, int64_t ldo) {
  Tiles tiles(M);
  for (int64_t nb = b0; nb < b1; nb += 2) {
    const int64_t ids[2] = {nb, nb + 1};
    blocks(M, x, ldx, w, ids, (int)std::min<int64_t>(2, b1 - nb), bias, out, ldo);
  }
}

#else  // the plain AVX-512F build has no tiles: `enabled` stays off and these are never called

struct Tiles {
  explicit Tiles(int64_t) {}
};

inline void blocks(int64_t, const at::BFloat16*, int64_t, const compact::Matrix&, const int64_t*, int, const float*,
                   at::BFloat16*, int64_t, bool = false) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}
inline void rows(int64_t, const at::BFloat16*, int64_t, const compact::Matrix&, int64_t, int64_t, const float*,
                 at::BFloat16*, int64_t) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}

#endif

}  // namespace compact_amx

// compact_amx.cpp: x [M, K] times a compact blob on AMX tiles, for any M.
at::Tensor compact_linear_amx(const at::Tensor& x, const at::Tensor& blob, const std::optional<at::Tensor>& bias);

}  // namespace deploykit
