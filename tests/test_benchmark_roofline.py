"""benchmarks/engine.py's roofline percentages on a host whose memory bandwidth changes regime mid-run: each round's
decode is held to that round's own probe, and the run says when its probes disagree. Likewise each round's prefill
is held to that round's matmul peak, and a quantized file's prefill to the bf16 checkpoint's in the same round."""

from __future__ import annotations

from benchmarks.engine import (PREFILL_REPEAT, jobs_for, paired_pct_peak, paired_pct_roofline, ratios, regime_note,
                               run_command, summarize)


def summary(by_round: list[float], bytes_per_token: float = 0.5e9) -> dict:
    best = max(by_round)
    return {"bandwidth_gbps": {"best": best, "by_round": by_round}, "roofline_tok_s": best * 1e9 / bytes_per_token,
            "roofline_tok_s_by_round": [g * 1e9 / bytes_per_token for g in by_round]}


def test_a_round_is_held_to_its_own_probe():
    # Round 1 in fast DRAM (60 GB/s, roofline 120 tok/s), round 2 in slow (30 GB/s, 60 tok/s). Best-of would say
    # 60 / 120 = 50 %; per round it is 50 % and 55 / 60 = 91.7 %, median 70.83 %.
    s = summary([60.0, 30.0])
    assert paired_pct_roofline(s, {"samples": [60.0, 55.0]}) == 70.83
    # Steady bandwidth: the paired figure is the plain one.
    assert paired_pct_roofline(summary([40.0, 40.0, 40.0]), {"samples": [64.0, 60.0, 56.0]}) == 75.0


def test_rounds_that_do_not_pair_give_no_figure():
    s = summary([60.0, 30.0, 45.0])
    assert paired_pct_roofline(s, {"samples": [60.0, 55.0]}) is None  # a decode round failed and was skipped
    assert paired_pct_roofline(s, None) is None
    assert paired_pct_roofline({"decode_tok_s": {}}, {"samples": [1.0]}) is None  # no probe ran


def test_a_regime_change_is_reported_and_steady_runs_are_not():
    assert regime_note(summary([52.0, 55.9, 53.3])) is None
    note = regime_note(summary([57.3, 34.1, 35.3]))
    assert note is not None and "34.1-57.3 GB/s" in note and "paired_median" in note
    assert regime_note(summary([40.0])) is None


def peak_round(seconds: dict[str, float]) -> dict:
    """One matmul_peak sample: two shapes of 1 TFLOP each, `seconds` per implementation for both."""
    return {"shapes": {shape: {"flop": 1e12, "seconds": dict(seconds)} for shape in ("qkv", "down")}}


def test_a_prefill_round_is_held_to_its_own_matmul_peak():
    # A quiet round: peak 2.0 TFLOP/s (the faster implementation), prefill 1.5 -> 75 %. A noisy round, tiles at half
    # speed: peak 1.0, prefill 0.8 -> 80 %. Best against best says 1.5 / 2.0 = 75 %; a slow round's prefill against
    # the quiet round's peak would say 40 %.
    params = 1e12 / (2 * 512)  # layer_matmul_params for which a 1 s prefill is 1 TFLOP/s
    samples = {"prefill/ours": [{"ttft_s": 1 / 1.5}, {"ttft_s": 1 / 0.8}],
               "matmul_peak": [peak_round({"a": 0.5, "b": 0.6}), peak_round({"a": 1.0, "b": 1.2})]}
    s = summarize(samples, {"layer_matmul_params": params}, 64)
    assert s["matmul_bf16_m512"]["peak_tflops_by_round"] == [2.0, 1.0]
    assert s["prefill_512"]["ours"]["tflops_by_round"] == [1.5, 0.8]
    assert paired_pct_peak(s) == 77.5
    derived, _ = ratios(s)
    assert derived["prefill_pct_peak"]["best"] == 75.0 and derived["prefill_pct_peak"]["paired_median"] == 77.5


def test_prefill_rounds_that_do_not_pair_give_no_figure():
    params = 1e12 / (2 * 512)
    samples = {"prefill/ours": [{"ttft_s": 1.0}], "matmul_peak": [peak_round({"a": 1.0}), peak_round({"a": 2.0})]}
    assert paired_pct_peak(summarize(samples, {"layer_matmul_params": params}, 64)) is None
    assert paired_pct_peak({"prefill_512": {}}) is None


def test_a_quantized_prefill_is_paired_with_the_bf16_prefill_of_its_round():
    # Round 1 quiet: Q4 1.6 TFLOP/s, bf16 1.6 -> 1.0. Round 2 noisy for both: 0.7 against 0.8 -> 0.875. Round 3:
    # 1.1 against 1.0 -> 1.1. Best against best: 1.6 / 1.6 = 1.0; paired median 1.0.
    params = 1e12 / (2 * 512)
    samples = {"prefill/ours": [{"ttft_s": 1 / 1.6}, {"ttft_s": 1 / 0.7}, {"ttft_s": 1 / 1.1}],
               "prefill/ours_bf16": [{"ttft_s": 1 / 1.6}, {"ttft_s": 1 / 0.8}, {"ttft_s": 1 / 1.0}]}
    derived, targets = ratios(summarize(samples, {"layer_matmul_params": params}, 64))
    assert derived["prefill_vs_bf16"] == {"best": 1.0, "median": 1.1, "paired_median": 1.0}
    assert targets["prefill_vs_bf16"] == {"target": 1.0, "value": 1.0, "pass": True}
    # A slower quantized prefill fails the target, by either measure.
    samples["prefill/ours"] = [{"ttft_s": 1 / 1.4}, {"ttft_s": 1 / 0.7}, {"ttft_s": 1 / 0.9}]
    derived, targets = ratios(summarize(samples, {"layer_matmul_params": params}, 64))
    assert derived["prefill_vs_bf16"]["paired_median"] == 0.875 and targets["prefill_vs_bf16"]["pass"] is False
    # A bf16 run has no such figure; a failed round leaves the paired one out.
    del samples["prefill/ours_bf16"][2]
    assert "paired_median" not in ratios(summarize(samples, {"layer_matmul_params": params}, 64))[0]["prefill_vs_bf16"]
    del samples["prefill/ours_bf16"]
    derived, targets = ratios(summarize(samples, {"layer_matmul_params": params}, 64))
    assert derived["prefill_vs_bf16"] is None and targets["prefill_vs_bf16"]["pass"] is None


def test_the_bf16_worker_runs_only_the_prefill_right_after_ours():
    names = [name for name, *_ in jobs_for(["ours", "ours_bf16", "llamacpp"], 1024, 8, 10**6)]
    assert [n for n in names if "ours_bf16" in n] == ["prefill/ours_bf16"]
    assert names[names.index("prefill/ours") + 1] == "prefill/ours_bf16"
    assert "decode_b1/llamacpp" in names and "prefill/llamacpp" in names


class Prefills:
    """A worker whose prefills take the given times in turn (the first one of a job slower, as after decode jobs)."""

    def __init__(self, times: list[float]):
        self.times, self.calls = iter(times), []

    def generate(self, prompts: list[list[int]], tokens: int) -> dict:
        self.calls.append(len(prompts[0]))
        t = next(self.times)
        return {"ttft_s": t, "decode_s": 0.0, "tokens": [[7]], "which": t}


def test_a_prefill_is_the_best_of_its_back_to_back_runs_and_the_first_is_kept():
    # The matmul peak a prefill is held to is each shape's best of 5 calls; a prefill job is the best of
    # PREFILL_REPEAT prompts in a row, and the first one's time is summarized on its own. Only prefill jobs repeat:
    # run_command keeps the run with the fastest first token, which is no way to pick a decode, a probe or a peak.
    jobs = jobs_for(["ours", "ours_bf16"], 1024, 8, 10**6)
    assert {name for name, _, _, kw in jobs if "repeat" in kw} == {"prefill/ours", "prefill/ours_bf16"}
    prefill = next(kw for name, _, _, kw in jobs if name == "prefill/ours")
    assert prefill["repeat"] == PREFILL_REPEAT == 3
    bench = Prefills([0.30, 0.22, 0.25, 0.40, 0.20, 0.21])
    first = run_command(bench, {"op": "generate", **prefill})
    second = run_command(bench, {"op": "generate", **prefill})
    assert bench.calls == [512] * 6  # every run is given the whole prompt (the workers keep no prefix between runs)
    assert first["ttft_s"] == first["which"] == 0.22 and first["ttft_s_runs"] == [0.30, 0.22, 0.25]
    assert second["ttft_s"] == 0.20 and second["ttft_s_runs"] == [0.40, 0.20, 0.21]
    # A job without `repeat` (decode, the probes) runs once and passes its result through.
    once = run_command(Prefills([0.5]), {"op": "generate", "prompts": [[1, 2]], "tokens": 4})
    assert once == {"ttft_s": 0.5, "decode_s": 0.0, "tokens": [[7]], "which": 0.5}
    params = 1e12 / (2 * 512)
    s = summarize({"prefill/ours": [first, second]}, {"layer_matmul_params": params}, 64)["prefill_512"]["ours"]
    assert s["ttft_s"]["samples"] == [0.22, 0.20]
    assert s["ttft_first_run_s"] == {"best": 0.30, "median": 0.35}
    assert s["tflops_by_round"] == [round(1 / 0.22, 3), 5.0]
