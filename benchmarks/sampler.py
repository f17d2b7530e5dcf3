"""Time per Sampler call for B=16, V=151936 in the main configurations; prints JSON."""
import json
import time

import torch

from engine.sampling import Sampler, SamplingParams, SamplingState

B, V, ITERS = 16, 151936, 30


def llm_like_logits(g):
    # [B, V]: a few dozen plausible tokens well above a long flat tail, like a real LM head
    x = torch.randn(B, V, generator=g) * 2
    for r in range(B):
        idx = torch.randint(0, V, (40,), generator=g)
        x[r, idx] += 10 + torch.randn(40, generator=g) * 2
    return x


def bench(name, params, logits_fn, history=256):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (512,), generator=g).tolist()
    states = [SamplingState(params, prompt, [151643, 151645], V) for _ in range(B)]
    for s in states:
        for t in torch.randint(0, V, (history,), generator=g).tolist():
            s.append(t)
    batches = [logits_fn(g) for _ in range(ITERS + 3)]
    sampler = Sampler()
    for x in batches[:3]:
        sampler(x, states)
    times = []
    for x in batches[3:]:
        t0 = time.perf_counter()
        sampler(x, states)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"case": name, "median_ms": round(times[len(times) // 2] * 1e3, 3), "min_ms": round(times[0] * 1e3, 3)}


flat = lambda g: torch.randn(B, V, generator=g) * 3
pen = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)
cases = [
    ("greedy fast path", SamplingParams(temperature=0), flat),
    ("greedy + penalties", SamplingParams(temperature=0, **pen), flat),
    ("greedy + logprobs=5", SamplingParams(temperature=0, logprobs=5), flat),
    ("full: T=0.7 top_k=50 top_p=0.9 min_p=0.05 + penalties", SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, **pen), flat),
    ("full, seeded (per-row generators)", SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=1, **pen), flat),
    ("top_p=0.9 only, LLM-like logits (nucleus < 256)", SamplingParams(temperature=0.7, top_p=0.9, **pen), llm_like_logits),
    ("top_p=0.9 only, flat logits (full-sort fallback)", SamplingParams(temperature=0.7, top_p=0.9), flat),
    ("temperature only (full-vocab draw)", SamplingParams(temperature=0.8), flat),
]
if __name__ == "__main__":
    with torch.inference_mode():
        results = [bench(*c) for c in cases]
    print(json.dumps({"B": B, "V": V, "threads": torch.get_num_threads(), "results": results}, indent=1))
