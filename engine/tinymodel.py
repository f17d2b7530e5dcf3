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
# Chat templates in the shapes of two model families that take tools, written for the tiny models (transformers
# renders them with trim_blocks: a newline right after a {% %} tag is dropped, so newlines follow {{ }} or text).
# "qwen3": ChatML; tools listed in the system turn; calls as <tool_call>{"name", "arguments"}</tool_call>; tool
# results as <tool_response> in a user turn; <think> reasoning, skipped when enable_thinking is false.
_ARGS = "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
QWEN3_TEMPLATE = (
    "{% set sys = messages[0].role == 'system' %}"
    "{% if tools %}<|im_start|>system\n{% if sys %}{{ messages[0].content }}{{ '\n\n' }}{% endif %}"
    "# Tools\nTo call functions, answer with one block per call:\n<tool_call>\n"
    '{"name": "the function\'s name", "arguments": {"parameter": "value"}}\n</tool_call>\n'
    "Functions:\n<tools>{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools><|im_end|>\n"
    "{% elif sys %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>{{ '\n\n' }}{% endif %}"
    "{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}"
    "{% if not loop.first or message.content %}{{ '\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ f.name }}", "arguments": ' + _ARGS + "}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{{ '\n\n' }}{% endif %}{% endif %}"
)
# "llama3": Llama 3.1's headers; tools listed in the system turn; a call is a bare JSON object
# {"name", "parameters"} (several joined by "; "); tool results in an "ipython" turn.
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% set sys = messages[0].role == 'system' %}"
    "{% if sys or tools %}<|start_header_id|>system<|end_header_id|>\n\n{% if sys %}{{ messages[0].content }}"
    "{% endif %}{% if tools %}{% if sys %}{{ '\n\n' }}{% endif %}To call functions, answer with only JSON objects "
    '{"name": the function\'s name, "parameters": its arguments}, separated by "; ". Functions:'
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{% endif %}<|eot_id|>{% endif %}"
    "{% for message in messages %}{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for call in message.tool_calls %}{% set f = call.function if call.function is defined else call %}"
    '{% if not loop.first %}; {% endif %}{"name": "{{ f.name }}", "parameters": ' + _ARGS + "}"
    "{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# template name -> (template, extra special tokens, extra plain tokens, end-of-turn tokens)
TEMPLATES = {
    "chatml": (CHAT_TEMPLATE, (), (), ("<|im_end|>",)),
    "qwen3": (QWEN3_TEMPLATE, (), ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                   "</tool_response>"), ("<|im_end|>",)),
    "llama3": (LLAMA3_TEMPLATE, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                 "<|eom_id|>", "<|python_tag|>"), (), ("<|eot_id|>", "<|eom_id|>")),
}
ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "opt": "opt"}


def train_tokenizer(vocab_size: int = 1024, chat_template: str = "chatml"):
    """Byte-level BPE over CORPUS: every UTF-8 byte is a token, so any text (CJK, emoji) encodes. The chat
    template's own tokens come after the trained ones."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, special, plain, ends = TEMPLATES[chat_template]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS + special),
                                  min_frequency=1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if plain:  # like Qwen's <think> and <tool_call>: one token each, yet kept when special tokens are skipped
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token=ends[0],
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = template
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
                    init_std: float = 0.02, extra_config: dict | None = None, chat_template: str = "chatml") -> str:
    """Write a deterministic random-weight model to out_dir and return it. Never downloads anything."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if chat_template not in TEMPLATES:
        raise ValueError(f"chat_template must be one of {sorted(TEMPLATES)}, got {chat_template!r}")
    tokenizer = train_tokenizer(chat_template=chat_template)
    vocab = len(tokenizer)
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ends = tokenizer.convert_tokens_to_ids(list(TEMPLATES[chat_template][3]))
    ids = {"bos_token_id": endoftext, "eos_token_id": ends[0], "pad_token_id": endoftext}
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
    model.generation_config = GenerationConfig(bos_token_id=endoftext, eos_token_id=[*ends, endoftext],
                                               pad_token_id=endoftext)
    os.makedirs(out_dir, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    tokenizer.save_pretrained(out_dir)
    for name in os.listdir(out_dir):  # weights are written through a 0600 temp file; containers run as another UID
        os.chmod(os.path.join(out_dir, name), 0o644)
    return out_dir
