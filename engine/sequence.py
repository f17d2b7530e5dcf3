"""One request's token-level state inside the engine core: tokens, progress through the KV cache, block table."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]                 # prompt followed by every accepted output token
    num_prompt_tokens: int
    max_tokens: int                      # output budget, already resolved against max_model_len
    sampling: Any                        # engine.sampling.SamplingState
    arrival: int                         # admission order; the newest running sequence is preempted first
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0         # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache key of each full block of token_ids
    num_committed_blocks: int = 0        # leading blocks of block_table already offered to the prefix cache
    num_prefill_tokens: int = 0          # tokens at (re)admission: their K/V come from prefill, the rest from decode
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed through the model; 1 while decoding, more during (re)prefill."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed == 1
