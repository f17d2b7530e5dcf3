"""A prompt's AMX matmuls hand their column-block pairs to the threads in runs as they come free (kernels/runs.h
prompt_pairs): a thread its host slows for a while no longer holds the other back for half of every call. Which thread
takes a pair changes no bit of it: runs, fixed shares and one thread give the same outputs on compact bf16 weights
(pairs decoded once per chunk, and the k-slices outermost at K = 4864), on packed bf16 weights (the tail rows of a
call too) and on a prompt's rows of a quantized matrix, also with thread 0 slowed so that the other takes most runs."""
from __future__ import annotations

import pytest
import torch

from engine import kernels, quant
from tests.engine.conftest import NATIVE
from tests.engine.test_quant import random_raw

pytestmark = [pytest.mark.skipif(not NATIVE, reason="no native path here (a CPU without AVX-512, or kernels off)"),
              pytest.mark.usefixtures("native_kernels"),
              pytest.mark.skipif(not kernels.status()["amx"], reason="the prompt matmuls run on AMX tiles only on "
                                                                     "AMX CPUs")]

ops = torch.ops.deploykit


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).bfloat16()


def cases() -> dict:
    """name -> a call of one prompt matmul path (each returns its output)."""
    g = torch.Generator().manual_seed(1)
    x896, x4864 = torch.randn(300, 896, generator=g).bfloat16(), torch.randn(300, 4864, generator=g).bfloat16()
    compact_up = kernels.prepare_weight(weights(1152, 896), compact=True)
    compact_down = kernels.prepare_weight(weights(896, 4864, 2), compact=True)
    compact_gu = kernels.prepare_weight(weights(1024, 896, 3), compact=True)
    packed = kernels.prepare_weight(weights(1152, 896, 4))
    assert kernels.is_compact(compact_up) and kernels.is_compact(compact_down) and not kernels.is_compact(packed)
    blob = quant.pack([random_raw("Q4_0", 1152, 896)])
    bias = torch.randn(1152, generator=g)
    return {
        "compact, decoded once a chunk": lambda: kernels.linear(x896, compact_up, bias),
        "compact, k-slices outermost": lambda: kernels.linear(x4864, compact_down),
        "compact gate_up with silu": lambda: kernels.gate_up_silu(x896, compact_gu),
        "packed, blocked rows": lambda: kernels.linear(x896, packed, bias),
        "packed, 32 rows and a tail": lambda: kernels.linear(x896[:45], packed, bias),
        "quantized prompt rows": lambda: kernels.linear(x896, blob, bias, prompt_from=0),
    }


def test_runs_fixed_shares_and_one_thread_give_the_same_bits():
    threads = torch.get_num_threads()
    calls = cases()
    assert ops.set_prompt_runs(True) is True  # in runs by default
    try:
        torch.set_num_threads(1)
        want = {name: fn() for name, fn in calls.items()}
        torch.set_num_threads(2)
        for on in (True, False):
            ops.set_prompt_runs(on)
            ops.prompt_runs_taken()
            for name, fn in calls.items():
                assert torch.equal(fn(), want[name]), (name, "runs" if on else "fixed shares")
            taken, _ = ops.prompt_runs_taken()
            assert (taken > 0) == on  # fixed shares take no runs
    finally:
        ops.set_prompt_runs(True)
        torch.set_num_threads(threads)


def test_a_slowed_thread_takes_fewer_runs_and_changes_no_bit():
    # Thread 0 spins 2 ms before each run: the other takes most of them, and every output keeps its bits.
    threads = torch.get_num_threads()
    calls = cases()
    try:
        torch.set_num_threads(2)
        want = {name: fn() for name, fn in calls.items()}
        ops.set_first_thread_delay(2000.0)
        for name, fn in calls.items():
            ops.prompt_runs_taken()
            assert torch.equal(fn(), want[name]), name
            taken, first = ops.prompt_runs_taken()
            assert taken >= 2 and first < taken / 2, (name, taken, first)
    finally:
        ops.set_first_thread_delay(0.0)
        torch.set_num_threads(threads)
