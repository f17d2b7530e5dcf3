"""Tiny random-weight HF models, generated once per test session (no downloads)."""
from __future__ import annotations

import pytest
import torch

from engine import vml
from engine.tinymodel import make_tiny_model

# transformers' references run in this process, some before any EngineCore: settle oneMKL VML's dispatch first
# (engine/vml.py), so a reference is the same bits in every session.
vml.resolve()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **make_tiny_model kwargs) -> model directory, cached per distinct arguments."""
    cache: dict[tuple, str] = {}

    def make(arch: str = "llama", **kwargs) -> str:
        key = (arch, repr(sorted(kwargs.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = make_tiny_model(str(out), arch, **kwargs)
        return cache[key]

    return make


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt (one at a time: no padding effects)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, attention_mask=torch.ones(1, len(p),
                                                                                          dtype=torch.long))
            out.append(ids[0, len(p):].tolist())
    return out


def _run_core(core, requests: list[tuple[str, list[int], object]], join_after: int = 0) -> dict[str, list[int]]:
    """Drive an EngineCore to completion; requests past the first half join after `join_after` steps."""
    half = len(requests) // 2 if join_after else len(requests)
    for rid, prompt, params in requests[:half]:
        core.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    steps = 0
    while core.has_unfinished_requests() or steps <= join_after:
        if steps == join_after:
            for rid, prompt, params in requests[half:]:
                core.add_request(rid, prompt, params)
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
    return tokens


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


@pytest.fixture(scope="session")
def run_core():
    return _run_core


def record_logits(core) -> list[torch.Tensor]:
    """The logits of every step of `core` from now on, as its sampler gets them (a copy each: the sampler may
    overwrite them), whichever call made them: compute_logits, or the fused decode step with its LM head."""
    logits: list[torch.Tensor] = []
    sample = core.sampler
    core.sampler = lambda x, states, *argmax: logits.append(x.clone()) or sample(x, states, *argmax)
    return logits


def next_token_logprobs(core, prompts: list[list[int]], top: int = 8) -> dict:
    """Each prompt's first generated position through `core`: {prompt index: its top `top` (token, logprob)}."""
    from engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=top)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    out = {}
    while core.has_unfinished_requests():
        for o in core.step():
            out[int(o.request_id)] = o.logprobs[0]
    return out


def native_supported(full: bool = True, quantized: bool = True) -> bool:
    """This CPU runs one of the native kernel builds and the run has not switched them off: then the native paths
    must be tested, never skipped, and a build that fails fails those tests (tests/engine/test_kernels.py). full:
    an AVX-512 build (every native op); else any build, the AVX2 one included, that runs quantized weights (or, with
    quantized=False, any build at all: each holds the fp32 ops)."""
    import os

    from deploykit import isa
    from engine.kernels import loader
    if os.environ.get("DEPLOYKIT_KERNELS", "").lower() in loader.DISABLED:
        return False  # the PyTorch path on purpose
    flags = isa.cpu_flags()
    variant = loader.variant_for(flags)
    if full:
        return variant in isa.FULL_VARIANTS
    return variant is not None and (isa.quantized_kernels(flags) or not quantized)


def attention_reference(q, kv, tables, lens, scale, window=0):
    """fp64 softmax(q k^T * scale) v per sequence, gathering each token's K/V through its block table (only the
    last `window` tokens when window > 0)."""
    bs, group = kv.shape[1], q.shape[1] // kv.shape[3]
    out = []
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window) if window else 0
        ctx = torch.stack([kv[tables[b, t // bs], t % bs] for t in range(first, n)]).double()  # [T, 2, Hkv, D]
        k, v = (ctx[:, i].repeat_interleave(group, dim=1) for i in (0, 1))              # [T, Hq, D]
        p = (torch.einsum("hd,thd->ht", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", p, v))
    return torch.stack(out)


NATIVE = native_supported()
QUANT_NATIVE = native_supported(full=False)  # the int8 kernels for quantized weights run here (VNNI or AVX2)
ANY_NATIVE = native_supported(full=False, quantized=False)  # some build loads here: the fp32 ops run (f32_ops.cpp)


def _loaded(supported: bool, skip: str, ready, what: str):
    """engine.kernels once `ready(module)`: built first (a no-op when built), reloaded if it was imported before the
    build finished. Skips only where the CPU runs no such build; a failed build or load fails the test."""
    import importlib

    from engine.kernels import build
    if not supported:
        pytest.skip(skip)
    try:
        build.build()
    except RuntimeError as e:
        pytest.fail(f"the native kernels do not build on this CPU:\n{e}", pytrace=False)
    import engine.kernels as k
    if not ready(k):
        k = importlib.reload(k)
    if not ready(k):
        pytest.fail(f"{what} did not load on a CPU that runs them: {k.status()}", pytrace=False)
    return k


@pytest.fixture(scope="session")
def native_kernels():
    """engine.kernels with an AVX-512 build loaded (every native op). Fails, never skips, where the CPU could run it:
    scripts/env.sh builds the kernels before the suite, so a miss here is a real fault."""
    return _loaded(NATIVE, "this CPU has no AVX-512 (or DEPLOYKIT_KERNELS switches the kernels off): no native path "
                   "here", lambda k: k.status()["path"].startswith("native"), "native kernels")


@pytest.fixture(scope="session")
def f32_kernels():
    """engine.kernels with any build loaded, so the fp32 element-wise ops and decode attention run natively (every
    build holds them)."""
    return _loaded(ANY_NATIVE, "this CPU runs no kernel build (no AVX2), or DEPLOYKIT_KERNELS switches them off",
                   lambda k: k.fused(torch.empty(1)), "the fp32 ops")


@pytest.fixture(scope="session")
def quantized_kernels():
    """engine.kernels with the int8 kernels for quantized weights loaded (AVX512-VNNI in an AVX-512 build, or the AVX2
    build)."""
    return _loaded(QUANT_NATIVE, "this CPU runs no int8 kernels (an AVX-512 CPU without VNNI, or none without AVX2), "
                   "or DEPLOYKIT_KERNELS switches them off: quantized weights are dequantized at load",
                   lambda k: k.quantized_ok(), "the int8 kernels")
