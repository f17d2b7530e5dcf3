"""The AMX matmuls past a few rows hand their column-block pairs (quantized rows: 16-column groups) to the threads in
runs as they come free (kernels/runs.h tile_pairs): a thread its host slows for a while no longer holds the other back
for half of every call. Which thread takes a pair changes no bit of it: runs, fixed shares and one thread give the
same outputs on compact bf16 weights (pairs decoded once a chunk, in one chunk or two, or again per block; the k-slices
outermost at K = 4864; gate_up with SiLU), on packed bf16 weights (one chunk or two, and the tail rows of a call), on
plain [N, K] bf16 weights at 2-64 rows (a pair and a lone block), on a prompt's rows of a quantized matrix (gate_up
with SiLU too) and on quantized rows from 16 outside the fused step (AMX-INT8), also with thread 0 slowed so that the
other computes most of the pairs."""
from __future__ import annotations

import pytest
import torch

from engine import kernels, quant
from tests.engine.conftest import NATIVE
from tests.engine.test_quant import random_raw

pytestmark = [pytest.mark.skipif(not NATIVE, reason="no native path here (a CPU without AVX-512, or kernels off)"),
              pytest.mark.usefixtures("native_kernels"),
              pytest.mark.skipif(not kernels.status()["amx"], reason="these matmuls run on AMX tiles only on AMX "
                                                                     "CPUs")]

ops = torch.ops.deploykit


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).bfloat16()


def cases() -> dict:
    """name -> a call of one AMX matmul path (each returns its output)."""
    g = torch.Generator().manual_seed(1)
    x = {k: torch.randn(300, k, generator=g).bfloat16() for k in (896, 2048, 4864)}
    compact_up = kernels.prepare_weight(weights(1152, 896), compact=True)
    compact_wide = kernels.prepare_weight(weights(640, 2048, 5), compact=True)
    compact_down = kernels.prepare_weight(weights(896, 4864, 2), compact=True)
    compact_gu = kernels.prepare_weight(weights(1024, 896, 3), compact=True)
    packed, packed_wide = kernels.prepare_weight(weights(1152, 896, 4)), kernels.prepare_weight(weights(640, 2048, 6))
    assert all(kernels.is_compact(w) for w in (compact_up, compact_wide, compact_down, compact_gu))
    assert not kernels.is_compact(packed) and not kernels.is_compact(packed_wide)
    blob, blob_gu = quant.pack([random_raw("Q4_0", 1152, 896)]), quant.pack([random_raw("Q4_0", 1024, 896, 1)])
    assert kernels.prompt_gate_up_silu_ok(blob_gu)
    bias = torch.randn(1152, generator=g)
    plain = weights(1168, 896, 7)  # plain [N, K], read in place: 36 pairs and a lone 16-row block
    plain_bias = torch.randn(1168, generator=g)
    # 300 rows are 10 blocks of 32: one chunk at K = 896 (18 blocks a chunk), two at K = 2048 (8; packed: 6), a
    # k-outer span at K = 4864; 96 rows (3 blocks, fewer than 4) decode each pair again per block.
    calls = {
        "compact, decoded once a chunk": lambda: kernels.linear(x[896], compact_up, bias),
        "compact, two chunks": lambda: kernels.linear(x[2048], compact_wide),
        "compact, decoded again per block": lambda: kernels.linear(x[896][:96], compact_up, bias),
        "compact, k-slices outermost": lambda: kernels.linear(x[4864], compact_down),
        "compact gate_up with silu": lambda: kernels.gate_up_silu(x[896], compact_gu),
        "packed, blocked rows": lambda: kernels.linear(x[896], packed, bias),
        "packed, two chunks": lambda: kernels.linear(x[2048], packed_wide),
        "packed, 32 rows and a tail": lambda: kernels.linear(x[896][:45], packed, bias),
        "quantized prompt rows": lambda: kernels.linear(x[896], blob, bias, prompt_from=0),
        "quantized gate_up with silu": lambda: kernels.gate_up_silu(x[896], blob_gu),
        "plain, 40 rows": lambda: kernels.linear(x[896][:40], plain, plain_bias),
    }
    assert kernels.status()["quant_amx"]  # every AMX CPU has AMX-INT8: quantized rows from 16 on its tiles
    calls["quantized rows from 16"] = lambda: kernels.linear(x[896][:40], blob, bias)
    return calls


def test_runs_fixed_shares_and_one_thread_give_the_same_bits():
    threads = torch.get_num_threads()
    calls = cases()
    assert ops.set_tile_runs(True) is True  # in runs by default
    try:
        torch.set_num_threads(1)
        want = {name: fn() for name, fn in calls.items()}
        torch.set_num_threads(2)
        for on in (True, False):
            ops.set_tile_runs(on)
            ops.tile_runs_taken()
            for name, fn in calls.items():
                assert torch.equal(fn(), want[name]), (name, "runs" if on else "fixed shares")
                taken, _ = ops.tile_runs_taken()
                assert (taken > 0) == on, name  # every path takes runs; fixed shares take none
    finally:
        ops.set_tile_runs(True)
        torch.set_num_threads(threads)


def test_a_slowed_thread_takes_fewer_pairs_and_changes_no_bit():
    # Thread 0 spins 2 ms before each run: the other computes most of the pairs, and every output keeps its bits. A
    # call may be tried 3 times: on a loaded machine the other thread can itself be descheduled for that long.
    threads = torch.get_num_threads()
    calls = cases()
    try:
        torch.set_num_threads(2)
        want = {name: fn() for name, fn in calls.items()}
        ops.set_first_thread_delay(2000.0)
        for name, fn in calls.items():
            shares = []
            for _ in range(3):
                ops.tile_runs_taken()
                assert torch.equal(fn(), want[name]), name
                taken, first = ops.tile_runs_taken()
                shares.append((first, taken))
                if first < taken / 2:
                    break
            else:
                pytest.fail(f"{name}: thread 0 computed {shares} (its pairs, of all) though slowed")
    finally:
        ops.set_first_thread_delay(0.0)
        torch.set_num_threads(threads)
