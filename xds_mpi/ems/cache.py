"""The EMS context cache's logic, free of MPI (docs/ems.md; CloudMatrix-Infer §4.4.1-4.4.2).

- `block_keys`: a block's key is a hash chained over the prompt's tokens block by block (from the
  plan's namespace), so equal keys mean equal prefixes up to and including that block;
- `Ring`: consistent hashing of keys over the pool ranks (virtual points per rank), so adding a
  pool rank moves only the keys of its arcs;
- `Directory`: a pool rank's slots and LRU order (the pool rank alone decides them);
- `Record`, `RecordTable` and `verified`: what a reader checks before and after pulling a payload.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

VIRTUAL_POINTS = 64  # ring points per pool rank


def _hash64(data: bytes) -> int:
    key = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return key or 1  # 0 marks an empty record


def block_keys(tokens: Sequence[int], block_tokens: int, namespace: bytes) -> list[int]:
    """The key of every full block of `tokens`: key_i = H(key_{i-1}, block i's tokens)."""
    keys, prev = [], namespace
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = np.asarray(tokens[start : start + block_tokens], dtype=np.int64).tobytes()
        key = _hash64(prev + block)
        keys.append(key)
        prev = key.to_bytes(8, "little")
    return keys


def lookup_blocks(prompt_len: int, block_tokens: int) -> int:
    """How many leading blocks a prompt may take from the pool: full blocks before its last
    token, which is always computed (its row samples the first token)."""
    return (prompt_len - 1) // block_tokens


class Ring:
    """Consistent hashing of 64-bit keys onto `members` (pool ranks)."""

    def __init__(self, members: Sequence[int]) -> None:
        points = sorted(
            (_hash64(f"ems-ring/{m}/{v}".encode()), m)
            for m in members
            for v in range(VIRTUAL_POINTS)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [m for _, m in points]

    def owner(self, key: int) -> int:
        """The member of the first point at or after `key` (wrapping)."""
        i = bisect.bisect_left(self._hashes, key)
        return self._owners[i % len(self._owners)]


@dataclass(frozen=True, kw_only=True)
class Record:
    """A slot's metadata record as a reader sees it."""

    key: int
    version: int
    nbytes: int

    @classmethod
    def of(cls, words: np.ndarray) -> Record:
        return cls(key=int(words[0]), version=int(words[1]), nbytes=int(words[2]))


class RecordTable:
    """A pool rank's records as one read returned them; a key is found by one vectorized
    compare (a table of 65,536 records parsed record by record cost ~0.2 s a lookup)."""

    def __init__(self, words: np.ndarray, capacity: int) -> None:
        self.words = words.reshape(capacity, -1)  # [capacity, record words] uint64

    def find(self, key: int) -> tuple[int, Record] | None:
        """(slot, record) of the stable record naming `key`; None: none does."""
        for slot in np.flatnonzero(self.words[:, 0] == np.uint64(key)):
            record = Record.of(self.words[slot])
            if record.version % 2 == 0:
                return int(slot), record
        return None


def verified(wanted: int, nbytes: int, before: Record, after_version: int) -> bool:
    """A pulled payload is the block asked for: the record named its key with a stable (even)
    version and the right size before the pull, and the version had not moved after it (the pool
    rewrites a slot by making its version odd, writing, then even again)."""
    return (
        before.key == wanted
        and before.nbytes == nbytes
        and before.version % 2 == 0
        and after_version == before.version
    )


@dataclass(frozen=True, kw_only=True)
class Placed:
    """Where a put lands: the slot, and the key evicted from it (0: the slot was free)."""

    slot: int
    evicted: int


class Directory:
    """A pool rank's blocks: key -> slot, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, key: int) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def touch(self, key: int) -> None:
        """A read of `key`: most recently used (a key evicted meanwhile is ignored)."""
        if key in self._slots:
            self._slots.move_to_end(key)

    def evict(self, key: int) -> int | None:
        """`key` dropped now (an ems.faults evict row): its slot, free again; None: not held."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def place(self, key: int) -> Placed:
        """A slot for a new key: a free one, else the least recently used one's."""
        if key in self._slots:
            raise ValueError(f"key {key:#x} is already in slot {self._slots[key]}")
        evicted = 0
        if self._free:
            slot = self._free.pop()
        else:
            evicted, slot = self._slots.popitem(last=False)
        self._slots[key] = slot
        return Placed(slot=slot, evicted=evicted)
