"""Faults in KV transfers and their retry (xDeepServe §6.2 applied to §5.1's transfer).

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
from xccl.errors import InjectedFault, XcclError
from xds_mpi.execution.faults import FaultPlan, LayerEvents

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


class KvFaults:
    """The fault hook of a die's P2P for KV transfers, and the count of faults it raised."""

    def __init__(self, cfg, rank: int) -> None:
        self.plan = FaultPlan(cfg.faults, rank, LayerEvents(events_per_iteration=1))
        self.rank, self.transfer_no, self.num_faults = rank, {}, 0
        self.max_retries = cfg.pd.max_transfer_retries
        self.max_in_flight = 1 << 30  # KV transfers a die runs at once (1 when faults can fire)

    def check(self, op: str, event_id: int) -> None:
        req_id, attempt = divmod(event_id, MAX_ATTEMPTS)
        number = self.transfer_no.setdefault(req_id, len(self.transfer_no))
        code = self.plan.decide(op, iteration=number, layer=0, attempt=attempt)
        if code is not None:
            self.num_faults += 1
            raise InjectedFault(self.rank, op, event_id, code)

    def check_retry(self, req_id: int, attempt: int, src: int, dst: int) -> None:
        """Refuse a retry past pd.max_transfer_retries, naming both dies and the request."""
        if attempt > self.max_retries:
            raise XcclError(
                f"KV transfer of request {req_id} from prefill die rank {src} to decode die "
                f"rank {dst} failed {attempt} times, over pd.max_transfer_retries"
                f"({self.max_retries})"
            )


def install(p2p, cfg, rank: int) -> KvFaults:
    """A KvFaults for this die, hooked into its P2P when the config can fail p2p at all."""
    faults = KvFaults(cfg, rank)
    has_rows = any(row.op.startswith("p2p") for row in cfg.faults.table)
    is_drawn = cfg.faults.rate > 0 and any(op.startswith("p2p") for op in cfg.faults.ops)
    if has_rows or is_drawn:
        p2p.fault_hook = faults.check
        faults.max_in_flight = 1  # abandon() fails every transfer of the die: keep it to one
    return faults


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
