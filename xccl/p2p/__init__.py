"""XCCL point-to-point send/receive (xDeepServe §3.1, Figure 4): a ring of slots per ordered die
pair. channel.py: the `P2P` verbs, their handles and the restart rules; send.py / recv.py: the
two ends of the ring protocol; ops.py: the transfers queued in flight; timing.py: their virtual
time."""

from xccl.p2p.channel import P2P, Handle, pair_state, resync_pair
from xccl.p2p.ops import Transfer
from xccl.p2p.send import MAX_IN_FLIGHT

__all__ = ["MAX_IN_FLIGHT", "P2P", "Handle", "Transfer", "pair_state", "resync_pair"]
