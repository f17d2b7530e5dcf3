"""Native forward pass for Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 (one decoder family, config-driven)."""
from __future__ import annotations

import logging

import torch

from deploykit.modelconfig import NATIVE_ARCHITECTURES
from engine import hugepages, kernels, quant
from engine.errors import ModelLoadError
from engine.kernels import linear, prepare_bias, prepare_weight
from engine.kv_cache import KVCache
from engine.loader import ModelConfig
from engine.models.layers import (
    ACTIVATIONS,
    AttentionMetadata,
    RMSNorm,
    Rotary,
    embed_rows,
    head_norm_,
    paged_attention,
    rotate_,
    silu_and_mul,
)

log = logging.getLogger("engine")

ARCHITECTURES = NATIVE_ARCHITECTURES  # deploykit.modelconfig: the planner sizes these as this decoder holds them
MLP_ROWS = 512  # rows of a prefill's MLP at a time (LlamaModel.mlp)


class _Layer:
    """One decoder layer's weights, already fused: qkv [(Hq + 2 Hkv) * D, H], gate_up [2 I, H]."""
    __slots__ = ("ln1", "qkv", "qkv_bias", "qk_norm", "o", "o_bias", "ln2", "gate_up", "gate_up_bias", "down",
                 "down_bias")


class LlamaModel:
    """Plain tensors + functional ops; no nn.Module, so each layer is a short, fixed list of kernel calls."""
    native = True

    def __init__(self, config: ModelConfig, reader, dtype: torch.dtype, max_len: int, quantization: str = "none",
                 compact: bool = True, huge_pages: bool = True):
        if config.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"{config.source}: hidden_act {config.hidden_act!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        if config.head_dim % 2:
            raise ModelLoadError(f"{config.source}: head_dim {config.head_dim} must be even for rotary")
        self.config = config
        self.dtype = dtype
        self.act = ACTIVATIONS[config.hidden_act]
        self.act_fused = config.hidden_act in ("silu", "swish")
        self.scale = config.head_dim ** -0.5
        # Per layer: 0 = full causal attention, W = only the last W tokens (Mistral's sliding window).
        self.windows = [config.sliding_window if i in config.sliding_layers else 0 for i in range(config.num_layers)]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling, max_len, dtype,
                             config.rope_freq_factors)
        self.compact = compact  # bf16 matrices held in 12 bits each where they allow it (kernels.prepare_weight)
        held = quant.Loader(reader, dtype, quantization)
        # Every weight goes into one arena on 2 MiB pages (engine/hugepages.py) as soon as it is ready, in the order
        # a decode step reads them; the loader's copy is dropped at once, so the load peaks one layer above the
        # weights, not at twice them.
        self.arena = hugepages.Arena(held.estimate(), huge_pages)
        self._load(reader, held, self.arena.take)
        self.weight_paths = held.paths.summary()  # {type in the file: {path: tensors}}, for /debug/binding
        self.weight_bytes = held.paths.bytes
        log.info("weights: %.1f MiB held; by type in the file: %s", held.paths.bytes / 2**20, held.paths.text())
        self.pages = self.arena.placement()
        log.info("weight arena: %s", self.pages.text())
        self.step_weights = self._step_weights()  # None: small decode steps take the per-op path as well
        # The fused bf16 step takes up to 16 sequences where every matrix is quantized or runs on AMX tiles, else 4;
        # the fp32 one takes 16 whatever its matrices hold.
        matrices = [w for L in self.layers for w in (L.qkv, L.o, L.gate_up, L.down)]
        if dtype == torch.float32:
            self.step_max_rows = kernels.STEP_F32_MAX_ROWS
        else:
            wide = matrices and all(kernels.is_quantized(w) or kernels.on_tiles(w) for w in matrices)
            self.step_max_rows = kernels.STEP_MAX_TILE_ROWS if wide else kernels.STEP_MAX_ROWS
        self.step_logits_rows = self._step_logits_rows()
        # gate_up and silu * up in one pass on AMX tiles (compact weights): the same bits, no [N, 2I] intermediate.
        self.gate_up_silu = (self.act_fused and self.dtype == torch.bfloat16
                             and all(kernels.gate_up_silu_ok(L.gate_up) for L in self.layers))
        # The same for a prompt's rows on quantized weights (decode rows keep the int8 kernels).
        self.prompt_gate_up_silu = (self.act_fused and self.dtype == torch.bfloat16
                                    and all(kernels.prompt_gate_up_silu_ok(L.gate_up) for L in self.layers))
        # A prompt's whole MLP with gate_up's output handed to the down projection as tile panels (no copy into tile
        # blocks between them): the same bits as gate_up_silu, then linear.
        self.prompt_mlp = (self.act_fused and self.dtype == torch.bfloat16
                           and all(kernels.prompt_mlp_ok(L.gate_up, L.down) for L in self.layers))

    def _load(self, r, held: quant.Loader, take) -> None:
        """take(t) -> the arena's copy of t; each weight is taken once it has its final form."""
        s, dt = self.config, self.dtype

        def place(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else take(t)

        used: set[str] = set()

        def get(name: str) -> torch.Tensor:
            used.add(name)
            return held.dense(name, r.get(name).to(dt))

        def check(names: list[str], shape: tuple[int, ...], rows: int, cols: int) -> None:
            if tuple(shape) != (rows, cols):
                raise ModelLoadError(f"{s.source}: {' + '.join(names)} has shape {tuple(shape)}, the model's "
                                     f"configuration implies {(rows, cols)}; the configuration does not match the "
                                     "weights")

        def quantized(names: list[str], rows: int, cols: int, interleave: bool) -> torch.Tensor | None:
            # Held in its GGUF blocks (or quantized on load) where deploykit.quant says so: one blob for the group.
            w = held.matrix(names, interleave)
            if w is not None:
                used.update(names)
                check(names, tuple(kernels.quant_parts(w)[:2]), rows, cols)
            return w

        def bf16(names: list[str], rows: int, cols: int) -> torch.Tensor | None:
            # A bf16 checkpoint's matrices under fp32 compute stay bf16 where deploykit.memory.held_dtype says so:
            # the same values, widened in registers by the GEMM (kernels.prepare_bf16w), from half the bytes.
            if not held.widens(names):
                return None
            used.update(names)
            parts = [held.widened(n, r.get(n).to(torch.bfloat16)) for n in names]
            w = torch.cat(parts) if len(parts) > 1 else parts[0]
            check(names, w.shape, rows, cols)
            return w

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in r else None

        def fused(names: list[str], rows: int, cols: int, interleave: bool = False) -> torch.Tensor:
            # One GEMM per projection group; the parts are freed as soon as the fused copy exists. interleave: gate
            # and up, held quantized group by group (quant.pack).
            q = quantized(names, rows, cols, interleave)
            if q is not None:
                return q
            b = bf16(names, rows, cols)
            if b is not None:
                return kernels.prepare_bf16w(b)
            w = torch.cat([get(n) for n in names]) if len(names) > 1 else get(names[0])
            check(names, w.shape, rows, cols)
            p = prepare_weight(w, compact=self.compact)
            if kernels.is_compact(p):  # bf16 in 12 bits a weight, losslessly (kernels/compact_bf16.h)
                held.compacted(names, w.numel() * w.element_size(), p.numel())
            return p

        def fused_bias(names: list[str]) -> torch.Tensor | None:
            return prepare_bias(torch.cat([get(n) for n in names])) if names[0] in r else None

        hidden, inter = s.hidden_size, s.intermediate_size
        embed = ["model.embed_tokens.weight"]
        # A quantized table is looked up row by row (kernels.quant_rows) and, when tied, is the lm_head as well.
        tied = not ("lm_head.weight" in r and not s.tie_word_embeddings)
        self.embed = quantized(embed, s.vocab_size, hidden, False)
        if self.embed is None:
            self.embed = bf16(embed, s.vocab_size, hidden)  # rows widened as they are looked up
        if self.embed is None:
            self.embed = get(embed[0])
            check(embed, self.embed.shape, s.vocab_size, hidden)
        if tied and not kernels.is_quantized(self.embed):
            # Also the lm_head, packed or compact like any matrix; rows are then looked up in that copy
            # (layers.embed_rows). Made now, so the loader's copies are gone before the layers are read.
            used.add("lm_head.weight")
            widened = self.embed.dtype != dt  # bf16 under fp32 compute (bf16 above)
            lm_head = kernels.prepare_bf16w(self.embed) if widened else prepare_weight(self.embed, compact=self.compact)
            if kernels.is_compact(lm_head):
                held.compacted(embed, self.embed.numel() * self.embed.element_size(), lm_head.numel())
            relaid = lm_head is not self.embed  # the kernel relaid the table out: rows come from that copy
            self.lm_head = place(lm_head)
            self.embed = None if relaid else self.lm_head
            del lm_head
        else:  # looked up first in a step (its rows); a quantized tied table is the lm_head as well
            self.embed = place(self.embed)
            if tied:
                used.add("lm_head.weight")
                self.lm_head = self.embed
        self.layers: list[_Layer] = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
            gate_up = [p + "mlp.gate_proj", p + "mlp.up_proj"]
            L = _Layer()
            # In the order the decode step reads them (hugepages.Arena: one sequential stream).
            L.ln1 = RMSNorm(place(get(p + "input_layernorm.weight")), s.rms_norm_eps)
            L.qkv = place(fused([n + ".weight" for n in qkv], self.q_size + 2 * self.kv_size, hidden))
            L.qkv_bias = place(fused_bias([n + ".bias" for n in qkv]))
            # Qwen3 normalises each q and k head before rotary; one [Hq + Hkv, D] weight does both at once.
            qn, kn = opt(p + "self_attn.q_norm.weight"), opt(p + "self_attn.k_norm.weight")
            L.qk_norm = place(None if qn is None else torch.cat([qn.expand(s.num_heads, -1),
                                                                 kn.expand(s.num_kv_heads, -1)]))
            L.o = place(fused([p + "self_attn.o_proj.weight"], hidden, self.q_size))
            L.o_bias = place(prepare_bias(opt(p + "self_attn.o_proj.bias")))
            L.ln2 = RMSNorm(place(get(p + "post_attention_layernorm.weight")), s.rms_norm_eps)
            L.gate_up = place(fused([n + ".weight" for n in gate_up], 2 * inter, hidden, interleave=True))
            L.gate_up_bias = place(fused_bias([n + ".bias" for n in gate_up]))
            L.down = place(fused([p + "mlp.down_proj.weight"], hidden, inter))
            L.down_bias = place(prepare_bias(opt(p + "mlp.down_proj.bias")))
            self.layers.append(L)
            hugepages.trim()  # the loader's copies of this layer, freed onto the heap, go back to the system now
        self.norm = RMSNorm(place(get("model.norm.weight")), s.rms_norm_eps)
        if not tied:
            self.lm_head = place(fused(["lm_head.weight"], s.vocab_size, hidden))
        unknown = sorted(n for n in r.names() if n not in used and not n.endswith("rotary_emb.inv_freq"))
        if unknown:
            raise ModelLoadError(f"{s.source}: the checkpoint has tensors this {s.architecture} implementation does "
                                 f"not use (e.g. {', '.join(unknown[:3])}); it is an unsupported variant")

    def _step_weights(self) -> list[torch.Tensor | None] | None:
        """kernels.decode_step_'s flat weight list, or None where it cannot run: no native kernels, neither bf16 nor
        fp32, an activation other than SiLU, a head size the attention kernel lacks, weights the kernels did not pack
        (under fp32: matrices neither quantized nor bf16 packed, e.g. an fp32 checkpoint's)."""
        s = self.config
        probe = torch.empty(1, s.num_heads, s.head_dim, dtype=self.dtype)
        if not (self.act_fused and kernels.decode_step_supported(probe, s.intermediate_size)):
            return None
        weights: list[torch.Tensor | None] = []
        f32 = self.dtype == torch.float32
        for L in self.layers:
            if not all(kernels.step_f32_weight(w) if f32 else
                       kernels.is_packed(w) or kernels.is_quantized(w) or kernels.is_compact(w)
                       for w in (L.qkv, L.o, L.gate_up, L.down)):
                return None
            weights += [L.ln1.weight, L.qkv, L.qkv_bias, L.qk_norm, L.o, L.o_bias, L.ln2.weight, L.gate_up,
                        L.gate_up_bias, L.down, L.down_bias]
        return weights

    def _step_logits_rows(self) -> int:
        """The most rows the fused step takes from token ids to logits (decode_step.cpp, decode_step_f32.cpp: the
        embedding lookup, the final norm and the LM head in the same call; 0: Python runs them around it): a head the
        step reads in whole 16-row blocks (under bf16 packed, compact or quantized, past kernels.STEP_MAX_ROWS rows
        only a wide one: quantized, or on AMX tiles; under fp32 quantized or bf16 packed for widening), and a token
        table of a kind the step reads (every kind embed_rows takes under bf16; under fp32 quantized, plain fp32 or
        bf16, or packed bf16)."""
        w, t = self.lm_head, self._table()
        if self.step_weights is None or self.config.vocab_size % 16:
            return 0
        if self.dtype == torch.float32:
            plain = t.dim() == 2 and t.dtype in (torch.float32, torch.bfloat16)
            ok = kernels.step_f32_weight(w) and (kernels.is_quantized(t) or plain or kernels.step_f32_weight(t))
            return self.step_max_rows if ok else 0
        if self.dtype != torch.bfloat16 or not any(f(w) for f in (kernels.is_packed, kernels.is_quantized,
                                                                   kernels.is_compact)):
            return 0
        wide = kernels.is_quantized(w) or kernels.on_tiles(w)
        return self.step_max_rows if wide else min(self.step_max_rows, kernels.STEP_MAX_ROWS)

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
               steps: int = 1, stops: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A step of decode rows only (meta.num_decode == N: each sequence's next token) -> fp32 logits [N, V], and
        where the fused step took the batch each row's argmax int64 [1, N] (else None). steps > 1, where the fused step
        takes the batch: a run of up to that many steps, each feeding its argmax to the next (meta's block tables reach
        the last one), ended early after a step whose argmax of some row is in stops -> the last step's logits and
        the argmax of each step run [S, N] (kernels.decode_step_)."""
        n = input_ids.shape[0]
        if n > self.step_logits_rows or self.step_weights is None:  # (tests turn the step off after load)
            return self.compute_logits(self.forward(input_ids, positions, meta, kv)), None
        logits, greedy = torch.empty(n, self.config.vocab_size), torch.empty(steps, n, dtype=torch.int64)
        h = torch.empty(n, self.config.hidden_size, dtype=self.dtype)  # the step's rows, looked up from input_ids
        ran = self._step(h, positions, meta, kv, (self.norm.weight, self.lm_head, logits, input_ids, self._table(),
                                                  greedy, steps, stops))
        return logits, greedy[:ran]

    def _table(self) -> torch.Tensor:
        return self.embed if self.embed is not None else self.lm_head  # tied: the lm_head's copy (_load)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self._table(), input_ids, self.dtype)  # [N, H]

    def _step(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
              tail: tuple = ()) -> int:
        """Decode of a few sequences, the latency path: every layer in one native call, not ~25 ops per layer; h [N, H]
        becomes the last residual stream; tail: kernels.decode_step_'s (norm, lm_head, logits, ids, embed, greedy,
        steps, stops): from token ids to logits and argmax, for a run of steps. Returns the steps run."""
        s = self.config
        return kernels.decode_step_(h, self.step_weights, kv.layers, self.windows, self.rotary.cos, self.rotary.sin,
                                    positions, meta.decode_tables, meta.decode_lens, meta.slot_mapping, s.num_heads,
                                    s.num_kv_heads, s.rms_norm_eps, self.scale, *tail)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        """input_ids, positions [N] (all sequences flattened) -> final hidden states [N, H] (pre-norm)."""
        s = self.config
        n = input_ids.shape[0]
        nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
        h = self._embed(input_ids)
        if meta.num_decode == n <= self.step_max_rows and self.step_weights is not None:
            self._step(h, positions, meta, kv)
            return h
        cos, sin = self.rotary.tables(positions)                       # [N, 1, D]
        nd = meta.num_decode  # rows [nd, N) are prompt rows: kernels.linear's prompt_from
        last = len(self.layers) - 1
        x = self.layers[0].ln1(h)
        for i, L in enumerate(self.layers):
            qkv = linear(x, L.qkv, L.qkv_bias, nd).view(n, nh + 2 * nkv, hd)  # [N, Hq + 2 Hkv, D]
            qk = qkv[:, :nh + nkv]                                     # q and k heads, normed/rotated in place
            if L.qk_norm is not None:
                head_norm_(qk, L.qk_norm, s.rms_norm_eps)
            rotate_(qk, cos, sin)
            o = paged_attention(qkv[:, :nh], qkv[:, nh:].view(n, 2, nkv, hd), kv.layers[i], meta, self.scale,
                                self.windows[i])
            x = L.ln2(h, linear(o.reshape(n, nh * hd), L.o, L.o_bias, nd))        # h += o_proj; norm
            d = self.mlp(L, x, nd)
            if i < last:
                x = self.layers[i + 1].ln1(h, d)                                  # h += down_proj; next norm
            else:
                h += d
        return h

    def mlp(self, L: _Layer, x: torch.Tensor, nd: int) -> torch.Tensor:
        """x [N, H], its rows from nd on a prompt's -> down(act(gate) * up) [N, H], MLP_ROWS rows at a time. Its
        [N, 2I] intermediate is the largest tensor of a prefill (80 MB at 2,048 rows of I = 4,864 in fp32): in slices
        it stays in the L3 cache for the activation and the down projection, and under glibc's 32 MB mmap ceiling, so
        its memory is reused rather than mapped and page-faulted afresh at every layer. Where the linears are
        batch-invariant (bf16 weights under fp32, quantized weights, compact ones on AMX tiles) each row's result is
        the same in any slice; elsewhere it may differ in the last bits, as it does between any two batch sizes."""
        n = x.shape[0]
        if n > MLP_ROWS:
            d = torch.empty_like(x)
            for i in range(0, n, MLP_ROWS):
                d[i:i + MLP_ROWS] = self.mlp(L, x[i:i + MLP_ROWS], min(max(nd - i, 0), MLP_ROWS))
            return d
        if nd == 0 and n >= kernels.PANEL_MIN_M and self.prompt_mlp:
            return kernels.prompt_mlp(x, L.gate_up, L.gate_up_bias, L.down, L.down_bias)
        if self.gate_up_silu or (nd == 0 and self.prompt_gate_up_silu):
            y = kernels.gate_up_silu(x, L.gate_up, L.gate_up_bias)            # [N, I]
        elif self.act_fused:
            y = silu_and_mul(linear(x, L.gate_up, L.gate_up_bias, nd))        # [N, I]
        else:
            gate, up = linear(x, L.gate_up, L.gate_up_bias, nd).chunk(2, dim=-1)  # [N, I] each
            y = self.act(gate) * up
        return linear(y, L.down, L.down_bias, nd)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] at the positions being sampled -> logits [B, V] in fp32."""
        return kernels.logits(self.norm(hidden), self.lm_head)
