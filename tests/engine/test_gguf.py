"""GGUF files as a model source, on generated models: every tensor dequantizes to what transformers' own GGUF loader
gives, a file serves exactly like the checkpoint it was written from, the tokenizer comes from the file (converted
once into the cache, nothing written next to it), and what cannot load says what can."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import ModelLoadError
from engine.gguf_weights import SUPPORTED, GGUFCheckpoint
from engine.loader import load_config
from engine.sampling import SamplingParams
from tests.ggufs import QUANTS, export_gguf

PROMPTS = [[5, 17, 99, 300, 12, 7], [40, 41, 42], list(range(100, 160))]


@pytest.fixture(scope="module")
def ggufs(tiny_model, tmp_path_factory):
    """(arch, quant) -> .gguf written from a generated model; and the models themselves."""
    out = tmp_path_factory.mktemp("gguf")
    cache: dict = {}

    def get(arch: str, quant: str = "F32", **kwargs) -> tuple[str, str]:
        key = (arch, quant, repr(sorted(kwargs.items())))
        if key not in cache:
            model = tiny_model(arch, **kwargs)
            cache[key] = (model, export_gguf(model, str(out / f"{arch}-{quant}-{len(cache)}.gguf"), quant))
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quant", QUANTS)
def test_every_tensor_dequantizes_as_transformers_loads_it(ggufs, arch, quant):
    """transformers' GGUF loader is an independent mapping (names, Llama's q/k un-permute, tied embeddings)."""
    from transformers import AutoModelForCausalLM
    _, path = ggufs(arch, quant)
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32).state_dict()
    ours = GGUFCheckpoint(load_config(path))
    assert sorted(ours.names()) == sorted(ref)
    for name in ours.names():
        assert torch.equal(ours.get(name), ref[name]), name


def _run(model: str, prompts=PROMPTS, tokens: int = 12) -> tuple[list[list[int]], torch.Tensor]:
    core = EngineCore(EngineConfig(model, dtype="float32", max_model_len=256, max_num_seqs=4))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    lps = []
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
            lps += [lp.logprob for lp in o.logprobs]
    return [out[str(i)] for i in range(len(prompts))], torch.tensor(lps)


@pytest.mark.parametrize("arch, kwargs", [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {}),
                                          ("llama", {"rope_scaling": "llama3"})],
                         ids=["llama", "qwen2-tied", "qwen3", "llama3-rope"])
def test_a_gguf_serves_like_the_checkpoint_it_was_written_from(ggufs, arch, kwargs):
    """F32 export: the same weights, so the same tokens and logprobs (llama3 rope scaling travels as llama.cpp's
    rope_freqs divisors, a different computation of the same frequencies: equal to fp32 rounding)."""
    model, path = ggufs(arch, "F32", **kwargs)
    a, b = load_config(model), load_config(path)
    for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings"):
        assert getattr(a, field) == pytest.approx(getattr(b, field)), field
    assert b.eos_token_ids == a.eos_token_ids[:1]  # GGUF stores one end token (and an optional end-of-turn)
    want_tokens, want_lp = _run(model)
    got_tokens, got_lp = _run(path)
    assert got_tokens == want_tokens
    if kwargs.get("rope_scaling"):
        assert b.rope_freq_factors is not None and max(b.rope_freq_factors) > 1
        torch.testing.assert_close(got_lp, want_lp, atol=2e-5, rtol=0)
    else:
        assert torch.equal(got_lp, want_lp)


# ggml k-quant block layouts: (type name, bytes per block, offsets of the fp16 scales in a block)
K_QUANTS = [("Q2_K", 84, (80, 82)), ("Q3_K", 110, (108,)), ("Q4_K", 144, (0, 2)), ("Q5_K", 176, (0, 2)),
            ("Q6_K", 210, (208,))]


@pytest.mark.parametrize("name, block_bytes, halves", K_QUANTS, ids=[k[0] for k in K_QUANTS])
def test_k_quants_dequantize_like_an_independent_implementation(tmp_path, name, block_bytes, halves):
    """No quantizer for k-quants ships in Python, so the blocks are random bytes with sane fp16 scales; gguf's numpy
    dequantizer (what the engine loads with) must agree with transformers' torch one, through our row layout."""
    import gguf
    from transformers.integrations.gguf import dequant

    rng = np.random.default_rng(7)
    hidden, inter = 64, 512  # a k-quant row holds whole 256-element blocks
    raw = rng.integers(0, 256, size=(hidden, inter // 256, block_bytes), dtype=np.uint8)
    for off in halves:  # random bytes there could be inf/NaN scales
        scales = rng.uniform(0.001, 0.05, size=(hidden, inter // 256, 1)).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8)
    qtype = getattr(gguf.GGMLQuantizationType, name)
    path = str(tmp_path / f"k-{name}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("context_length", 128), ("embedding_length", hidden),
                       ("feed_forward_length", inter)):
        w.add_uint32(f"llama.{key}", value)
    w.add_uint32("llama.attention.head_count", 4)
    w.add_tensor("token_embd.weight", rng.standard_normal((32, hidden), dtype=np.float32))
    w.add_tensor("blk.0.ffn_down.weight", raw.reshape(hidden, -1), raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    got = GGUFCheckpoint(load_config(path)).get("model.layers.0.mlp.down_proj.weight")
    want = dequant.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype)).reshape(hidden, inter)
    assert got.shape == (hidden, inter) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert name in SUPPORTED


def test_the_tokenizer_comes_from_the_file_and_nothing_is_written_beside_it(ggufs, tmp_path, monkeypatch):
    from engine import tokenizer as tokenizers
    model, path = ggufs("qwen2", "Q8_0")
    alone = tmp_path / "readonly"
    alone.mkdir()
    gguf_file = str(shutil.copy(path, alone / "model.gguf"))
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "cache"))
    before = sorted(os.listdir(alone))
    tok = tokenizers.load(gguf_file)
    assert sorted(os.listdir(alone)) == before  # nothing next to the user's file
    converted = tokenizers.gguf_tokenizer_dir(gguf_file)
    assert converted.startswith(str(tmp_path / "cache")) and tokenizers.file_sha256(gguf_file)[:32] in converted
    ref = tokenizers.load(model)
    for text in ("Hello, world!", "Café 日本語 🚀", "<|im_start|>user\nhi<|im_end|>"):
        assert tok.encode(text) == ref.encode(text)
    assert tok.chat_template == ref.chat_template
    # reused: the front end never converts twice, and a torch-free process converts in a child process
    mtime = os.path.getmtime(converted)
    code = ("import sys; from engine import tokenizer as t; t.load(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'the front end must stay torch-free'")
    subprocess.run([sys.executable, "-c", code, gguf_file], check=True, env={**os.environ})
    assert os.path.getmtime(converted) == mtime


def test_unsupported_files_say_what_is_supported(tmp_path, ggufs):
    import gguf

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_config(str(not_gguf))
    _, path = ggufs("llama", "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(path, "rb").read()[: os.path.getsize(path) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_config(str(cut))
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_uint32("gpt2.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelLoadError, match=r"(?s)'gpt2' is not supported.*llama, qwen2, qwen3"):
        load_config(str(tmp_path / "gpt2.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 64), ("attention.head_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.uint8).reshape(8, 32)[:, :18],
                 raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelLoadError, match=r"IQ4_NL cannot be loaded; supported GGUF types: F32, F16, BF16"):
        GGUFCheckpoint(load_config(str(tmp_path / "iq.gguf")))
