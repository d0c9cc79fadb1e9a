"""KV-transfer faults (xDeepServe §6.2 applied to §5.1's transfer): the fault table's `p2p_send`
rows name a prefill die, `p2p_recv` rows a decode die; `iteration` is that die's n-th KV transfer
(from 0, in the order its first attempts start) and `times` how many consecutive attempts of it
fail; the random mode draws per transfer and attempt. The fault fires inside XCCL's p2p
(xccl/p2p/channel.py: the sender before its last record, the receiver before its last copy and
ack), where the peer is left waiting. The retry is PD's (ranks/pd/faults.py, send.py,
receive.py)."""

from __future__ import annotations

from xccl.errors import InjectedFault, XcclError
from xccl.p2p import P2P
from xccl.recovery.faults import RecoveryHooks
from xds_mpi.execution.faults import FaultPlan, LayerEvents


class KvFaults:
    """The fault hook of a die's P2P for KV transfers, and the count of faults it raised."""

    def __init__(self, cfg, rank: int, *, attempts_per_transfer: int) -> None:
        self.plan = FaultPlan(cfg.faults, rank, LayerEvents(events_per_iteration=1))
        self.attempts_per_transfer = attempts_per_transfer  # event id = req_id x this + attempt
        self.rank, self.transfer_no, self.num_faults = rank, {}, 0
        self.max_retries = cfg.pd.max_transfer_retries
        self.max_in_flight = 1 << 30  # KV transfers a die runs at once (1 when faults can fire)

    def check(self, op: str, event_id: int) -> None:
        req_id, attempt = divmod(event_id, self.attempts_per_transfer)
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


def install(p2p: P2P, cfg, rank: int, *, attempts_per_transfer: int) -> KvFaults:
    """A KvFaults for this die, hooked into its P2P (through its `set_recovery`) when the config
    can fail p2p at all; a P2P with no such row has no hook and runs one transfer at a time no
    more than otherwise."""
    faults = KvFaults(cfg, rank, attempts_per_transfer=attempts_per_transfer)
    has_rows = any(row.op.startswith("p2p") for row in cfg.faults.table)
    is_drawn = cfg.faults.rate > 0 and any(op.startswith("p2p") for op in cfg.faults.ops)
    if has_rows or is_drawn:
        p2p.set_recovery(RecoveryHooks(fault_hook=faults.check))
        faults.max_in_flight = 1  # abandon() fails every transfer of the die: keep it to one
    return faults
