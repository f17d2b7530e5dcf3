"""Paged KV cache: per-layer K/V block pools preallocated from a byte budget, and the block allocator, which shares
full blocks between requests by content (prefix caching) and keeps them after their last user until evicted."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from engine import hugepages
from engine.sequence import SeqStatus

# The hash chain's root. Within one engine a block's K/V are a function of every token up to its end (weights, dtype
# and rotary are fixed at start-up), so chaining each block's tokens onto its parent's hash is the whole key.
ROOT_HASH = b"deploykit-kv-v1"


def extend_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, upto: int) -> list[bytes]:
    """Extend `hashes` (one per full block, in order) to the first `upto` blocks of `token_ids`:
    hash_i = sha256(hash_{i-1} || token ids of block i). A cryptographic hash, because a collision would hand one
    request another's K/V (Python's hash() of ints can be forced to collide by whoever writes the prompts)."""
    for i in range(len(hashes), upto):
        parent = hashes[i - 1] if i else ROOT_HASH
        block = array("I", token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(hashlib.sha256(parent + block.tobytes()).digest())
    return hashes


class BlockAllocator:
    """Fixed-size token blocks handed to sequences' block tables, with reference counts.

    A block is active (referenced by a running sequence), cached (unreferenced, but holding the K/V of a known token
    prefix: a later request starting with that prefix takes it instead of recomputing), or free. Cached blocks count
    as free for admission: taking a new block evicts the least recently released cached one, so the cache never
    costs a request its room. Only full blocks computed by prefill are cached (`commit`), and a sequence never writes
    into one again, so shared blocks are read-only."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # unreferenced, no content; pop() hands out low ids first
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced with content, least recently released first
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._computing: dict[bytes, object] = {}  # hash of a prompt block -> the running Sequence computing it
        self.queries = 0  # prompt tokens looked up at admission (a preempted request's readmission counts again)
        self.hits = 0  # of those, tokens found cached

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get: free plus cached (evicted on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_active(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        """Share of blocks referenced by sequences (cached blocks are reclaimable, so they do not count)."""
        return self.num_active / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a table needs to hold num_tokens tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        n = self.blocks_needed(block_table, num_tokens)
        if n > self.num_free:
            raise RuntimeError("KV cache exhausted; the scheduler must check can_grow first")
        block_table.extend(self._take_free() for _ in range(n))

    def _take_free(self) -> int:
        if self._free:
            b = self._free.pop()
        else:  # evict the least recently released cached block
            b, _ = self._lru.popitem(last=False)
            del self._by_hash[self._hash[b]]
            self._hash[b] = None
        self._refs[b] = 1
        return b

    def release(self, block_table: list[int]) -> None:
        """Drop one reference to each block. Last block first: a sequence's tail is the least likely to be asked for
        again, so it is evicted before its prefix."""
        for b in reversed(block_table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)
        block_table.clear()

    # ---- prefix caching ----
    def _limit(self, seq) -> int:
        """Leading blocks of seq's tokens a hit may cover. At least its last two tokens are left to compute: the last
        one's logits are needed, and with two the row sampled from goes through prefill attention, as it would
        without the cache."""
        return max(0, (seq.num_tokens - 2) // self.block_size) if self.prefix_caching else 0

    def match(self, seq) -> list[int]:
        """Cached blocks holding the start of seq's tokens (an engine.sequence.Sequence with nothing computed)."""
        limit = self._limit(seq)
        hit: list[int] = []
        for h in extend_hashes(seq.block_hashes, seq.token_ids, self.block_size, limit)[:limit]:
            b = self._by_hash.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def in_flight(self, seq, hit: list[int]) -> bool:
        """Whether the first block seq would compute after `hit` (from match) is being computed by another running
        sequence right now: waiting a step for it beats computing it twice (n > 1, a burst of chats that share a
        system prompt)."""
        i = len(hit)
        owner = self._computing.get(seq.block_hashes[i]) if i < self._limit(seq) else None
        if owner is None or owner is seq:
            return False
        if owner.status is not SeqStatus.RUNNING:  # preempted or finished before committing it
            del self._computing[seq.block_hashes[i]]
            return False
        return True

    def can_admit(self, hit: list[int], num_tokens: int) -> bool:
        """Whether a sequence taking the cached blocks `hit` can grow to num_tokens: a hit block nobody references
        is no longer free once taken. Anything that fits without the cache fits with it."""
        revived = sum(1 for b in hit if self._refs[b] == 0)
        return -(-num_tokens // self.block_size) - len(hit) <= self.num_free - revived

    def admit(self, seq, hit: list[int]) -> None:
        """Start seq's block table with the cached blocks `hit`: their tokens count as computed."""
        for b in hit:
            if self._refs[b] == 0:
                del self._lru[b]
            self._refs[b] += 1
        seq.block_table[:] = hit
        seq.num_committed_blocks = len(hit)
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_prefill_tokens = seq.num_tokens
        if self.prefix_caching:
            self.queries += seq.num_tokens
            self.hits += seq.num_computed_tokens
            for h in seq.block_hashes[len(hit):self._limit(seq)]:  # what it computes that others could wait for
                if h not in self._by_hash:
                    self._computing.setdefault(h, seq)

    def commit(self, seq) -> None:
        """Offer seq's blocks whose tokens are now all computed by prefill to later requests. When another sequence
        cached the same content first, this copy stays private and is freed, not cached, when released.

        Blocks filled while decoding are not offered: decode computes K/V with other kernels than prefill (the fused
        bf16 step, matrix-vector products), so they differ in the last bits from what a prefill of the same tokens
        gives, and reusing them would change a later prompt's tokens (measured: a second chat turn on SmolLM2 in
        bf16). Prefill results depend on a token's position alone (see layers.PREFILL_TILE), so outputs with the
        cache on are the same tokens as with it off. A chat's next turn prefills the reply once; the turn after reuses
        it."""
        full = min(seq.num_computed_tokens, seq.num_prefill_tokens) // self.block_size
        if not self.prefix_caching or full <= seq.num_committed_blocks:
            return
        hashes = extend_hashes(seq.block_hashes, seq.token_ids, self.block_size, full)
        for i in range(seq.num_committed_blocks, full):
            b, h = seq.block_table[i], hashes[i]
            if self._hash[b] is None and h not in self._by_hash:
                self._hash[b] = h
                self._by_hash[h] = b
            if self._computing.get(h) is seq:
                del self._computing[h]
        seq.num_committed_blocks = full

    def forget(self, seq) -> None:
        """seq finished or was aborted: blocks it meant to compute are no longer promised to anyone waiting."""
        for h in seq.block_hashes[seq.num_committed_blocks:]:
            if self._computing.get(h) is seq:
                del self._computing[h]

    def check(self) -> None:
        """Assert the bookkeeping is consistent (tests): every block is exactly one of active, cached, free."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free) and not free & lru
        for b in range(self.num_blocks):
            assert (self._refs[b] > 0) + (b in free) + (b in lru) == 1, b
            assert (b in lru) <= (self._hash[b] is not None) and (b in free) <= (self._hash[b] is None), b
        assert all(self._hash[b] == h for h, b in self._by_hash.items())
        assert len(self._by_hash) == sum(h is not None for h in self._hash)


class KVCache:
    """One pool per layer, [num_blocks, block_size, 2 (K, V), num_kv_heads, head_dim]: a token's K and V are
    adjacent, so one copy writes both and one row per block gathers both."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, huge_pages: bool = True):
        shape = (num_layers, num_blocks, block_size, 2, num_kv_heads, head_dim)
        # On 2 MiB pages like the weights (engine/hugepages.py). Zeroed, not empty: padded attention reads unused
        # blocks under a mask, and 0 * NaN garbage would be NaN; zeroed now, so the whole pool is resident from the
        # start and a memory limit too small for it fails at start, not under load.
        self._pool = hugepages.empty(shape, dtype, huge_pages).zero_()
        self.layers = list(self._pool.unbind(0))
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return self._pool.numel() * self._pool.element_size()
