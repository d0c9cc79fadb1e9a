"""Many words of a die's own window, each written by one peer, polled together.

A wait for every member's record (dispatch/combine, the agreement) used to load each doorbell
with its own `DieMemory.load_word` call on every turn of the poll: at 64 dies, ~60 calls of a
bounds check, a `Win.Sync` and a load per turn. A waiting die on an oversubscribed core turns
again each time the scheduler comes back to it, so that cost was paid many times per wait.
`WordPoll` settles the bounds checks and the idioms once: the words whose writer is reached by
load/store are compared in one numpy operation after one `Win.Sync`; a writer polled through MPI
(another node, or `poll_idiom: rma`) keeps `load_word`'s Fetch_and_op (docs/mpi.md §2).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xccl.gmem import WORD, DieMemory


class WordPoll:
    """Words at `offsets` of this die's window, `writers[i]` writing word i."""

    def __init__(self, mem: DieMemory, offsets: Sequence[int], writers: Sequence[int]) -> None:
        if len(offsets):  # every word lies between the lowest and the highest
            low, high = min(offsets), max(offsets)
            mem.check(mem.rank, low, high - low + WORD.itemsize, "load_word")
        self.mem, self.writers = mem, list(writers)
        near = [i for i, w in enumerate(self.writers) if not mem.poll_by_rma[w]]
        self._near = np.array(near, np.intp)
        self._near_words = np.array([offsets[i] // WORD.itemsize for i in near], np.intp)
        self._far = [(i, offsets[i], w) for i, w in enumerate(self.writers) if mem.poll_by_rma[w]]

    def missing(self, value: int, pending: Sequence[int] | None = None) -> list[int]:
        """Indices of the words that do not hold `value` yet (near writers first). pending: the
        indices the last call returned, if this wait made one: a rung word stays rung until
        the wait ends, so only those far words are fetched again (one MPI call each)."""
        mem, missing = self.mem, []
        if len(self._near_words):
            mem.sync()
            differs = mem.words[self._near_words] != np.uint64(value)
            if differs.any():
                missing = self._near[differs].tolist()
        still = None if pending is None else set(pending)
        for i, offset, writer in self._far:
            if (still is None or i in still) and mem.load_word(offset, writer) != value:
                missing.append(i)
        return missing
