"""The llama.cpp peer of benchmarks/engine.py: export a Qwen2 Hugging Face checkpoint to a bf16 GGUF file and drive
it with llama-cpp-python. Needs `gguf` (and `llama-cpp-python` to run it); benchmarks only, never the project.

Run: python benchmarks/gguf_export.py MODEL_DIR OUT.gguf   (validates it too when llama_cpp is installed)

Matrices are copied bit-exactly as BF16; 1-D tensors (norms, biases) are widened to F32 (exact), which is what
llama.cpp's own converter writes. Qwen2 uses NEOX-style rotary embeddings in llama.cpp, the same half-split
rotation as Hugging Face, so unlike Llama no q/k row permutation is needed.
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

from engine.loader import CheckpointReader, load_spec

# Our tokenizers pre-tokenize with ByteLevel(use_regex=True): the GPT-2 split pattern, llama.cpp's "gpt-2".
PRE_TOKENIZER = "gpt-2"


def _tokens(model_dir: str, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(token strings by id, gguf TokenType by id, "a b" merges) from tokenizer.json; ids the tokenizer does not
    use (embedding rows past its vocabulary) become UNUSED placeholders so the list matches the embedding."""
    import gguf

    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers are exported, got {model.get('type')!r}")
    tokens: list[str | None] = [None] * vocab_size
    types = [int(gguf.TokenType.UNUSED)] * vocab_size
    for text, i in model["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = text, int(gguf.TokenType.NORMAL)
    for added in tok.get("added_tokens", []):
        i = added["id"]
        if i < vocab_size:
            tokens[i] = added["content"]
            types[i] = int(gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED)
    names = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return names, types, merges


def _numpy(t: torch.Tensor) -> tuple[np.ndarray, object]:
    """(array, raw gguf dtype or None): 2-D bf16 stays bf16 as raw uint16 bits; everything else becomes F32."""
    import gguf

    if t.dim() >= 2 and t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    return t.float().contiguous().numpy(), None


def export_gguf(model_dir: str, out_path: str) -> str:
    """Write model_dir (a Qwen2 HF directory with tokenizer.json) to out_path as a bf16 GGUF; returns out_path."""
    import gguf

    spec = load_spec(model_dir)
    if spec.model_type != "qwen2":
        raise ValueError(f"only qwen2 checkpoints are exported (Llama needs q/k permutation), got {spec.model_type!r}")
    if spec.rope_scaling is not None:
        raise ValueError(f"rope scaling {spec.rope_scaling} is not exported")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2]
    tmp = out_path + ".tmp"
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name(os.path.basename(os.path.normpath(model_dir)))
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_block_count(spec.num_layers)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)

    tokens, types, merges = _tokens(model_dir, spec.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if isinstance(cfg.get("bos_token_id"), int):
        w.add_bos_token_id(cfg["bos_token_id"])
    if spec.eos_token_ids:
        w.add_eos_token_id(spec.eos_token_ids[0])
    if isinstance(cfg.get("pad_token_id"), int):
        w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)  # Qwen2 prompts carry no BOS
    template = Path(model_dir, "chat_template.jinja")
    if template.is_file():
        w.add_chat_template(template.read_text())

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, spec.num_layers)
    reader = CheckpointReader(model_dir)
    for hf_name in sorted(reader.names()):
        if hf_name == "lm_head.weight" and spec.tie_word_embeddings:
            continue  # llama.cpp reuses token_embd when output.weight is absent
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name!r}")
        data, raw = _numpy(reader.get(hf_name))
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader.close()
    os.replace(tmp, out_path)  # a killed export never leaves a truncated file under the final name
    return out_path


def ensure_gguf(model_dir: str, name: str = "model-bf16.gguf") -> tuple[str, dict]:
    """(path, validation) of the GGUF beside model_dir's weights, exported when missing or older than config.json."""
    path = os.path.join(model_dir, name)
    if not os.path.isfile(path) or os.path.getmtime(path) < os.path.getmtime(os.path.join(model_dir, "config.json")):
        print(f"exporting {path} ...", file=sys.stderr)
        export_gguf(model_dir, path)
    return path, {"logits": check_logits(path, model_dir), "tokenizer": check_tokenizer(path, model_dir)}


def _last_logits(llm) -> np.ndarray:
    # Llama.scores is only filled with logits_all=True (which computes logits for every prompt token).
    import llama_cpp
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))  # [V]


def check_logits(gguf_path: str, model_dir: str, n: int = 16) -> dict:
    """Last-position logits of a fixed prompt: llama.cpp on the GGUF vs transformers in fp32 on the safetensors.
    A wrong tensor mapping, rotary style or norm gives a correlation near 0; bf16 rounding alone about 0.9999."""
    import llama_cpp
    from transformers import AutoModelForCausalLM
    ids = [3 + 7919 * i % (load_spec(model_dir).vocab_size - 3) for i in range(n)]
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
