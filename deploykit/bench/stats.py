"""Numbers from raw request results: percentiles, throughput and errors per concurrency level.

Pure functions over `client.Result`s (no I/O), so a level can be summarised while it runs (Ctrl-C) or after.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

QUANTILES = (50, 90, 99)
ERROR_SAMPLES = 5  # distinct error messages kept per level, each with its count


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile by linear interpolation between closest ranks (numpy's default), None when empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def distribution(values: Sequence[float]) -> dict:
    """{"p50", "p90", "p99", "mean", "n"} in the values' unit (seconds here)."""
    out = {f"p{q}": percentile(values, q) for q in QUANTILES}
    out["mean"] = sum(values) / len(values) if values else None
    out["n"] = len(values)
    return out


def summarize(concurrency: int, results: Iterable, *, max_tokens: int, interrupted: bool = False) -> dict:
    """One concurrency level. Throughput counts the output tokens of successful requests over the level's wall
    time (first request sent to last answer finished); failed requests count as errors, with samples."""
    results = list(results)
    ok = [r for r in results if r.error is None]
    bad = [r for r in results if r.error is not None]
    wall = max((r.start + r.e2e for r in results), default=0.0) - min((r.start for r in results), default=0.0)
    tokens = sum(r.output_tokens for r in ok)
    counted = Counter(r.counted for r in ok)
    decode = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "errors": len(bad),
        "error_samples": [{"error": e, "count": n} for e, n in Counter(r.error for r in bad).most_common(ERROR_SAMPLES)],
        "interrupted": interrupted,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        # where the token counts came from: the usage chunk, or counting content chunks (when a server sends none)
        "tokens_from": dict(sorted(counted.items())),
        "short_requests": sum(r.output_tokens < max_tokens for r in ok),  # stopped before max_tokens (EOS, stop)
        "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": distribution([gap for r in ok for gap in r.itl]),
        "tpot_s": distribution(decode),  # time per output token after the first, per request
        "e2e_s": distribution([r.e2e for r in ok]),
    }
