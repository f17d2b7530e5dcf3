"""Which sweep candidate is best: the objective, the TTFT SLO, and levels with errors or cut short by Ctrl-C."""
from __future__ import annotations

from deploykit.bench.sweep import Objective


def doc(*levels) -> dict:
    return {"settings": {"concurrency": [c for c, *_ in levels]},
            "levels": [{"concurrency": c, "requests": 8, "errors": errors, "output_tokens_per_s": tps,
                        "ttft_s": {"p99": ttft}, "interrupted": False} for c, tps, ttft, errors in levels]}


WIDE = doc((1, 40.0, 0.2, 0), (16, 150.0, 3.0, 0))  # one big replica: more throughput, slow first tokens at 16
SPLIT = doc((1, 30.0, 0.3, 0), (16, 120.0, 1.0, 0))


def test_throughput_takes_the_best_level_and_an_slo_excludes_the_levels_that_miss_it():
    assert Objective("throughput").score(WIDE) == 150.0
    assert Objective("throughput", slo_ttft_ms=2000).score(WIDE) == 40.0  # c=16 misses the SLO
    assert Objective("throughput", slo_ttft_ms=2000).score(SPLIT) == 120.0
    assert Objective("throughput", slo_ttft_ms=100).score(SPLIT) is None


def test_latency_is_the_p99_ttft_at_the_highest_concurrency():
    assert Objective("latency").score(SPLIT) > Objective("latency").score(WIDE)
    assert Objective("latency", slo_ttft_ms=2000).score(WIDE) is None


def test_levels_with_errors_or_interrupted_do_not_count():
    failing = doc((1, 40.0, 0.2, 0), (16, 500.0, 0.5, 3))
    assert Objective("throughput").score(failing) == 40.0
    cut = doc((1, 40.0, 0.2, 0))
    cut["levels"][0]["interrupted"] = True
    assert Objective("throughput").score(cut) is None and Objective("throughput").score(None) is None
