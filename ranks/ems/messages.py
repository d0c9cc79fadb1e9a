"""Messages of the EMS context cache (docs/ems.md): prefill die -> pool rank, pool rank -> JE."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class EmsPut:
    """New full prompt blocks for one pool rank: their keys and packed KV, one block_bytes
    each, in key order."""

    keys: tuple[int, ...]
    payload: np.ndarray


@dataclass(frozen=True, kw_only=True)
class EmsTouch:
    """Blocks a prefill die pulled: most recently used at their pool rank."""

    keys: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class EmsEvict:
    """An `ems.faults` evict row: evict `key` now, and answer `EmsEvicted` to prefill die
    `rank` (it waits for the answer)."""

    key: int
    rank: int


@dataclass(frozen=True, kw_only=True)
class EmsEvicted:
    """The pool rank's answer: whether it held `key` (and evicted it)."""

    key: int
    was_held: bool


@dataclass(frozen=True, kw_only=True)
class EmsDone:
    """A prefill die sends nothing more (its last message to each pool rank)."""

    rank: int


@dataclass(frozen=True, kw_only=True)
class EmsPoolReport:
    """A pool rank's run: blocks put (new) and already held, evictions, blocks held at the end,
    reads reported; is_lost: it died (an ems.faults dead row), num_dropped: put messages that
    reached it dead, dropped unread."""

    rank: int
    num_put: int = 0
    num_put_held: int = 0
    num_evicted: int = 0
    num_held: int = 0
    num_touched: int = 0
    is_lost: bool = False
    num_dropped: int = 0
    stats: dict = field(default_factory=dict)
