"""Restarting one p2p pair after a failed transfer, without touching the die's other pairs.

xccl/p2p/channel.py's restart rule realigns every pair of every die after a vote of all dies (token
recomputation). A KV transfer between one prefill and one decode die is retried between those
two alone: both ends `abandon()` (each has only that transfer in flight), exchange
`pair_state` over the control plane, and both `resync_pair` to the element-wise max. As in the
global rule, the next publication is numbered past every doorbell the failed attempt left, the
receiver expects the sender's tail, and the sender's ack word says "all acknowledged".
"""

from __future__ import annotations

from xccl.p2p.channel import P2P
from xccl.records import record as records


def pair_state(p2p: P2P, src: int, dst: int) -> tuple[int, int]:
    """(publications, ring position) of the pair src -> dst at this end of it."""
    if p2p.me == src:
        return p2p._published.get(dst, 0), p2p._tail.get(dst, 0)
    return p2p._consumed.get(src, 0), p2p._rtail.get(src, 0)


def resync_pair(p2p: P2P, src: int, dst: int, state: tuple[int, int]) -> None:
    """Continue the pair src -> dst from `state` (the max of both ends' pair_state)."""
    published, tail = (int(v) for v in state)
    have = pair_state(p2p, src, dst)
    if published < have[0] or tail < have[1]:
        raise ValueError(
            f"die rank {p2p.me}: pair {src} -> {dst} resync to publication {published}, ring "
            f"position {tail} would go back from {have}"
        )
    if p2p.me == src:
        p2p._published[dst], p2p._tail[dst] = published, tail
        p2p.mem.store_word(p2p.me, p2p.layout.ack_offset(src, dst), records.ack_word(published))
        p2p.mem.flush(p2p.me)
    else:
        p2p._consumed[src], p2p._rtail[src] = published, tail
