// compact_linear on AMX tiles (compact_amx.h) for every M, the MLP's gate_up with silu(gate) * up applied as the
// tiles are stored, and the switch that turns them on.
//
// Up to 32 rows, x is read in place and each thread decodes its column blocks' k-tiles into L1 as the tiles take
// them. Past 32 rows (prefill), x is copied into tile blocks, and a chunk of 32-row blocks either decodes each pair
// of column blocks again per block, or once, in k-slices that every block of the chunk reads from L1; a long K takes
// the k-slices outermost (see below). Every way gives each row the same tdpbf16ps sequence.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>

#include "compact_amx.h"
#include "op_args.h"

namespace deploykit {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

using bf16 = at::BFloat16;

// Past 32 rows x is copied into tile blocks and taken in chunks of 32-row blocks of at most CHUNK_BYTES, which stay in
// L2 (2 MiB a core on every AMX CPU so far) while each of the thread's column-block pairs goes over them.
constexpr int64_t CHUNK_BYTES = 1024 * 1024;
// Decoded once, a pair is decoded a slice of SLICE k-pairs at a time into L1 (2 x 192 x 64 bytes = 24 KiB), and every
// 32-row block of the chunk runs that slice's tiles on it, its C tiles' fp32 sums kept in L1 between slices
// (amx::Partial: bitwise one pass over K). Decoding the whole pair into L2 instead read B tiles from L2 at
// 1.06-1.09x the packed 16-bit kernel's time; slices of 192 k-pairs 0.93-1.01x, of 448 1.07-1.17x, of 96 1.00-1.05x.
constexpr int64_t SLICE = 192;
// From this many 32-row blocks in a chunk on, a pair of column blocks is decoded once (in slices) for all of them;
// below, every block's tiles decode the pair's k-tiles again as they go (compact_amx::CompactB), which overlaps the
// decode with the tile work. Measured on a 2-core Sapphire Rapids-class Xeon over the benchmark model's matrices
// against the packed 16-bit AMX kernel: at 96 rows decoding again 0.96-1.15x its time, once 1.15-1.18x; at 128 rows
// (4 blocks, K = 896) once 1.06-1.12x, again 1.17-1.19x; at 512 rows and K = 896 once 0.92-1.01x, again 1.27-1.30x;
// K = 4864 (3 blocks a chunk) decoding again 1.04x. Runtime-settable so that tests compare both paths bitwise.
std::atomic<int64_t> decode_once_min_blocks{4};

namespace {

// A long K leaves too few 32-row blocks in a chunk that stays in L2 (K = 4864: 3) to decode a pair once for them, so
// every block decoded the pair again, from memory (a 512-token prefill's down projection at 1.3 TFLOP/s against 2.1
// for gate_up). There the k-slices go outermost instead: for each slice, every pair of the thread is decoded once
// into L1 and run on the slice of up to KOUTER_BLOCKS blocks (their A slices stay in L2 across the pairs), the C
// tiles' sums of every (block, pair) kept between slices in at most about KOUTER_C_BYTES.
constexpr int64_t KOUTER_BLOCKS = 16, KOUTER_C_BYTES = 1024 * 1024;

// The column-block pairs a call runs and where their rows go: adjacent blocks (2p, 2p + 1) of a linear into
// [M, N], or, for a gate_up matrix [gate; up] with silu, gate block p and up block NB/2 + p into [M, N/2] as
// silu(gate) * up (the decode step pairs them the same way).
struct Pairs {
  int64_t NB;
  bool silu;
  int64_t count() const { return silu ? NB / 2 : (NB + 1) / 2; }
  int64_t ldo() const { return silu ? NB * 8 : NB * 16; }
  int ids(int64_t p, int64_t* nb) const {
    nb[0] = silu ? p : 2 * p;
    nb[1] = silu ? NB / 2 + p : 2 * p + 1;
    return nb[1] < NB ? 2 : 1;
  }
};

// Block mb's tiles over k-pairs [k0, k0 + kn) of column blocks nb (n of them), B decoded into `b`, partial sums at c.
inline void slice_block(int64_t M, const bf16* xbp, const compact::Matrix& w, int64_t mb, int64_t k0, int64_t kn,
                        const int64_t* nb, int n, amx::PackedB<false>& b, float* c, const float* bias, bf16* out,
                        const Pairs& pairs) {
  const int64_t Kh = w.K / 2, ldo = pairs.ldo();
  const int rows = (int)std::min<int64_t>(32, M - mb * 32);
  amx::ATiles a = amx::blocked_a(xbp, Kh, mb);
  a.base += (k0 / 16) * a.step;
  const amx::Partial part{c, k0 == 0, k0 + kn == Kh};
  amx::tile_blocks(a, std::min(rows, 16), std::max(rows - 16, 0), b, kn, nb, n, bias, out + mb * 32 * ldo, ldo, &part,
                   pairs.silu);
}

// Pair p's k-pairs [k0, k0 + kn) decoded into buf (two blocks of SLICE k-pairs); returns its block count.
inline int decode_slice(const compact::Matrix& w, const Pairs& pairs, int64_t p, int64_t k0, int64_t kn, bf16* buf,
                        int64_t* nb) {
  const int n = pairs.ids(p, nb);
  for (int j = 0; j < n; ++j) compact::unpack_groups(w, nb[j], k0 / 4, (k0 + kn) / 4, buf + j * SLICE * 32);
  return n;
}

// Blocks [c0, c1) against pairs [p0, p1), k-slices outermost; cbuf holds (c1 - c0) * (p1 - p0) * 1024 floats.
inline void k_outer(int64_t M, const bf16* xbp, const compact::Matrix& w, const Pairs& pairs, int64_t c0, int64_t c1,
                    int64_t p0, int64_t p1, bf16* buf, float* cbuf, const float* bias, bf16* out) {
  for (int64_t k0 = 0; k0 < w.K / 2; k0 += SLICE) {
    const int64_t kn = std::min(SLICE, w.K / 2 - k0);
    for (int64_t p = p0; p < p1; ++p) {
      int64_t nb[2];
      const int n = decode_slice(w, pairs, p, k0, kn, buf, nb);
      amx::PackedB<false> b{buf, buf + SLICE * 32};
      for (int64_t mb = c0; mb < c1; ++mb)
        slice_block(M, xbp, w, mb, k0, kn, nb, n, b, cbuf + ((p - p0) * (c1 - c0) + (mb - c0)) * 1024, bias, out,
                    pairs);
    }
  }
}

// Blocks [c0, c1) against pairs [p0, p1), a pair at a time: decoded once in k-slices for all the blocks (from `once`
// blocks on; cbuf holds (c1 - c0) * 1024 floats), else again for every block as its tiles go.
inline void pair_outer(int64_t M, const bf16* xbp, const compact::Matrix& w, const Pairs& pairs, int64_t c0,
                       int64_t c1, int64_t p0, int64_t p1, int64_t once, bf16* buf, float* cbuf, const float* bias,
                       bf16* out) {
  const int64_t Kh = w.K / 2, ldo = pairs.ldo();
  for (int64_t p = p0; p < p1; ++p) {
    int64_t nb[2];
    if (c1 - c0 >= once) {
      for (int64_t k0 = 0; k0 < Kh; k0 += SLICE) {
        const int64_t kn = std::min(SLICE, Kh - k0);
        const int n = decode_slice(w, pairs, p, k0, kn, buf, nb);
        amx::PackedB<false> b{buf, buf + SLICE * 32};
        for (int64_t mb = c0; mb < c1; ++mb)
          slice_block(M, xbp, w, mb, k0, kn, nb, n, b, cbuf + (mb - c0) * 1024, bias, out, pairs);
      }
    } else {
      const int n = pairs.ids(p, nb);
      for (int64_t mb = c0; mb < c1; ++mb) {
        const int rows = (int)std::min<int64_t>(32, M - mb * 32);
        compact_amx::CompactB b(w, nb, n, buf);
        amx::tile_blocks(amx::blocked_a(xbp, Kh, mb), std::min(rows, 16), std::max(rows - 16, 0), b, Kh, nb, n, bias,
                         out + mb * 32 * ldo, ldo, nullptr, pairs.silu);
      }
    }
  }
}

// x [M, K] against every pair of w into out (bias fp32 or nullptr).
void run(int64_t M, const bf16* x, int64_t ldx, const at::Tensor& xt, const compact::Matrix& w, const Pairs& pairs,
         const float* bias, bf16* out) {
  if (M <= 32) {
    at::parallel_for(0, pairs.count(), 1, [&](int64_t p0, int64_t p1) {
      compact_amx::Tiles tiles(M);
      for (int64_t p = p0; p < p1; ++p) {
        int64_t nb[2];
        const int n = pairs.ids(p, nb);
        compact_amx::blocks(M, x, ldx, w, nb, n, bias, out, pairs.ldo(), pairs.silu);
      }
    });
    return;
  }
  const at::Tensor xb = amx_block_x(xt);  // zero-padded to whole 32-row blocks
  const bf16* xbp = xb.data_ptr<bf16>();
  const int64_t mblocks = (M + 31) / 32, chunk = std::max<int64_t>(1, CHUNK_BYTES / (32 * w.K * 2));
  const int64_t once = decode_once_min_blocks.load(std::memory_order_relaxed);
  at::parallel_for(0, pairs.count(), 1, [&](int64_t p0, int64_t p1) {
    // The C tiles' sums between k-slices: 4 KiB per 32-row block and pair.
    const int64_t span = std::clamp<int64_t>(KOUTER_C_BYTES / ((p1 - p0) * 4096), 1, KOUTER_BLOCKS);
    const bool outer = chunk < once && std::min(mblocks, span) >= once;
    bf16* buf = static_cast<bf16*>(std::aligned_alloc(64, 2 * SLICE * 64));
    float* cbuf = static_cast<float*>(std::aligned_alloc(64, (outer ? span * (p1 - p0) : chunk) * 4096));
    TORCH_CHECK(buf && cbuf, "compact_linear_amx: out of memory for a decode buffer");
    {
      compact_amx::Tiles tiles(32);
      if (outer)
        for (int64_t c0 = 0; c0 < mblocks; c0 += span)
          k_outer(M, xbp, w, pairs, c0, std::min(mblocks, c0 + span), p0, p1, buf, cbuf, bias, out);
      else
        for (int64_t c0 = 0; c0 < mblocks; c0 += chunk)
          pair_outer(M, xbp, w, pairs, c0, std::min(mblocks, c0 + chunk), p0, p1, once, buf, cbuf, bias, out);
    }
    std::free(buf);
    std::free(cbuf);
  });
}

}  // namespace

// x [M, K] bf16, a compact blob [N, K] with K % 32 == 0, bias [N] or None -> [M, N] bf16.
at::Tensor compact_linear_amx(const at::Tensor& x, const at::Tensor& blob, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_init(), "AMX tile state was not granted by the OS");
  const compact::Matrix w = compact::matrix(blob);
  TORCH_CHECK(w.K % op_args::BLOCK_K == 0, "the AMX path needs K % ", op_args::BLOCK_K, " == 0, got K=", w.K);
  const op_args::Operands args = op_args::operands(x, w.K, w.N, bias);
  if (x.size(0) > 0) run(x.size(0), args.x, args.ldx, x, w, Pairs{w.N / 16, false}, args.b, args.o);
  return args.out;
}

// x [M, K] bf16, a compact gate_up blob [2I, K] (gate rows, then up rows; I % 16 == 0, K % 32 == 0), bias [2I] or
// None -> silu(x W_gate^T + b_gate) * (x W_up^T + b_up) [M, I] bf16, each row the same bits as silu_mul gives it
// from compact_linear_amx's gate_up row: the gate_up intermediate is never written out (in a 512-token prefill
// [512, 9728] bf16, 10 MB a layer, written and read back once more by silu_mul).
at::Tensor compact_gate_up_silu_amx(const at::Tensor& x, const at::Tensor& blob,
                                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_init(), "AMX tile state was not granted by the OS");
  const compact::Matrix w = compact::matrix(blob);
  TORCH_CHECK(w.K % op_args::BLOCK_K == 0, "the AMX path needs K % ", op_args::BLOCK_K, " == 0, got K=", w.K);
  TORCH_CHECK(w.N % 32 == 0, "gate_up needs whole 16-column blocks of gate and of up, got N=", w.N);
  const op_args::Operands args = op_args::operands(x, w.K, w.N, bias);  // checks x and the bias
  at::Tensor out = at::empty({x.size(0), w.N / 2}, x.options());
  if (x.size(0) > 0) run(x.size(0), args.x, args.ldx, x, w, Pairs{w.N / 16, true}, args.b, out.data_ptr<bf16>());
  return out;
}

// Turns the AMX path on or off for every compact matrix it can take (compact_amx::on); true if it is now on.
bool set_compact_amx(bool on) {
  compact_amx::enabled.store(on && amx_init());
  return compact_amx::enabled.load();
}

#else  // the plain AVX-512F build: no tile code; the switch stays off

at::Tensor compact_linear_amx(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}

at::Tensor compact_gate_up_silu_amx(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}

bool set_compact_amx(bool) { return false; }

#endif

// From how many 32-row blocks of a chunk compact_linear_amx decodes each pair of column blocks once (default 4).
void set_compact_amx_decode_once(int64_t blocks) {
  TORCH_CHECK(blocks >= 1, "the decode-once path needs at least one 32-row block, not ", blocks);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  decode_once_min_blocks.store(blocks);
#endif
}

bool compact_amx_enabled() { return compact_amx::enabled.load(); }

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("set_compact_amx(bool on) -> bool", &set_compact_amx);
  m.def("compact_amx_enabled() -> bool", &compact_amx_enabled);
  m.def("set_compact_amx_decode_once(int blocks) -> ()", &set_compact_amx_decode_once);
  m.def("compact_linear_amx(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
  m.def("compact_gate_up_silu_amx(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("compact_linear_amx", &compact_linear_amx);
  m.impl("compact_gate_up_silu_amx", &compact_gate_up_silu_amx);
}

}  // namespace deploykit
