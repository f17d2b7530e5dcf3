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
    """generate() runs N prompts as N parallel sequences of one llama.cpp context, as llama-batched-bench does: each
    prompt is prefilled into its own seq_id, then every step is one llama_decode of one token per sequence (logits
    for those only) and a greedy argmax per sequence. The other frameworks' benchmark workers mirror it (greedy,
    token ids in). Low-level API: the high-level Llama object runs a single sequence."""

    def __init__(self, gguf_path: str, threads: int, n_ctx: int, n_batch: int):
        import logging

        import llama_cpp
        self.lib, self.threads, self.n_ctx, self.n_batch = llama_cpp, threads, n_ctx, n_batch
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # as Llama(verbose=False): no load log
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        # LLAMACPP_EXTRA_BUFTS=0: load without llama.cpp's extra buffer types (its weight repacks: AMX, and the
        # AVX2/AVX-512 interleaved layouts). On a CPU with AMX-INT8 its AMX buffer takes the quantized matrices, and
        # on the Q4_0 and Q4_1 files tried its first matmul segfaults (llama-cpp-python 0.3.36; upstream
        # ggml-org/llama.cpp#20824), so there it runs this way, and the JSON says so.
        params.use_extra_bufts = os.environ.get("LLAMACPP_EXTRA_BUFTS", "1") != "0"
        self.model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.contexts: dict[int, object] = {}  # sequences -> context (its KV cache has one stream per sequence)
        self.info = {"llama_cpp_python": llama_cpp.__version__, "extra_buffer_types": bool(params.use_extra_bufts),
                     "system_info": llama_cpp.llama_print_system_info().decode().strip()}

    def _context(self, n_seq: int):
        """A context for n_seq parallel sequences of up to n_ctx tokens each. kv_unified=False gives each sequence
        its own KV stream, so attention reads only that sequence's cells (llama.cpp's advice for sequences that
        share no prefix). Flash attention keeps llama.cpp's default (auto: on for this CPU backend), which
        the Llama object turns off: that cost llama.cpp 15-20 % at 16 sequences on the benchmark model."""
        if n_seq not in self.contexts:
            lib = self.lib
            if n_seq > min(self.n_batch, lib.llama_max_parallel_sequences()):  # a step's batch holds them all
                raise ValueError(f"{n_seq} sequences: at most {min(self.n_batch, lib.llama_max_parallel_sequences())}")
            p = lib.llama_context_default_params()
            p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_seq * self.n_ctx, self.n_batch, self.n_batch, n_seq
            p.n_threads = p.n_threads_batch = self.threads
            p.kv_unified, p.flash_attn_type = False, lib.LLAMA_FLASH_ATTN_TYPE_AUTO
            ctx = lib.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {n_seq} sequences")
            self.contexts[n_seq] = ctx
        return self.contexts[n_seq]

    def _decode(self, ctx, batch, rows: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """One llama_decode of rows (token, position, seq_id, wants logits); the argmax of each row that wants
        logits, by seq_id. llama_get_logits_ith takes the row's index in the batch."""
        lib = self.lib
        for i, (tok, pos, seq, out) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.logits[i] = tok, pos, out
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
        batch.n_tokens = len(rows)
        if (rc := lib.llama_decode(ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {len(rows)} tokens")
        return {seq: int(np.argmax(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))))
                for i, (_, _, seq, out) in enumerate(rows) if out}

    def generate(self, prompts: list[list[int]], tokens: int) -> dict:
        lib, n = self.lib, len(prompts)
        if any(len(p) + tokens > self.n_ctx for p in prompts):
            raise ValueError(f"a prompt plus {tokens} tokens exceeds the {self.n_ctx} positions a sequence has")
        ctx = self._context(n)
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)  # every call starts from an empty cache
        batch = lib.llama_batch_init(self.n_batch, 0, 1)  # one seq_id per token
        try:
            t0 = time.perf_counter()
            # Prefill: the prompts' tokens back to back, n_batch per llama_decode, logits at each prompt's end.
            rows = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
            nxt: dict[int, int] = {}
            for i in range(0, len(rows), self.n_batch):
                nxt.update(self._decode(ctx, batch, rows[i:i + self.n_batch]))
            seqs = [[nxt[s]] for s in range(n)]
            first = time.perf_counter()
            for step in range(tokens - 1):  # one token per sequence per llama_decode
                nxt = self._decode(ctx, batch, [(seqs[s][-1], len(p) + step, s, True) for s, p in enumerate(prompts)])
                for s in range(n):
                    seqs[s].append(nxt[s])
            return {"ttft_s": first - t0, "decode_s": time.perf_counter() - first, "tokens": seqs}
        finally:
            lib.llama_batch_free(batch)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python benchmarks/gguf_export.py MODEL_DIR OUT.gguf")
    print(export_gguf(sys.argv[1], sys.argv[2]))
    try:
        print(json.dumps({"logits": check_logits(sys.argv[2], sys.argv[1]),
                          "tokenizer": check_tokenizer(sys.argv[2], sys.argv[1])}))
    except ImportError:
        print("llama_cpp is not installed: the export is not validated", file=sys.stderr)
