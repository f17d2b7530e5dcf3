"""Paged KV cache: per-layer K/V block pools preallocated from a byte budget, and the block allocator."""
from __future__ import annotations

import torch


class BlockAllocator:
    """Free list of fixed-size token blocks; sequences own a block table of indices into the pools."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low indices first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a table needs to hold num_tokens tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        n = self.blocks_needed(block_table, num_tokens)
        if n > len(self._free):
            raise RuntimeError("KV cache exhausted; the scheduler must check can_grow first")
        block_table.extend(self._free.pop() for _ in range(n))

    def release(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()


class KVCache:
    """One pool per layer, [num_blocks, block_size, 2 (K, V), num_kv_heads, head_dim]: a token's K and V are
    adjacent, so one copy writes both and one row per block gathers both."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        shape = (num_layers, num_blocks, block_size, 2, num_kv_heads, head_dim)
        # Zeroed, not empty: padded attention reads unused blocks under a mask, and 0 * NaN garbage would be NaN.
        self._pool = torch.zeros(shape, dtype=dtype)
        self.layers = list(self._pool.unbind(0))
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return self._pool.numel() * self._pool.element_size()
