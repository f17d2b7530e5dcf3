// compact_linear on AMX tiles (compact_amx.h) for every M, the MLP's gate_up with silu(gate) * up applied as the
// tiles are stored, a prompt's gate_up written as tile panels and a matrix that reads them, and the switch that turns
// them on.
//
// Up to 32 rows, x is read in place and each thread decodes its column blocks' k-tiles into L1 as the tiles take
// them. Past 32 rows (prefill), x is copied into tile blocks (or comes as panels), and a chunk of 32-row blocks
// either decodes each pair of column blocks again per block, or once, a segment of K at a time that every block of
// the chunk reads from L1; a long K takes the segments outermost (amx_slices.h). Every way gives each row the same
// tdpbf16ps sequence and the same order of segment sums (amx_tiles.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>

#include "amx_slices.h"
#include "compact_amx.h"
#include "op_args.h"

namespace deploykit {

at::Tensor compact_linear(const at::Tensor& x, const at::Tensor& blob,
                          const std::optional<at::Tensor>& bias);  // compact_bf16.cpp

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

using bf16 = at::BFloat16;

// From this many 32-row blocks in a chunk on, a pair of column blocks is decoded once (in slices) for all of them;
// below, every block's tiles decode the pair's k-tiles again as they go (compact_amx::CompactB), which overlaps the
// decode with the tile work. Measured on a 2-core Sapphire Rapids-class Xeon over the benchmark model's matrices
// against the packed 16-bit AMX kernel: at 96 rows decoding again 0.96-1.15x its time, once 1.15-1.18x; at 128 rows
// (4 blocks, K = 896) once 1.06-1.12x, again 1.17-1.19x; at 512 rows and K = 896 once 0.92-1.01x, again 1.27-1.30x;
// K = 4864 (3 blocks a chunk) decoding again 1.04x. Runtime-settable so that tests compare both paths bitwise.
std::atomic<int64_t> decode_once_min_blocks{4};

namespace {

using amx_slices::Pairs;

// A compact matrix as an amx_slices source.
struct Source {
  const compact::Matrix& w;
  int64_t K;
  // Block nb's k-pairs [k0, k0 + kn) -> dst [kn][16][2].
  void slice(int64_t nb, int64_t k0, int64_t kn, bf16* dst) {
    compact::unpack_groups(w, nb, k0 / 4, (k0 + kn) / 4, dst);
  }
  // The groups that slice() reads (its exceptions aside: about 2 in 10,000 weights).
  void bytes(int64_t nb, int64_t k0, int64_t kn, const char*& begin, const char*& end) const {
    begin = reinterpret_cast<const char*>(w.data + (nb * w.groups + k0 / 4) * compact::GROUP_BYTES);
    end = begin + kn / 4 * compact::GROUP_BYTES;
  }
  // Block mb of x's tiles against column blocks nb, decoding their k-tiles again as the tiles go.
  void again(int64_t M, const amx_slices::XTiles& x, int64_t mb, const int64_t* nb, int n, const float* bias,
             bf16* out, const Pairs& pairs) {
    alignas(64) bf16 buf[2 * 1024];
    const int rows = (int)std::min<int64_t>(32, M - mb * 32);
    compact_amx::CompactB b(w, nb, n, buf);
    amx::tile_blocks(x.at(K / 2, mb), std::min(rows, 16), std::max(rows - 16, 0), b, K / 2, nb, n, bias,
                     out + mb * 32 * pairs.ldo(), pairs.ldo(), nullptr, pairs.silu, nullptr, nullptr, pairs.panel);
  }
};

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
  Source src{w, w.K};
  const int64_t once = decode_once_min_blocks.load(std::memory_order_relaxed);
  amx_slices::blocked(M, xt, src, pairs, once, once, bias, out);
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

// A prompt's MLP without copying the down projection's x into tile blocks: compact_gate_up_silu_panels writes
// silu(gate) * up for M > 32 prompt rows as panels (amx_slices.h panels_for), each value the bits
// compact_gate_up_silu_amx gives it; compact_linear_panels (and quant_prompt_linear_panels) read them as their A
// tiles. The copy it saves took ~0.27 ms a layer at 512 rows of the benchmark model ([512, 4864] bf16, about a tenth
// of the down projection's time); a 512-token prefill took 0.93x the time with panels (benchmarks/README.md, "A
// prompt's MLP through tile panels").
at::Tensor compact_gate_up_silu_panels(const at::Tensor& x, const at::Tensor& blob,
                                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_init(), "AMX tile state was not granted by the OS");
  const compact::Matrix w = compact::matrix(blob);
  TORCH_CHECK(w.K % op_args::BLOCK_K == 0, "the AMX path needs K % ", op_args::BLOCK_K, " == 0, got K=", w.K);
  TORCH_CHECK(w.N % 64 == 0, "panels of gate_up's output need whole 32-column panels of gate and of up, got N=", w.N);
  op_args::check_x(x, w.K);
  const int64_t M = x.size(0);
  TORCH_CHECK(M > 32, "panels are for a prompt's rows (more than 32), got ", M);
  const at::Tensor b = op_args::float_bias(bias, w.N);
  at::Tensor out = amx_slices::panels_for(M, w.N / 2, x.options());
  Source src{w, w.K};
  const int64_t once = decode_once_min_blocks.load(std::memory_order_relaxed);
  amx_slices::blocked(M, x, src, Pairs{w.N / 16, true, out.size(1) * 32}, once, once,
                      b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<bf16>());
  return out;
}

// xp: panels of M > 32 prompt rows [K/32, M rounded up to 32, 32] -> [M, N] bf16, each row the bits
// compact_linear_amx gives it from the same rows as [M, K].
at::Tensor compact_linear_panels(const at::Tensor& xp, int64_t M, const at::Tensor& blob,
                                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_init(), "AMX tile state was not granted by the OS");
  const compact::Matrix w = compact::matrix(blob);
  TORCH_CHECK(w.K % op_args::BLOCK_K == 0, "the AMX path needs K % ", op_args::BLOCK_K, " == 0, got K=", w.K);
  TORCH_CHECK(M > 32, "panels are for a prompt's rows (more than 32), got ", M);
  const int64_t rows_pad = amx_slices::panel_rows(xp, M, w.K);
  // Switched off (set_compact_amx): the rows as compact_linear takes them then, so the bits stay linear's.
  if (!compact_amx::enabled.load()) return compact_linear(amx_slices::rows_of(xp, M), blob, bias);
  const at::Tensor b = op_args::float_bias(bias, w.N);
  at::Tensor out = at::empty({M, w.N}, xp.options());
  Source src{w, w.K};
  const int64_t once = decode_once_min_blocks.load(std::memory_order_relaxed);
  amx_slices::blocked_tiles(M, amx_slices::XTiles{xp.data_ptr<bf16>(), rows_pad}, src, Pairs{w.N / 16, false}, once,
                            once, b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<bf16>());
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

at::Tensor compact_gate_up_silu_panels(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}

at::Tensor compact_linear_panels(const at::Tensor&, int64_t, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this kernel library was built without AMX");
}

bool set_compact_amx(bool) { return false; }

#endif

// From how many 32-row blocks of a chunk compact_linear_amx (and the panel ops) decodes each pair of column blocks once
// (default 4).
void set_compact_amx_decode_once(int64_t blocks) {
  TORCH_CHECK(blocks >= 1, "the decode-once path needs at least one 32-row block, not ", blocks);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  decode_once_min_blocks.store(blocks);
#endif
}

bool compact_amx_enabled() { return compact_amx::enabled.load(); }

// How a prompt's AMX matmuls (amx_slices.h) take K: slices of `slice_segments` segments (0: whole K, as before
// segments), whether blocked x streams past L1 (amx_tiles.h stream_a), and whether plain epilogues request their
// output lines ahead (amx_tiles.h own_lines). Every setting gives the same bits; for measurements and the tests.
// Defaults: 1, true, true.
void set_amx_prompt_tiles(int64_t slice_segments, bool stream_a, bool own_lines) {
  TORCH_CHECK(slice_segments >= 0, "slice_segments is 0 (whole K) or more, not ", slice_segments);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  amx_slices::slice_segments.store(slice_segments);
  amx::stream_a.store(stream_a);
  amx::own_lines.store(own_lines);
#endif
}

TORCH_LIBRARY_FRAGMENT(deploykit, m) {
  m.def("set_compact_amx(bool on) -> bool", &set_compact_amx);
  m.def("compact_amx_enabled() -> bool", &compact_amx_enabled);
  m.def("set_compact_amx_decode_once(int blocks) -> ()", &set_compact_amx_decode_once);
  m.def("set_amx_prompt_tiles(int slice_segments, bool stream_a, bool own_lines=True) -> ()", &set_amx_prompt_tiles);
  m.def("compact_linear_amx(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
  m.def("compact_gate_up_silu_amx(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
  m.def("compact_gate_up_silu_panels(Tensor x, Tensor blob, Tensor? bias) -> Tensor");
  m.def("compact_linear_panels(Tensor xp, int M, Tensor blob, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deploykit, CPU, m) {
  m.impl("compact_linear_amx", &compact_linear_amx);
  m.impl("compact_gate_up_silu_amx", &compact_gate_up_silu_amx);
  m.impl("compact_gate_up_silu_panels", &compact_gate_up_silu_panels);
  m.impl("compact_linear_panels", &compact_linear_panels);
}

}  // namespace deploykit
