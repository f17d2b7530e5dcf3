"""What a causal LM is, torch-free: `ModelConfig`, read once from a Hugging Face config.json or a GGUF header.

The planner sizes memory from it and the engine builds its forward pass from it, so both read a checkpoint the
same way, with the same defaults (transformers' own where a key is absent) and the same validation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from . import gguf
from .errors import DeploykitError, ModelError

# The architectures the engine runs on its native decoder (engine/models/llama.py); any other runs through
# transformers, which holds every weight in the model's dtype (no quantized or bf16-held matrices).
NATIVE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# GGUF general.architecture -> the Hugging Face class whose weights and forward pass it carries.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields of a checkpoint's configuration that sizing and the forward pass need."""

    source: str  # the directory or .gguf file it was read from (for messages)
    architecture: str  # Hugging Face class name, e.g. "Qwen3ForCausalLM"
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int | None  # None: the checkpoint does not state its context length
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)  # None = plain rotary
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs: inv_freq[i] is divided by factor i
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layers that attend only to the last sliding_window tokens
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 1  # mixture-of-experts FFNs count once per expert in the parameter formula

    @property
    def kv_elements_per_token(self) -> int:
        return kv_elements_per_token(self.num_layers, self.num_kv_heads, self.head_dim)

    def count_parameters(self) -> int:
        """The parameter count implied by the shapes (when no weight file says it exactly)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2
        per_layer = attn + 3 * h * self.intermediate_size * self.num_experts + 2 * h
        return self.num_layers * per_layer + self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h


def kv_elements_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """K and V, every layer: [layers, 2, kv_heads, head_dim] elements of cache per token."""
    return layers * 2 * kv_heads * head_dim


def context_length(stated: int | None, requested: int | None, *, field: str = "max_model_len",
                   error: type[DeploykitError] = ModelError) -> int:
    """The context length a model runs with: `requested` (max_model_len) when given, else what the checkpoint
    states (max_position_embeddings); never longer than the checkpoint states. The planner and the engine both apply
    it; `field` and `error` say how the caller names the setting and which error family it raises."""
    if requested is None:
        if stated is None:
            raise error("the model does not state its context length (max_position_embeddings)", path=field,
                        hint=f"set {field}")
        return stated
    if stated is not None and requested > stated:
        raise error(f"longer than the model's context length (max_position_embeddings={stated})", path=field,
                    value=requested, allowed=f"1-{stated}", hint=f"use at most {stated}")
    return requested


def read_dir(path: str | Path) -> ModelConfig:
    """config.json (+ generation_config.json for end tokens) of a Hugging Face model directory."""
    d = Path(path)
    cfg_file = d / "config.json"
    cfg = _json(cfg_file, required=True)
    gen = _json(d / "generation_config.json", required=False)
    return from_hf(cfg, str(d), generation=gen)


def _json(path: Path, *, required: bool) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if not required:
            return {}
        raise ModelError("config.json missing in the model directory", path=str(path.parent),
                         hint="a Hugging Face model directory has config.json next to its *.safetensors "
                              "(save the model with save_pretrained)") from None
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {path.name}: {e}", path=str(path)) from None
    if not isinstance(data, dict):
        raise ModelError(f"{path.name} is not a JSON object", path=str(path))
    return data


def from_hf(cfg: dict, source: str, generation: dict | None = None) -> ModelConfig:
    """A config.json dict -> ModelConfig. Multimodal wrappers keep the language model under text_config."""
    where = f"{source}/config.json"
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    text = {**cfg, **text} if text is not cfg else cfg

    def integer(key: str, *alternatives: str, default: int | None = None) -> int | None:
        for k in (key, *alternatives):
            v = text.get(k)
            if v is not None:
                if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                        or v != int(v)):
                    raise ModelError(f"config.json lacks a usable {key!r}: {v!r} is not an integer", path=where)
                return int(v)
        return default

    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
               if text.get(k) is None]
    if missing:
        raise ModelError(f"config.json lacks a usable {missing[0]!r} (need integer num_hidden_layers, "
                         "num_attention_heads, hidden_size, vocab_size)", path=where)
    heads, hidden = integer("num_attention_heads"), integer("hidden_size")
    layers = integer("num_hidden_layers")
    sizes = {"num_hidden_layers": layers, "num_attention_heads": heads, "hidden_size": hidden,
             "vocab_size": integer("vocab_size"),
             "num_key_value_heads": integer("num_key_value_heads", default=heads),
             "head_dim": integer("head_dim", default=hidden // heads if heads else 0),
             "intermediate_size": integer("intermediate_size", "ffn_dim", default=4 * hidden),
             "max_position_embeddings": integer("max_position_embeddings", "n_positions", "seq_length"),
             "num_experts": integer("num_local_experts", "num_experts", default=1)}
    _positive(sizes, where, "config.json")
    # transformers >= 5 nests rope settings in rope_parameters; older checkpoints use rope_theta + rope_scaling.
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", text.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    window, sliding = sliding_layers(text, sizes["num_hidden_layers"])
    archs = cfg.get("architectures") or [str(cfg.get("model_type", "unknown"))]
    return ModelConfig(
        source=source, architecture=str(archs[0]), model_type=str(text.get("model_type", "")),
        vocab_size=sizes["vocab_size"], hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=sizes["num_key_value_heads"], head_dim=sizes["head_dim"],
        intermediate_size=sizes["intermediate_size"], max_position_embeddings=sizes["max_position_embeddings"],
        rms_norm_eps=float(text.get("rms_norm_eps") or 1e-6), rope_theta=theta,
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        hidden_act=str(text.get("hidden_act") or text.get("activation_function") or "silu"),
        sliding_window=window, sliding_layers=sliding,
        eos_token_ids=_eos_ids(cfg, generation or {}), num_experts=sizes["num_experts"])


def _positive(sizes: dict, where: str, what: str) -> None:
    bad = {k: v for k, v in sizes.items() if v is not None and v < 1}
    if bad:
        raise ModelError(f"{what} has non-positive sizes: {bad}", path=where,
                         hint="a causal LM needs at least one layer, head and hidden unit")
    heads, kv = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads % kv:
        raise ModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; this "
                         "attention layout is unsupported", path=where)


def _eos_ids(*sources: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for src in sources:
        eos = src.get("eos_token_id")
        for i in (eos if isinstance(eos, list) else [eos]):
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return tuple(ids)


def sliding_layers(cfg: dict, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers using it), with transformers' defaults: `layer_types` when the config lists them;
    else Qwen2-style `use_sliding_window` (absent = off) from layer `max_window_layers` on; else Mistral, whose
    every layer slides and whose window is 4096 when the key is absent (an explicit null turns it off)."""
    mistral = cfg.get("model_type") == "mistral"
    window = cfg.get("sliding_window", 4096 if mistral else None)
    if cfg.get("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        return None, ()
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif cfg.get("use_sliding_window"):
        sliding = tuple(range(int(cfg.get("max_window_layers") or 0), layers))
    else:
        sliding = tuple(range(layers)) if mistral else ()
    return (window, sliding) if sliding else (None, ())


def from_gguf(header: gguf.Header) -> ModelConfig:
    """A GGUF header -> ModelConfig, in Hugging Face terms (llama.cpp's key names mapped back)."""
    arch = header.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ModelError(f"GGUF architecture {arch!r} is not supported", path=header.path, value=arch,
                         allowed=", ".join(sorted(GGUF_ARCHITECTURES)) + " (Llama 2/3, SmolLM, Mistral, Qwen2/2.5, "
                                 "Qwen3)",
                         hint="use the model's Hugging Face safetensors checkpoint instead")
    v = header.arch_value
    names = {t.name for t in header.tensors}
    embed = header.tensor("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelError("the GGUF file has no token_embd.weight [vocab, hidden] tensor", path=header.path)
    # The embedding's rows are the vocabulary the weights have (the token list may be shorter or padded).
    vocab = v("vocab_size") or embed.shape[0]
    heads = v("attention.head_count")
    if isinstance(heads, list) or isinstance(v("attention.head_count_kv"), list):  # per-layer counts: hybrids
        raise ModelError("per-layer attention head counts are not supported", path=header.path)
    sizes = {"num_hidden_layers": v("block_count"), "num_attention_heads": heads, "hidden_size": v("embedding_length"),
             "vocab_size": vocab, "num_key_value_heads": v("attention.head_count_kv", heads),
             "intermediate_size": v("feed_forward_length"), "max_position_embeddings": v("context_length")}
    absent = [k for k, x in sizes.items() if not isinstance(x, int)]
    if absent:
        raise ModelError(f"the GGUF metadata lacks {arch}.* values for {', '.join(absent)}", path=header.path,
                         hint="re-convert the model with a current llama.cpp")
    _positive(sizes, header.path, "the GGUF header")
    sizes["head_dim"] = v("attention.key_length", sizes["hidden_size"] // sizes["num_attention_heads"])
    _positive(sizes, header.path, "the GGUF header")
    factors = None
    if "rope_freqs.weight" in names:  # llama3-style rope scaling, baked into per-frequency divisors
        factors = header.read_f32(header.tensor("rope_freqs.weight"))
    scaling = None
    if v("rope.scaling.type") == "linear" and v("rope.scaling.factor"):
        scaling = {"rope_type": "linear", "factor": float(v("rope.scaling.factor"))}
    elif v("rope.scaling.type") not in (None, "none", "linear"):
        scaling = {"rope_type": str(v("rope.scaling.type"))}  # refused by the engine with the supported list
    # End tokens: end of text, end of turn, end of message (Llama 3.1's tool calls end with <|eom_id|>).
    ends = [header.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        source=header.path, architecture=GGUF_ARCHITECTURES[arch], model_type=arch,
        vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"], num_layers=sizes["num_hidden_layers"],
        num_heads=sizes["num_attention_heads"], num_kv_heads=sizes["num_key_value_heads"],
        head_dim=sizes["head_dim"], intermediate_size=sizes["intermediate_size"],
        max_position_embeddings=sizes["max_position_embeddings"],
        rms_norm_eps=float(v("attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(v("rope.freq_base", 10000.0)),
        rope_scaling=scaling, rope_freq_factors=factors, tie_word_embeddings="output.weight" not in names,
        hidden_act="silu",
        eos_token_ids=tuple(dict.fromkeys(i for i in ends if isinstance(i, int) and not isinstance(i, bool))),
        num_experts=int(v("expert_count", 1) or 1))


def quant_types(header: gguf.Header) -> dict[str, int]:
    """{ggml type name: number of tensors stored in it}, e.g. {"Q4_1": 210, "F32": 61}."""
    out: dict[str, int] = {}
    for t in header.tensors:
        out[t.type_name] = out.get(t.type_name, 0) + 1
    return dict(sorted(out.items()))


def parameters_in(header: gguf.Header) -> int:
    """Weights the engine holds after dequantizing: every tensor but rope_freqs (not a weight)."""
    return sum(t.numel for t in header.tensors if t.name != "rope_freqs.weight")
