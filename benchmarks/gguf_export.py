"""The llama.cpp peer of benchmarks/engine.py: a Hugging Face checkpoint exported to a bf16 GGUF file
(tests/ggufs.py: matrices copied bit-exactly as BF16, 1-D tensors widened to F32, as llama.cpp's converter does)
and driven with llama-cpp-python. Needs `llama-cpp-python` to run; benchmarks only, never the project.

Run: python benchmarks/gguf_export.py MODEL_DIR OUT.gguf   (validates it too when llama_cpp is installed)
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploykit.modelconfig import read_dir  # noqa: E402
from tests.ggufs import export_gguf  # noqa: E402 - the same writer the GGUF tests use


def ensure_gguf(model_dir: str, name: str = "model-bf16.gguf") -> tuple[str, dict]:
    """(path, validation) of the GGUF beside model_dir's weights, exported when missing or older than config.json."""
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path) or os.path.getmtime(path) < os.path.getmtime(os.path.join(model_dir, "config.json")):
        print(f"exporting {path} ...", file=sys.stderr)
        export_gguf(model_dir, path)
    return path, {"logits": check_logits(path, model_dir), "tokenizer": check_tokenizer(path, model_dir)}


# llama.cpp's file types (llama_ftype) for the quantized copies the benchmarks compare on.
FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def ensure_quantized(bf16_gguf: str, ftype: str) -> str:
    """llama.cpp's own quantization of a bf16 GGUF (llama_model_quantize, as its llama-quantize tool), made once next
    to it as <name>-<ftype>.gguf."""
    import llama_cpp
    out = bf16_gguf.replace("-bf16.gguf", "") .removesuffix(".gguf") + f"-{ftype}.gguf"
    if os.path.isfile(out) and os.path.getmtime(out) >= os.path.getmtime(bf16_gguf):
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = os.cpu_count() or 1
    print(f"quantizing {bf16_gguf} -> {out} ({ftype}) with llama.cpp ...", file=sys.stderr)
    if llama_cpp.llama_model_quantize(bf16_gguf.encode(), (out + ".partial").encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {ftype}")
    os.replace(out + ".partial", out)
    return out


def _last_logits(llm) -> np.ndarray:
    # Llama.scores is only filled with logits_all=True (which computes logits for every prompt token).
    import llama_cpp
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))  # [V]


def check_logits(gguf_path: str, model_dir: str, n: int = 16) -> dict:
    """Last-position logits of a fixed prompt: llama.cpp on the GGUF vs transformers in fp32 on the safetensors.
    A wrong tensor mapping, rotary style or norm gives a correlation near 0; bf16 rounding alone about 0.9999."""
    import llama_cpp
    from transformers import AutoModelForCausalLM
    ids = [3 + 7919 * i % (read_dir(model_dir).vocab_size - 3) for i in range(n)]
    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref = model(torch.tensor([ids])).logits[0, -1].double().numpy()
    del model
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=64, n_batch=n, verbose=False)
    llm.eval(ids)
    got = _last_logits(llm).astype(np.float64)
    llm.close()
    gap = np.diff(np.sort(ref)[-2:])[0]
    return {"prompt_tokens": n, "correlation_vs_fp32": round(float(np.corrcoef(ref, got)[0, 1]), 6),
            "max_abs_diff": round(float(np.abs(ref - got).max()), 4), "fp32_logit_std": round(float(ref.std()), 4),
            "fp32_top1_top2_gap": round(float(gap), 4), "argmax_equal": int(ref.argmax()) == int(got.argmax())}


def check_tokenizer(gguf_path: str, model_dir: str) -> dict:
    """Token ids llama.cpp's tokenizer (built from the GGUF's vocabulary, merges and pre-tokenizer) gives for the
    tiny-model corpus, against ours. The benchmark feeds token ids, so this checks the export, not the speed."""
    import llama_cpp
    from tokenizers import Tokenizer

    from engine.tinymodel import CORPUS
    llm = llama_cpp.Llama(model_path=gguf_path, vocab_only=True, verbose=False)
    ours = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    same = [llm.tokenize(t.encode(), add_bos=False, special=True) == ours.encode(t, add_special_tokens=False).ids
            for t in CORPUS]
    return {"texts": len(same), "identical_ids": sum(same),
            "differing": [t for t, ok in zip(CORPUS, same, strict=True) if not ok]}


class LlamaCppRunner:
    """One llama.cpp context; generate() mirrors the other frameworks' benchmark workers (greedy, token ids in)."""

    def __init__(self, gguf_path: str, threads: int, n_ctx: int, n_batch: int):
        import llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        self.info = {"llama_cpp_python": llama_cpp.__version__,
                     "system_info": llama_cpp.llama_print_system_info().decode().strip()}

    def _argmax(self) -> int:
        return int(np.argmax(_last_logits(self.llm)))

    def generate(self, prompts: list[list[int]], tokens: int) -> dict:
        (ids,) = prompts  # the high-level Llama object runs one sequence
        llm = self.llm
        llm.reset()  # eval() then drops the whole KV cache before the prompt
        t0 = time.perf_counter()
        llm.eval(ids)
        seq = [self._argmax()]
        first = time.perf_counter()
        while len(seq) < tokens:
            llm.eval(seq[-1:])
            seq.append(self._argmax())
        return {"ttft_s": first - t0, "decode_s": time.perf_counter() - first, "tokens": [seq]}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python benchmarks/gguf_export.py MODEL_DIR OUT.gguf")
    print(export_gguf(sys.argv[1], sys.argv[2]))
    try:
        print(json.dumps({"logits": check_logits(sys.argv[2], sys.argv[1]),
                          "tokenizer": check_tokenizer(sys.argv[2], sys.argv[1])}))
    except ImportError:
        print("llama_cpp is not installed: the export is not validated", file=sys.stderr)
