"""Architectures without a native forward pass, run through transformers' AutoModelForCausalLM (slower)."""
from __future__ import annotations

import logging

import torch

from engine.errors import ModelLoadError
from engine.loader import ModelConfig
from engine.sequence import Sequence

log = logging.getLogger("engine")


class HFCausalLM:
    """One transformers forward per sequence per step, each sequence keeping its own DynamicCache.

    The paged KV pool is not used; the block allocator still meters these caches so admission control and
    preemption behave as for native models.
    """
    native = False

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        log.info("architecture %s has no native implementation; running it through transformers "
                 "(slower: no batching across sequences)", config.architecture or config.model_type)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(config.source, dtype=dtype).eval()
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"transformers cannot load {config.source}: {e}") from e
        self.config = config
        self._caches: dict[str, tuple[object, int]] = {}   # request_id -> (cache, tokens it holds)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], counts: list[int]) -> tuple[list[Sequence], torch.Tensor]:
        sampled: list[Sequence] = []
        rows: list[torch.Tensor] = []
        for seq, n in zip(seqs, counts):
            start = seq.num_computed_tokens
            cache, held = self._caches.get(seq.request_id, (None, 0))
            if held != start:  # preempted and recomputing: the old cache no longer matches
                cache, start = None, 0
            ids = torch.tensor([seq.token_ids[start:seq.num_computed_tokens + n]])
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            self._caches[seq.request_id] = (out.past_key_values, seq.num_computed_tokens + n)
            if seq.num_computed_tokens + n == seq.num_tokens:
                sampled.append(seq)
                rows.append(out.logits[0, -1])
        logits = torch.stack(rows).float() if rows else torch.empty(0, self.config.vocab_size)
        return sampled, logits

    def release(self, seq: Sequence) -> None:
        self._caches.pop(seq.request_id, None)
