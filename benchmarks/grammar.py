"""What grammar-constrained decoding costs per step, on the real model (SmolLM2-135M-Instruct, 49152-token vocabulary);
prints JSON. Baselines are measured in the same run.

Run: flock /tmp/deploykit-heavy.lock python benchmarks/grammar.py [--rows 8] [--tokens 48] [--rounds 3]

1. The sampler alone: one Sampler call over [rows, V] logits with 0, 1 and all rows under a JSON Schema (the matchers
   advance along real JSON documents), split into llguidance's mask computation per row and our unpack + mask.
2. End to end: EngineCore decode steps of `rows` concurrent requests on the model, unconstrained vs every request
   under the schema vs half of them; ms per step (prefill excluded) and the overhead against unconstrained.
All at temperature 0.7, top-k 50, top-p 0.9 (the masked path; greedy unconstrained rows would take the argmax fast
path, and top-p alone over random logits would sort the whole vocabulary and hide everything else).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "engines", "poetry", "notes"],
            "address": {"city": "London", "zip": "12345"}}


def _cpu() -> str:
    from deploykit.isa import cpu_model
    return cpu_model() or platform.processor()


def sampler_costs(model: str, rows: int, rounds: int) -> dict:
    import torch

    from engine import grammar
    from engine import tokenizer as tokenizers
    from engine.grammar import Grammars
    from engine.sampling import Sampler, SamplingParams, SamplingState, apply_grammars

    tok = tokenizers.load(model)
    vocab = len(tok)
    eos = [tok.eos_token_id]
    grammars = Grammars(model, vocab, eos)
    started = time.perf_counter()
    grammars.tokenizer()
    build_s = time.perf_counter() - started
    doc = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    g = grammar.json_schema(SCHEMA)
    started = time.perf_counter()
    grammars.matcher(g)
    compile_ms = (time.perf_counter() - started) * 1e3
    free = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_tokens=None)
    tied = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_tokens=None, grammar=g)
    sampler = Sampler()
    gen = torch.Generator().manual_seed(0)
    out = {"vocab": vocab, "tokenizer_index_s": round(build_s, 3), "schema_compile_ms": round(compile_ms, 3)}

    def states(constrained: int) -> list[SamplingState]:
        return [SamplingState(tied if i < constrained else free, [1, 2, 3], eos, vocab, grammars) for i in range(rows)]

    for constrained in (0, 1, rows):
        times, masks = [], []
        for _ in range(rounds):
            ss = states(constrained)
            for t in doc[:-1]:  # every step of a real document: the matchers walk it token by token
                x = torch.randn(rows, vocab, generator=gen)
                t0 = time.perf_counter()
                sampler(x, ss)
                times.append(time.perf_counter() - t0)
                for s in ss[:constrained]:
                    t1 = time.perf_counter()
                    s.matcher.bitmask()
                    masks.append(time.perf_counter() - t1)
                for s in ss:
                    s.append(t)
        out[f"sampler_ms_{constrained}_of_{rows}_constrained"] = round(median(times) * 1e3, 3)
        if masks:
            out[f"mask_compute_us_per_row_{constrained}_rows"] = round(median(masks) * 1e6, 1)
    # our part: unpack the bitmask and mask the logits, per constrained row
    ss = states(rows)
    x = torch.randn(rows, vocab)
    t0 = time.perf_counter()
    for _ in range(50):
        apply_grammars(x, ss)
    whole_us = (time.perf_counter() - t0) / 50 / rows * 1e6
    out["apply_us_per_row_incl_mask"] = round(whole_us, 1)
    out["unpack_and_mask_us_per_row"] = round(whole_us - out[f"mask_compute_us_per_row_{rows}_rows"], 1)
    return out


def engine_costs(model: str, rows: int, tokens: int, rounds: int) -> dict:
    import torch

    from engine import grammar
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.params import SamplingParams

    core = EngineCore(EngineConfig(model, max_model_len=1024, max_num_seqs=rows))
    # at least 64 items: no request's document can end before `tokens`, so every step is a full batch
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"},
                                                         "minItems": 64}},
              "required": ["items"], "additionalProperties": False}
    g = grammar.json_schema(schema)
    kw = {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "max_tokens": tokens, "ignore_eos": True, "seed": 1}
    free, tied = SamplingParams(**kw), SamplingParams(**kw, grammar=g)
    prompt = list(range(100, 164))
    core.add_request("warm", prompt, tied)
    while core.has_unfinished_requests():
        core.step()

    def run(constrained: int, r: int) -> tuple[float, int]:
        for i in range(rows):
            core.add_request(f"{constrained}-{r}-{i}", prompt, tied if i < constrained else free)
        steps, t_decode, first = 0, 0.0, True
        with torch.inference_mode():
            while core.has_unfinished_requests():
                t0 = time.perf_counter()
                outs = core.step()
                dt = time.perf_counter() - t0
                if len(outs) == rows and not first:  # decode steps of all rows (the prefill step excluded)
                    steps, t_decode = steps + 1, t_decode + dt
                first = first and len(outs) < rows
        return t_decode, steps

    res: dict[int, list[float]] = {0: [], rows // 2: [], rows: []}
    for r in range(rounds):  # alternate configurations: a noisy neighbour hits all of them alike
        for constrained in res:
            wall, steps = run(constrained, r)
            if steps:
                res[constrained].append(wall / steps * 1e3)
    base = min(res[0])
    out = {f"decode_ms_per_step_{c}_of_{rows}_constrained": round(min(v), 2) for c, v in res.items() if v}
    for c, v in res.items():
        if c and v:
            out[f"overhead_pct_{c}_of_{rows}_constrained"] = round((min(v) / base - 1) * 100, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="a .gguf or model directory (default: the test suite's SmolLM2)")
    a = ap.parse_args()
    import torch
    from tests.models import smollm2_gguf
    model = a.model or str(smollm2_gguf())
    from deploykit import isa
    flags = isa.cpu_flags()
    print(json.dumps({"cpu": _cpu(), "isa": sorted(f for f in flags if f.startswith(("avx512", "amx"))),
                      "threads": torch.get_num_threads(), "model": Path(model).name, "rows": a.rows,
                      "sampler": sampler_costs(model, a.rows, a.rounds),
                      "engine": engine_costs(model, a.rows, a.tokens, a.rounds)}, indent=1))


if __name__ == "__main__":
    main()
