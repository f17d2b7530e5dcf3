"""Shares (kernels/runs.h): the fused decode step's threads walk their fixed shares of a phase, and one done with its
own takes over the back half of what a slower one has left. Every item is computed exactly once, whatever the team,
and a thread the host slows no longer holds the others back. (test_decode_step holds the step's outputs, taken over
or not, to the per-op path bit for bit.)"""
from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import ANY_NATIVE

pytestmark = [pytest.mark.skipif(not ANY_NATIVE, reason="no kernel build runs here (a CPU without AVX2)"),
              pytest.mark.usefixtures("f32_kernels")]  # every build holds runs_ops.cpp


def walk(n: int, threads: int, step: int = 4, least: int = 8, slow: int = -1, slow_us: float = 0.0) -> torch.Tensor:
    return torch.ops.deploykit.shares_walk(n, threads, step, least, slow, slow_us)


@pytest.mark.parametrize("n,threads,step,least", [(1000, 2, 4, 8), (1001, 3, 1, 1), (7, 4, 2, 2), (0, 2, 4, 8),
                                                 (56, 2, 1, 2), (304, 2, 1, 2)])
def test_every_item_is_computed_exactly_once(n, threads, step, least):
    for slow in range(-1, threads):
        who = walk(n, threads, step, least, slow, 20.0 if slow >= 0 else 0.0)
        assert who.shape == (n,)
        assert not (who == -1).any(), f"items never computed: {(who == -1).nonzero().flatten().tolist()[:10]}"
        assert not (who == -2).any(), f"items computed twice: {(who == -2).nonzero().flatten().tolist()[:10]}"


def test_a_fast_thread_takes_over_most_of_a_slow_ones_share():
    # Thread 1 spins 2 ms an item: alone it would take 1 s over its 500. Thread 0 does its own 500 first, then takes
    # back halves of thread 1's, which keeps the front of each (its claims so far, and at least least/2 = 4 items).
    # Thread 0 may start up to ~200 ms late on a loaded host and still take over 400.
    who = walk(1000, 2, step=4, least=8, slow=1, slow_us=2000.0)
    assert (who[:500] == 0).all(), "the fast thread's own share is its own"
    assert (who[500:504] == 1).all(), "the slow thread's first claim stays its own"
    assert (who[500:] == 0).sum() >= 400, f"thread 1 computed {(who == 1).sum()} of its 500 items itself"


def test_a_walk_refuses_counts_that_do_not_fit_its_packed_word():
    with pytest.raises(RuntimeError, match="step < 2\\^30"):
        walk(10, 2, step=1 << 32)
    with pytest.raises(RuntimeError, match="0 <= n < 2\\^30"):
        walk(1 << 31, 2)


def test_the_fused_step_switch_reports_its_previous_setting():
    ops = torch.ops.deploykit
    assert ops.set_step_take_over(False) is True  # on by default
    try:
        assert ops.set_step_take_over(False) is False
    finally:
        ops.set_step_take_over(True)
