"""Faults in KV transfers and their retry (xDeepServe §6.2 applied to §5.1's transfer). The
faults themselves are injected by ranks/faults/kv_transfer.py (`KvFaults`, the P2P's fault hook
where a row can fire); this module holds the transfer's side of a retry.

The fault table's `p2p_send` rows name a prefill die, `p2p_recv` rows a decode die; `iteration`
is that die's n-th KV transfer (from 0, in the order its first attempts start) and `times` how
many consecutive attempts of it fail; the random mode draws per transfer and attempt. The fault
fires inside XCCL's p2p (xccl/p2p/channel.py: the sender before its last record, the receiver before
its last copy and ack), where the peer is left waiting.

Retry (the transfer, not a decode rollback): with p2p faults configured a die runs one KV
transfer at a time (abandoning fails every transfer of the die, and the retry involves two dies
only); the failing die abandons its one transfer in flight
and sends KvAbort with its end's pair state; the peer abandons its end, both resync the pair to
the max (xccl/p2p/channel.py), the peer answers KvAbortAck; then the decode die posts a fresh irecv
with the next attempt's event id and pulls again. More than pd.max_transfer_retries failed
attempts of one transfer end the run with an error naming both dies and the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ranks.core.control import WaitTimeout
from xccl.errors import InjectedFault

MAX_ATTEMPTS = 64  # event id = req_id x MAX_ATTEMPTS + attempt


def kv_event_id(req_id: int, attempt: int) -> int:
    """The p2p event id of a request's KV transfer (one per attempt: a retried transfer can
    never be taken for the failed one)."""
    return req_id * MAX_ATTEMPTS + attempt


@dataclass(frozen=True, kw_only=True)
class KvAbort:
    """A KV transfer attempt failed at `sender` of this message: its end of the pair
    src -> dst stood at `state` (publications, ring position) after abandoning."""

    req_id: int
    attempt: int
    src: int
    dst: int
    state: tuple[int, int]


def check_deadline(started: float, timeout_s: float, me: int, peer: int, req_id: int) -> None:
    """A KV transfer that does not progress within xccl.poll_timeout_s ends the run."""
    if time.monotonic() - started > timeout_s:
        raise WaitTimeout(
            f"die rank {me}: KV transfer of request {req_id} with rank {peer} made no "
            f"progress after xccl.poll_timeout_s({timeout_s:g})"
        )


def poll_transfer(handle) -> bool | InjectedFault:
    """handle.test(), with an injected fault returned instead of raised."""
    try:
        return handle.test()
    except InjectedFault as fault:
        return fault
