"""Greedy fidelity of the engine on a real model, path by path, against transformers in fp32.

The measure (random-weight models hide it, and single bf16 greedy strings flip on knife-edge prompts): take the
engine's greedy continuation of each prompt; feed prompt + continuation to the fp32 transformers reference once;
at each generated position, does the reference pick the same next token given the same prefix? The share of
positions where it does is the agreement; transformers' own bf16 generation is measured the same way.

`python -m tests.engine.fidelity MODEL TOKENS JSON_CONFIG < prompts.json` prints the engine's continuations as JSON
(run in a child process so DEPLOYKIT_KERNELS can pick the kernel build, which is chosen at import).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What does a compiler do?",
    "Name two planets in our solar system.",
    "Suggest a name for a pet goldfish.",
    "What is 12 times 7?",
    "Describe a rainbow to a child.",
    "What are the benefits of regular exercise?",
    "Write one sentence about autumn.",
    "How does a bicycle stay upright?",
]
PLAIN = [
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n",
    "The three laws of thermodynamics are",
    "Paris is the capital of France. Berlin is the capital of",
    "In 1969, the first humans",
    "import numpy as np\n\nx = np.",
    "The best way to learn a new language is",
]


def chat_ids(tokenizer, questions: list[str] = CHAT) -> list[list[int]]:
    """Each question as a one-turn chat, rendered by the model's own template, ready for the answer."""
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return [tokenizer.encode(c, add_special_tokens=False) for c in chats]


def prompt_ids(tokenizer) -> list[list[int]]:
    """8 chat prompts and 8 plain completions: the fidelity tests' mix."""
    return chat_ids(tokenizer, CHAT[:8]) + [tokenizer.encode(p) for p in PLAIN]


def lengths(n: int, tokens: int) -> list[int]:
    """Continuation lengths staggered by prompt (tokens, +2, +4, +6, ...): as sequences finish at different steps
    the decode batch shrinks through every size, so max_num_seqs=4 runs the fused step at 4, 3, 2 and 1 rows."""
    return [tokens + 2 * (i % 4) for i in range(n)]


def engine_continuations(model: str, prompts: list[list[int]], tokens: int, **config) -> dict:
    """Greedy continuations (lengths() long: end tokens ignored) with every prompt submitted at once, so
    max_num_seqs decides the decode batches and max_num_batched_tokens the prefill chunks."""
    from engine import kernels
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.params import SamplingParams

    core = EngineCore(EngineConfig(model, **config))
    for i, (p, n) in enumerate(zip(prompts, lengths(len(prompts), tokens))):
        core.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    batches = set()
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
        batches.add(sum(1 for s in core.scheduler.running if s.is_decoding))  # the next step's decode rows
    fused = getattr(core.model, "step_weights", None) is not None
    quantized = any("quantized" in p for paths in getattr(core.model, "weight_paths", {}).values() for p in paths)
    st = kernels.status()
    return {"tokens": [out[str(i)] for i in range(len(prompts))], "kernels": st["path"], "variant": st["variant"],
            "dtype": core.dtype_name, "fused_step": fused, "decode_batches": sorted(batches), "quantized": quantized,
            "weight_paths": getattr(core.model, "weight_paths", {})}


def engine_in_child(model: str, prompts: list[list[int]], tokens: int, kernels: str | None = None, **config) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DEPLOYKIT_KERNELS", None)
    if kernels:
        env["DEPLOYKIT_KERNELS"] = kernels
    done = subprocess.run([sys.executable, "-m", "tests.engine.fidelity", model, str(tokens), json.dumps(config)],
                          input=json.dumps(prompts), capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"engine child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def reference_choices(ref_model, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """The fp32 reference's argmax at every generated position, fed the same prefix, end tokens excluded (the
    continuations were generated with them banned)."""
    import torch
    eos = ref_model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or ())
    out = []
    with torch.inference_mode():
        for p, c in zip(prompts, continuations, strict=True):
            ids = torch.tensor([p + c[:-1]])
            logits = ref_model(ids).logits[0, len(p) - 1:]                       # [len(c), V]
            logits[:, eos] = float("-inf")
            out.append(logits.argmax(-1).tolist())
    return out


def agreement(ref_model, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Share of generated positions where the fp32 reference, fed the same prefix, picks the same token."""
    refs = reference_choices(ref_model, prompts, continuations)
    same = sum(a == b for c, r in zip(continuations, refs) for a, b in zip(c, r))
    return same / sum(len(c) for c in continuations)


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on a .gguf, as the reference for quantized weights: the same file, its own
    kernels. Token ids in, end tokens banned as in reference_choices."""

    def __init__(self, gguf: str, eos: list[int], threads: int = 2):
        import llama_cpp.llama_cpp as lib
        from llama_cpp import Llama

        # llama.cpp's extra buffer types repack weights at load. On an AMX CPU its AMX type takes this file's Q4_1
        # matrices, and the first prefill segfaults (llama-cpp-python 0.3.36 on a Xeon with AMX-INT8; upstream:
        # ggml-org/llama.cpp#20824, and #16315 on wrong Q4_0/Q4_1 results there). Without them it runs its plain
        # CPU kernels, as on a CPU without AMX (whose repack takes no Q4_1). Llama() has no argument for it, so its
        # defaults are patched for the one load.
        defaults = lib.llama_model_default_params

        def plain_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        lib.llama_model_default_params = plain_buffers
        try:
            self.llm = Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=threads, logits_all=True,
                             verbose=False)
        finally:
            lib.llama_model_default_params = defaults
        self.eos = eos

    def _scores(self, first: int, n: int):
        import numpy as np
        s = np.array(self.llm.scores[first:first + n])
        s[:, self.eos] = -np.inf
        return s

    def choices(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
        """llama.cpp's argmax at every generated position, fed the same prefix (teacher-forced)."""
        out = []
        for p, c in zip(prompts, continuations, strict=True):
            self.llm.reset()
            self.llm.eval(p + c[:-1])
            out.append(self._scores(len(p) - 1, len(c)).argmax(-1).tolist())
        return out

    def greedy(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        """llama.cpp's own greedy continuations (lengths() long), to measure it against the fp32 reference."""
        out = []
        for p, n in zip(prompts, lengths(len(prompts), tokens)):
            self.llm.reset()
            self.llm.eval(p)
            seq = []
            for _ in range(n):
                seq.append(int(self._scores(self.llm.n_tokens - 1, 1)[0].argmax()))
                self.llm.eval(seq[-1:])
            out.append(seq)
        return out


def share_equal(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))
    return same / sum(len(u) for u in a)


def transformers_greedy(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' own greedy generation, one prompt at a time, end tokens banned (min_new_tokens)."""
    import torch
    out = []
    with torch.inference_mode():
        for p, n in zip(prompts, lengths(len(prompts), tokens)):
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=n, min_new_tokens=n)
            out.append(ids[0, len(p):].tolist())
    return out


if __name__ == "__main__":
    result = engine_continuations(sys.argv[1], json.loads(sys.stdin.read()), int(sys.argv[2]),
                                  **json.loads(sys.argv[3]))
    print(json.dumps(result))
