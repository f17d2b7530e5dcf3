"""Per-level numbers from raw results: percentiles as numpy computes them, throughput over the level's wall time,
errors counted with samples, and where token counts came from."""
from __future__ import annotations

import numpy as np
import pytest

from deploykit.bench.client import Result
from deploykit.bench.stats import percentile, summarize


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], list(np.random.default_rng(0).
                                                                                         exponential(size=101))])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_matches_numpy(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_none():
    assert percentile([], 50) is None


def test_a_level_counts_tokens_over_its_wall_time_and_keeps_error_samples():
    ok = [Result(i, start=0.5 * i, e2e=2.0, ttft=0.25, itl=(0.1,) * 7, output_tokens=8, prompt_tokens=32, chunks=8)
          for i in range(4)]
    chunked = Result(4, start=0.0, e2e=1.0, ttft=0.5, itl=(0.25, 0.25), output_tokens=3, counted="chunks", chunks=3)
    bad = [Result(5, 1.0, 0.01, error="HTTP 500: boom", status=500), Result(6, 1.1, 0.01, error="HTTP 500: boom"),
           Result(7, 1.2, 3.9, error="RemoteProtocolError: peer closed connection")]
    s = summarize(4, ok + [chunked] + bad, max_tokens=8)
    assert (s["requests"], s["errors"]) == (5, 3)
    # wall: from the first start (0.0) to the last end (request 7: 1.2 + 3.9 = 5.1)
    assert s["wall_s"] == pytest.approx(5.1)
    assert s["output_tokens"] == 4 * 8 + 3
    assert s["output_tokens_per_s"] == pytest.approx(35 / 5.1)
    assert s["requests_per_s"] == pytest.approx(5 / 5.1)
    assert s["error_samples"] == [{"error": "HTTP 500: boom", "count": 2},
                                  {"error": "RemoteProtocolError: peer closed connection", "count": 1}]
    assert s["tokens_from"] == {"chunks": 1, "usage": 4}
    assert s["short_requests"] == 1  # the chunk-counted one stopped at 3 of 8
    assert s["ttft_s"]["p50"] == pytest.approx(0.25) and s["ttft_s"]["n"] == 5
    assert s["itl_s"]["n"] == 4 * 7 + 2
    assert s["tpot_s"]["p50"] == pytest.approx((2.0 - 0.25) / 7)
    assert s["prompt_tokens_mean"] == 32
