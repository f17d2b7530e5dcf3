"""Random-weight Hugging Face model directories (config, safetensors, BPE tokenizer) for tests and benchmarks."""
from __future__ import annotations

import os

import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny language model used for testing.",
    "Once upon a time there was a small engine that could generate text.",
    "Large language models predict the next token given the previous tokens.",
    "Continuous batching lets new requests join while others are decoding.",
    "The key-value cache stores attention keys and values for every layer.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    '{"name": "deploykit", "version": 1, "cpus": [0, 1]}',
    "Numbers like 3.14159, 2.71828 and 1.41421 appear in mathematics.",
    "The weather today is sunny with a chance of rain in the evening.",
    "Please summarize the following paragraph in one sentence.",
    "User: What is the meaning of life?\nAssistant: Forty-two, according to some.",
    "Café, naïve, résumé, façade and jalapeño carry accents.",
    "Über, schön, Straße and Grüße are German words.",
    "¿Dónde está la biblioteca? ¡Muy bien!",
    "日本語のテキストも少し含まれています。",
    "机器学习模型在中央处理器上运行。",
    "한국어 문장도 하나 있습니다.",
    "Привет, как дела? Всё хорошо.",
    "Emoji: 🚀 launch, 🎉 party, 👍 ok, 🤖 robot, ❤️ love.",
    "Math symbols: ∑ ∫ √ ≈ ≠ ≤ ≥ π ∞ and arrows → ← ↑ ↓.",
    "Tabs\tand\nnewlines\r\nare whitespace too.",
    "A stitch in time saves nine; actions speak louder than words.",
    "The server streams tokens back to the client as they are generated.",
    "CPU inference benefits from bfloat16 matrix multiplication units.",
    "Memory bandwidth limits the speed of single-sequence decoding.",
    "Every request has a prompt, sampling parameters and a stop condition.",
    "Green, blue, red, yellow, purple, orange, black and white.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.",
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "opt": "opt"}


def train_tokenizer(vocab_size: int = 1024):
    """Byte-level BPE over CORPUS: every UTF-8 byte is a token, so any text (CJK, emoji) encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(arch: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
            max_pos: int, tie: bool, rope_scaling: str | None, head_dim: int | None, ids: dict):
    from transformers import AutoConfig

    if arch == "opt":
        return AutoConfig.for_model("opt", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=heads, ffn_dim=intermediate, word_embed_proj_dim=hidden,
                                    max_position_embeddings=max_pos, tie_word_embeddings=True, **ids)
    rope: dict = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling == "llama3":
        # original_max_position_embeddings is small so tiny head dims span all three llama3 frequency bands.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    elif rope_scaling is not None:
        raise ValueError(f"rope_scaling must be None or 'llama3', got {rope_scaling!r}")
    extra = {"head_dim": head_dim or hidden // heads}
    if arch == "mistral":
        extra["sliding_window"] = None
    return AutoConfig.for_model(ARCHS[arch], vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv_heads,
                                intermediate_size=intermediate, max_position_embeddings=max_pos,
                                tie_word_embeddings=tie, rope_parameters=rope, **extra, **ids)


def make_tiny_model(out_dir: str, arch: str = "llama", *, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 128, head_dim: int | None = None, seed: int = 0,
                    dtype: str = "float32", max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                    rope_scaling: str | None = None, max_shard_size: str | int | None = None,
                    init_std: float = 0.02, extra_config: dict | None = None) -> str:
    """Write a deterministic random-weight model to out_dir and return it. Never downloads anything."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    tokenizer = train_tokenizer()
    vocab = len(tokenizer)
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    ids = {"bos_token_id": endoftext, "eos_token_id": im_end, "pad_token_id": endoftext}
    cfg = _config(arch, vocab, hidden, layers, heads, kv_heads, intermediate, max_position_embeddings,
                  tie_word_embeddings, rope_scaling, head_dim, ids)
    cfg.initializer_range = init_std
    for key, value in (extra_config or {}).items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():
        # transformers initialises biases to 0 and norm weights to 1; randomise them so a loader that drops or
        # swaps them produces different tokens.
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, init_std)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    model.generation_config = GenerationConfig(bos_token_id=endoftext, eos_token_id=[im_end, endoftext],
                                               pad_token_id=endoftext)
    os.makedirs(out_dir, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    tokenizer.save_pretrained(out_dir)
    for name in os.listdir(out_dir):  # weights are written through a 0600 temp file; containers run as another UID
        os.chmod(os.path.join(out_dir, name), 0o644)
    return out_dir
