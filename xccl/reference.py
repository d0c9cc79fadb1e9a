"""Single-process oracles for XCCL's protocols. Tests compare distributed results with these."""
from __future__ import annotations

from typing import Iterable

import numpy as np


def p2p_deliveries(messages: Iterable[tuple[int, int, int, bytes]]
                   ) -> dict[tuple[int, int], list[tuple[int, bytes]]]:
    """What send/receive must deliver: for each (src, dst) pair, the (event id, bytes) of every
    message src sent to dst, in the order src sent them (a pair's ring is FIFO)."""
    delivered: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    for src, dst, event_id, data in messages:
        delivered.setdefault((src, dst), []).append((event_id, bytes(data)))
    return delivered


def tagged_payload(src: int, dst: int, seq: int, nbytes: int) -> np.ndarray:
    """Bytes that say where they came from: a stream seeded by (src, dst, seq), so a misrouted or
    reordered message differs from what its receiver expects."""
    return np.random.default_rng((src, dst, seq)).integers(0, 256, nbytes, dtype=np.uint8)
