"""Continuous batching: which sequences run this step and how many tokens each feeds (chunked prefill), starting
each admitted prompt after the blocks the prefix cache already holds."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_cache import BlockAllocator
from engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    seqs: list[Sequence]          # decoding sequences first, then prefill chunks
    num_new_tokens: list[int]     # tokens each sequence feeds this step
    preempted: list[Sequence]     # lost their KV this step; they recompute when readmitted
    steps: int = 1                # decode steps run at once (their blocks taken); more only where all decode

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, steps: int = 1) -> ScheduledBatch:
        """steps > 1: a run of that many decode steps at once, where every running sequence decodes, none waits that
        could start now and the blocks for the run are free (a run never preempts); else one step."""
        budget = self.max_num_batched_tokens
        admissible = self.waiting and len(self.running) < self.max_num_seqs
        if steps > 1 and (admissible or len(self.running) > budget or not all(s.is_decoding for s in self.running)
                          or sum(self.allocator.blocks_needed(s.block_table, s.num_computed_tokens + steps)
                                 for s in self.running) > self.allocator.num_free):
            steps = 1
        ahead = steps - 1  # the run's further tokens, whose K/V need slots now
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted: list[Sequence] = []
        # Decoders go first so a long prompt's chunks only take the budget they leave over.
        for seq in sorted(self.running, key=lambda s: (not s.is_decoding, s.arrival)):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            while not self.allocator.can_grow(seq.block_table, seq.num_computed_tokens + n):
                victim = max((s for s in self.running if s not in seqs), key=lambda s: s.arrival)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.allocator.grow(seq.block_table, seq.num_computed_tokens + n + ahead)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        # Admitting new work in the same step that had to evict would just evict it again next step.
        later: list[Sequence] = []  # their next prompt block is being computed this step: admitted with it cached
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]  # nothing computed: new, or preempted
            hit = self.allocator.match(seq)
            if self.allocator.in_flight(seq, hit):
                later.append(self.waiting.popleft())
                continue
            start = len(hit) * self.allocator.block_size
            n = min(seq.num_tokens - start, budget)
            if not self.allocator.can_admit(hit, start + n):
                break
            self.waiting.popleft()
            self.allocator.admit(seq, hit)
            self.allocator.grow(seq.block_table, start + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        self.waiting.extendleft(reversed(later))
        return ScheduledBatch(seqs, counts, preempted, steps)

    def computed(self, batch: ScheduledBatch, steps: int = 1) -> None:
        """The model ran the batch (steps of a run): its tokens' K/V are in the cache, and the blocks they filled
        become cacheable."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n + steps - 1
            self.allocator.commit(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.block_table)  # its full blocks stay cached: readmission may find them
        seq.num_computed_tokens = seq.num_committed_blocks = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a running or waiting sequence and give its blocks back."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.allocator.forget(seq)
        self.allocator.release(seq.block_table)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
