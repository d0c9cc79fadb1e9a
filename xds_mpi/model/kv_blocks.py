"""Paged KV bookkeeping: which cache blocks hold which sequence's positions (no tensors here).

A pool of `num_blocks` blocks of `block_tokens` slots each; slot `block_idx * block_tokens + offset`
holds one position. A sequence owns a block list; position p lives in block list[p // block_tokens]
at offset p % block_tokens. The engine asks `can_append` before it admits work and the tensors
(`mla.LatentCache`) are indexed by the slots returned here.
"""

from __future__ import annotations

from collections.abc import Hashable


class KVCacheFull(ValueError):
    """The pool has fewer free blocks than a sequence needs; the message names the numbers."""


class BlockTable:
    """Allocate / append / truncate / free sequences on a fixed pool of KV blocks."""

    def __init__(self, *, num_blocks: int, block_tokens: int) -> None:
        if num_blocks <= 0 or block_tokens <= 0:
            raise ValueError(
                f"BlockTable needs num_blocks > 0 and block_tokens > 0, got "
                f"num_blocks={num_blocks}, block_tokens={block_tokens}"
            )
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        # Pop from the end: the lowest block index is handed out first.
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._seq2blocks: dict[Hashable, list[int]] = {}
        self._seq2len: dict[Hashable, int] = {}
        self._masked: set[int] = set()  # faulty blocks, never handed out again

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seq2len

    def seq_len(self, seq_id: Hashable) -> int:
        self._check_known(seq_id)
        return self._seq2len[seq_id]

    def blocks(self, seq_id: Hashable) -> list[int]:
        self._check_known(seq_id)
        return list(self._seq2blocks[seq_id])

    def num_blocks_needed(self, seq_id: Hashable, num_new: int) -> int:
        """Blocks `append(seq_id, num_new)` would take from the pool (0 for an unknown seq_id's
        length means a new sequence)."""
        seq_len = self._seq2len.get(seq_id, 0)
        num_held = len(self._seq2blocks.get(seq_id, ()))
        return max(0, -(-(seq_len + num_new) // self.block_tokens) - num_held)

    def can_append(self, seq_id: Hashable, num_new: int) -> bool:
        return self.num_blocks_needed(seq_id, num_new) <= self.num_free_blocks

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Register a new sequence holding `num_tokens` positions; returns their slots."""
        if seq_id in self._seq2len:
            raise ValueError(
                f"sequence {seq_id!r} is already allocated "
                f"({self._seq2len[seq_id]} tokens); free it first"
            )
        self._seq2blocks[seq_id] = []
        self._seq2len[seq_id] = 0
        try:
            return self.append(seq_id, num_tokens)
        except KVCacheFull:
            del self._seq2blocks[seq_id], self._seq2len[seq_id]
            raise

    def append(self, seq_id: Hashable, num_new: int) -> list[int]:
        """Extend a sequence by `num_new` positions; returns their slots. Nothing changes when
        the pool cannot hold them."""
        self._check_known(seq_id)
        if num_new < 0:
            raise ValueError(f"cannot append {num_new} tokens to sequence {seq_id!r}")
        num_needed = self.num_blocks_needed(seq_id, num_new)
        if num_needed > self.num_free_blocks:
            seq_len = self._seq2len[seq_id]
            raise KVCacheFull(
                f"KV cache full: sequence {seq_id!r} at {seq_len} tokens needs {num_needed} more "
                f"block(s) of {self.block_tokens} tokens for {num_new} new tokens, but only "
                f"{self.num_free_blocks} of {self.num_blocks} blocks are free"
            )
        blocks = self._seq2blocks[seq_id]
        blocks.extend(self._free_blocks.pop() for _ in range(num_needed))
        start = self._seq2len[seq_id]
        self._seq2len[seq_id] = start + num_new
        return self.slots(seq_id, start, start + num_new)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first `num_tokens` positions (speculative rollback); frees emptied blocks."""
        seq_len = self.seq_len(seq_id)
        if not 0 <= num_tokens <= seq_len:
            raise ValueError(
                f"cannot truncate sequence {seq_id!r} of {seq_len} tokens to {num_tokens} tokens"
            )
        blocks = self._seq2blocks[seq_id]
        num_keep = -(-num_tokens // self.block_tokens)
        self._free_blocks.extend(b for b in reversed(blocks[num_keep:]) if b not in self._masked)
        del blocks[num_keep:]
        self._seq2len[seq_id] = num_tokens

    def snapshot(self) -> tuple:
        """The whole table, for `restore` (a failed iteration's rollback)."""
        return (
            tuple(self._free_blocks),
            {seq_id: tuple(blocks) for seq_id, blocks in self._seq2blocks.items()},
            dict(self._seq2len),
        )

    def restore(self, snapshot: tuple) -> None:
        free, seq2blocks, seq2len = snapshot
        self._free_blocks = list(free)
        self._seq2blocks = {seq_id: list(blocks) for seq_id, blocks in seq2blocks.items()}
        self._seq2len = dict(seq2len)

    def mask(self, blocks) -> list[Hashable]:
        """Take faulty blocks out of use for good (xDeepServe §6.2 stage 3: the runtime masks
        the region): the pool shrinks by them; returns the sequences holding any of them."""
        faulty = set(blocks) - self._masked
        self._masked |= faulty
        self._free_blocks = [b for b in self._free_blocks if b not in faulty]
        self.num_blocks -= len(faulty)
        return [s for s, owned in self._seq2blocks.items() if faulty.intersection(owned)]

    def free(self, seq_id: Hashable) -> None:
        self.truncate(seq_id, 0)
        del self._seq2blocks[seq_id], self._seq2len[seq_id]

    def slots(self, seq_id: Hashable, start: int = 0, stop: int | None = None) -> list[int]:
        """Slots of positions [start, stop) of a sequence (default: all of them)."""
        seq_len = self.seq_len(seq_id)
        stop = seq_len if stop is None else stop
        if not 0 <= start <= stop <= seq_len:
            raise ValueError(
                f"positions [{start}, {stop}) are outside sequence {seq_id!r} of {seq_len} tokens"
            )
        blocks = self._seq2blocks[seq_id]
        return [
            blocks[p // self.block_tokens] * self.block_tokens + p % self.block_tokens
            for p in range(start, stop)
        ]

    def _check_known(self, seq_id: Hashable) -> None:
        if seq_id not in self._seq2len:
            raise KeyError(f"sequence {seq_id!r} has no KV blocks (allocate it first)")
