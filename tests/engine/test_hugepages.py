"""Weights and the KV cache on 2 MiB pages (engine/hugepages.py): where the host's transparent hugepages allow it, the
engine's weights get huge pages without THP_MEM_ALLOC_ENABLE, every weight is moved there in the order a decode step
reads it, and moving them changes no result (fp32 and bf16, plain and quantized)."""
from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploykit import hostsettings
from engine import hugepages, kernels
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams
from tests.engine.conftest import NATIVE, QUANT_NATIVE, _run_core

ROOT = Path(__file__).resolve().parents[2]
HUGE = hugepages.HUGE
THP = hostsettings.thp_mode()
needs_thp = pytest.mark.skipif(THP not in ("always", "madvise"), reason=f"transparent hugepages are {THP} here")


def test_an_allocation_is_2mib_aligned_zeroed_and_exactly_sized():
    t = hugepages.allocate(5 * HUGE + 100)
    assert t.dtype == torch.uint8 and t.numel() == 5 * HUGE + 100
    assert t.data_ptr() % HUGE == 0
    assert int(t.max()) == 0  # anonymous memory: the KV cache relies on it for masked reads of unused blocks
    t[-1] = 7
    assert int(t[-1]) == 7
    e = hugepages.empty((3, 4, 5), torch.bfloat16)
    assert e.shape == (3, 4, 5) and e.dtype == torch.bfloat16 and e.is_contiguous()


@needs_thp
def test_memory_that_asks_gets_2mib_pages_and_memory_that_does_not_stays_on_4kib():
    asked = hugepages.allocate(16 * HUGE + HUGE // 2)
    asked.fill_(1)
    # Most of it: a host short of free 2 MiB blocks may hand out a few 4 KiB pages instead. The last half page does
    # not ask (khugepaged would fill it out to 2 MiB later: resident memory growing under load).
    assert 8 * HUGE <= hugepages.huge_bytes(asked) <= 16 * HUGE
    if THP == "madvise":  # under "always" every aligned mapping may get them, asked or not
        plain = hugepages.allocate(16 * HUGE, huge=False)
        plain.fill_(1)
        assert hugepages.huge_bytes(plain) == 0


def test_the_arena_keeps_values_shapes_and_cache_line_alignment_and_grows_past_its_estimate():
    tensors = [torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.uint8), torch.randn(2, 2),
               torch.randn(4, 6).t()]  # a transposed view: copied as its values, contiguous
    arena = hugepages.Arena(hugepages.Arena.size(tensors))
    taken = [arena.take(t) for t in tensors]
    for m, t in zip(taken, tensors):
        assert m.dtype == t.dtype and m.shape == t.shape and m.is_contiguous() and torch.equal(m, t)
        assert m.data_ptr() % hugepages.ALIGN == 0 and arena.holds(m)
    assert len(arena.chunks) == 1 and [m.data_ptr() for m in taken] == sorted(m.data_ptr() for m in taken)
    # An estimate that falls short (a loader's guess) costs a second mapping, not a failed load.
    big = torch.randn(1000)
    extra = arena.take(big)
    assert len(arena.chunks) == 2 and torch.equal(extra, big) and arena.holds(extra)
    assert arena.used == hugepages.Arena.size(tensors + [big])
    assert all(torch.equal(m, t) for m, t in zip(taken, tensors))
    assert not arena.holds(big)


@needs_thp
def test_a_closed_arena_keeps_only_whole_pages_of_weights_on_huge_pages():
    # The arena is sized from an estimate (an upper bound), so the page the last weight half fills asked as well; its
    # huge page, if the first touch got one, is split and the rest of it freed when the arena closes (allocate's rule).
    arena = hugepages.Arena(8 * HUGE)
    w = torch.arange(3 * HUGE // 2, dtype=torch.int32).to(torch.uint8)  # 1.5 pages
    v = arena.take(w)
    pages = arena.placement()
    assert pages.bytes == w.numel() and pages.huge_bytes <= HUGE and torch.equal(v, w)


def test_a_placement_names_its_share_and_why_it_is_low():
    assert "100 % of it on 2 MiB pages" in hugepages.Placement(4 * HUGE, 4 * HUGE, "madvise", True).text()
    never = hugepages.Placement(4 * HUGE, 0, "never", True).text()
    assert "0 % of it" in never and "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled" in never
    assert "turned off" in hugepages.Placement(4 * HUGE, 0, "madvise", False).text()
    assert "less than one 2 MiB page" in hugepages.Placement(HUGE - 64, 0, "madvise", True).text()
    # the partial last page does not ask, so it is not counted as missing
    assert "fewer" not in hugepages.Placement(4 * HUGE + HUGE // 2, 4 * HUGE, "madvise", True).text()


def _greedy(model_dir: str, dtype: str, huge: bool) -> tuple[list[list[int]], EngineCore]:
    core = EngineCore(EngineConfig(model_dir, dtype=dtype, max_model_len=128, huge_pages=huge))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = _run_core(core, [("0", [5, 9, 200, 31, 7], greedy), ("1", list(range(40, 60)), greedy)])
    return [out["0"], out["1"]], core


def _arena_tensors(model) -> list[torch.Tensor]:
    return [t for L in model.layers for t in (L.ln1.weight, L.qkv, L.qkv_bias, L.o, L.ln2.weight, L.gate_up, L.down)
            if t is not None] + [model.norm.weight, model.lm_head]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_model_on_2mib_pages_answers_token_for_token_as_on_4kib(tiny_model, dtype):
    if dtype == "bfloat16" and not NATIVE:
        pytest.skip("bf16 runs only where the CPU has the native kernels")
    model_dir = tiny_model("qwen2", hidden=256, intermediate=1024, layers=4)  # 6-17 MB of weights: 2 MiB pages
    tokens, core = _greedy(model_dir, dtype, True)
    ref_tokens, ref_core = _greedy(model_dir, dtype, False)
    assert tokens == ref_tokens
    pages, model = core.model.pages, core.model
    assert len(model.arena.chunks) == 1  # the loader's estimate held every weight: one mapping, one stream
    assert pages.asked and not ref_core.model.pages.asked
    # Every weight the decode step reads sits in the arena, one after another in the order it reads them.
    ptrs = [t.data_ptr() for t in _arena_tensors(model)]
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < pages.bytes
    if THP in ("always", "madvise"):
        assert pages.bytes > 3 * HUGE and pages.share > 0.5, pages.text()
        assert hugepages.huge_bytes(core.runner.kv._pool) > 0  # the KV cache asked as well
    if THP == "madvise":
        assert ref_core.model.pages.huge_bytes == 0


@pytest.mark.skipif(not QUANT_NATIVE, reason="quantized blobs run only where the CPU runs the int8 kernels")
def test_a_quantized_model_on_2mib_pages_answers_as_on_4kib(tiny_model, quantized_kernels):
    model_dir = tiny_model("llama")
    for quantization in ("q4_0", "q8_0"):
        cores = [EngineCore(EngineConfig(model_dir, dtype="bfloat16", max_model_len=128, quantization=quantization,
                                         huge_pages=huge)) for huge in (True, False)]
        assert all(kernels.is_quantized(c.model.layers[0].qkv) for c in cores)
        assert all(len(c.model.arena.chunks) == 1 for c in cores)  # the loader's estimate held every blob
        x = torch.randn(3, cores[0].model_config.hidden_size).bfloat16()
        got, want = (kernels.linear(x, c.model.layers[0].gate_up) for c in cores)
        assert torch.equal(got, want)
        greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        got, want = (_run_core(c, [("a", [3, 14, 15, 92, 65], greedy)]) for c in cores)
        assert got == want


_PEAK = """
import json, re, sys, threading, time
import torch
from engine.loader import load_config, open_checkpoint
from engine.models.llama import LlamaModel

def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

config = load_config(sys.argv[1])
reader = open_checkpoint(config)
base, peak, done = anon(), [0], threading.Event()

def sample():  # anonymous memory only: the checkpoint's mapped file pages are page cache a container can reclaim
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.0005)

threading.Thread(target=sample, daemon=True).start()
model = LlamaModel(config, reader, getattr(torch, sys.argv[2]), 128)
time.sleep(0.01)
done.set()
print(json.dumps({"base": base, "peak": max(peak[0], anon()), "after": anon(), "held": model.weight_bytes,
                  "arena": model.pages.bytes, "mappings": len(model.arena.chunks)}))
"""


TCMALLOC = ctypes.util.find_library("tcmalloc_minimal")  # the engine image preloads it (images/Dockerfile.j2)


@pytest.mark.parametrize(("dtype", "allocator", "tied"), [("float32", "glibc", False), ("bfloat16", "glibc", True),
                                                         ("float32", "tcmalloc", True),
                                                         ("bfloat16", "tcmalloc", False)])
def test_loading_a_model_peaks_near_its_weights_not_at_twice_them(tiny_model, dtype, allocator, tied):
    """A container's memory limit is sized from the weights (deploykit.planner.container_limit): the load must not
    hold a second copy of the model while it moves the weights onto 2 MiB pages, nor keep one afterwards. Under
    tcmalloc, which the engine image preloads, memory freed during the load stays resident (malloc_trim is glibc's)."""
    if dtype == "bfloat16" and not NATIVE:
        pytest.skip("bf16 runs only where the CPU has the native kernels")
    if allocator == "tcmalloc" and not TCMALLOC:
        pytest.skip("libtcmalloc_minimal is not installed (apt-get install libtcmalloc-minimal4)")
    env = {**os.environ, "LD_PRELOAD": TCMALLOC} if allocator == "tcmalloc" else None
    # One layer: 1/24 of the weights; a tied table is packed (or compacted) as the lm_head.
    model_dir = tiny_model("qwen2", hidden=256, intermediate=1024, layers=24, tie_word_embeddings=tied)
    out = subprocess.run([sys.executable, "-c", _PEAK, model_dir, dtype], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env, check=True)
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["arena"] >= r["held"] > 10 * 2**20 and r["mappings"] == 1, r
    # Weights plus a few layers' worth of loader copies and allocator slack (moving a loaded model: 2x and more).
    assert r["peak"] - r["base"] <= 1.3 * r["held"] + 8 * 2**20, r
    assert r["after"] - r["base"] <= 1.2 * r["held"] + 8 * 2**20, r


def test_a_tied_embedding_stays_one_tensor_in_the_arena(tiny_model):
    model_dir = tiny_model("qwen2", tie_word_embeddings=True)
    tokens, core = _greedy(model_dir, "float32", True)
    assert tokens == _greedy(model_dir, "float32", False)[0]
    m = core.model
    table = m.embed if m.embed is not None else m.lm_head
    assert m.arena.holds(m.lm_head) and m.arena.holds(table)
    if m.embed is not None:
        assert m.embed is m.lm_head  # looked up and multiplied from the same copy, not two
