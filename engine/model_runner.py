"""Turns a scheduled batch into flat model inputs + attention metadata, runs the model, returns logits."""
from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.models.layers import PREFILL_TILE, AttentionMetadata, PrefillChunk, contiguous_blocks
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv: KVCache | None, block_size: int):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.window = (model.config.sliding_window or 0) if model.native else 0  # 0: no sliding-window layers

    def release(self, seq: Sequence) -> None:
        if not self.model.native:
            self.model.release(seq)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, stops: torch.Tensor | None = None
                ) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None]:
        """Feed every scheduled token; return the sequences that reached their last token, logits [B, V] and, where
        the fused decode step computed it, each one's argmax of each step run [S, B] (else None). A batch of
        batch.steps > 1 (decode rows only) runs as many steps as the fused step took of it (LlamaModel.decode: up to
        a step whose argmax of some row is in stops); the last step's logits."""
        if not self.model.native:
            return *self.model.run(batch.seqs, batch.num_new_tokens), None
        # Decode rows first: the attention kernel batches them in one call.
        order = sorted(zip(batch.seqs, batch.num_new_tokens), key=lambda sn: not _decodes(*sn))
        input_ids, positions, meta, sampled, rows = self._prepare(order, batch.steps)
        if meta.num_decode == len(rows) == input_ids.shape[0]:  # decode rows only, each sampled: the logits at once
            return sampled, *self.model.decode(input_ids, positions, meta, self.kv, batch.steps, stops)
        hidden = self.model.forward(input_ids, positions, meta, self.kv)     # [N, H]
        if not rows:
            return sampled, hidden[:0], None
        if len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows)]
        return sampled, self.model.compute_logits(hidden), None

    def _tile_blocks(self, table: list[int], end: int):
        """Blocks for keys up to the end of the last prefill tile: the table, padded with any blocks (those keys are
        masked). The ones after its last block when they exist, so a contiguous table stays a view."""
        pad = -(-(-(-end // PREFILL_TILE) * PREFILL_TILE) // self.block_size) - len(table)
        after = table[-1] + 1
        extra = list(range(after, after + pad)) if after + pad <= self.kv.layers[0].shape[0] else table[:1] * pad
        return contiguous_blocks(table + extra)

    def _prepare(self, order: list[tuple[Sequence, int]], steps: int = 1):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        dec_tables: list[list[int]] = []
        dec_ctx: list[int] = []
        prefills: list[PrefillChunk] = []
        sampled: list[Sequence] = []
        rows: list[int] = []
        for seq, n in order:
            c, bt, end = seq.num_computed_tokens, seq.block_table, seq.num_computed_tokens + n
            row = len(ids)
            ids += seq.token_ids[c:end]
            pos += range(c, end)
            slots += [bt[p // bs] * bs + p % bs for p in range(c, end)]
            nblocks = -(-end // bs)
            if _decodes(seq, n):
                dec_tables.append(bt[:-(-(end + steps - 1) // bs)])  # to the last step of a run
                dec_ctx.append(end)
            else:
                prefills.append(PrefillChunk(row, n, c, self._tile_blocks(bt[:nblocks], end)))
            if end == seq.num_tokens:
                sampled.append(seq)
                rows.append(row + n - 1)
        tables = lens = None
        if dec_tables:
            width = max(len(t) for t in dec_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.int32)  # [B, W]
            lens = torch.tensor(dec_ctx, dtype=torch.int32)                                             # [B]
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode=len(dec_tables), decode_tables=tables,
                                 decode_lens=lens, prefills=prefills, block_size=bs, window=self.window,
                                 mask_dtype=self.model.dtype)
        return torch.tensor(ids), torch.tensor(pos), meta, sampled, rows


def _decodes(seq: Sequence, n: int) -> bool:
    """One generated token, the decode path. A prompt's last token alone in its chunk (chunked prefill, or a prefix
    hit ending one token short) is prefill: the decode attention kernel rounds differently from the prefill tiles,
    so computing it there would make a prompt's tokens depend on where its chunks or its cached prefix end."""
    return n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
