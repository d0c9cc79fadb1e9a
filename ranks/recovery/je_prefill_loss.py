"""A prefill TE lost, from the JE (xDeepServe §6.1 detection, §6.2 P/D separate failover).

Who pings whom in PD: the JE is the control plane; it pings each prefill TE's leader (its DP-0,
which plays the TE's TE-shell) every health.control_interval_s, and the leader answers from its
event loop only (ranks/pd/prefill.py). The TE-shell -> DP-master tier inside a prefill TE is not
run: a prefill TE whose loss is emulated has one die (xds_mpi/plan/failures/checks.py refuses the
others, whose surviving dies would hang in the TE's collectives), so its leader is its only DP
master. A leader silent for health.timeout_s is declared lost with its whole TE ("prefill
instance lost"): the JE routes nothing more there; the requests it had sent there and not seen
prefilled go to the live TEs; every decode die withdraws the KV transfers it still waits for
from the lost dies (TAG_PD_PREFILL_LOST) and names them back (TAG_PD_WITHDRAWN), and those are
prefilled again on a live TE. Nothing is lost: prefill is deterministic, so the re-prefilled
request's KV and first token equal the lost ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ranks.core.messages import TAG_REQUEST
from ranks.core.tags import TAG_PD_PREFILL_LOST, TAG_PD_WITHDRAWN
from ranks.recovery.watch import HeartbeatSender


@dataclass(kw_only=True)
class TeLoss:
    """TE `te` (dies `ranks`) declared lost at wall time `wall`; the requests sent elsewhere."""

    te: int
    ranks: tuple[int, ...]
    wall: float
    moved: list[int] = field(default_factory=list)


class PrefillWatch:
    def __init__(self, je) -> None:
        health = je.ctx.cfg.health
        self.je, self.comm = je, je.comm
        self.sender = (
            HeartbeatSender(
                je.comm,
                je.pd_plan.leaders,
                interval_s=health.control_interval_s,
                timeout_s=health.timeout_s,
            )
            if health.enabled and len(je.pd_plan.leaders) > 1
            else None
        )  # one TE: nothing to fail over to (such rows are refused), so nobody is declared lost
        self.losses: list[TeLoss] = []

    def poll(self) -> int:
        if self.sender is None:
            return 0
        self.sender.tick()
        for leader in self.sender.silent():
            self._lose(self.je.pd_plan.leaders.index(leader), leader)
        num = 0
        while (msg := self.comm.improbe(tag=TAG_PD_WITHDRAWN)) is not None:
            self._prefill_again(msg.recv())
            num += 1
        return num

    def _lose(self, te: int, leader: int) -> None:
        """Step 1 (§6.2): take the TE out; its requests go to live TEs."""
        self.sender.forget(leader)
        ranks = tuple(self.je.pd_plan.tes[te])
        self.losses.append(TeLoss(te=te, ranks=ranks, wall=time.time()))
        self.je.log.warning(
            "heartbeat: prefill TE %d (dies %s) silent for %g s (health.timeout_s %g): prefill "
            "instance lost",
            te,
            list(ranks),
            self.sender.patience_s,
            self.sender.timeout_s,
        )
        for decode in self.je.pd_plan.decode:
            self.je.sends.append(self.comm.isend(ranks, dest=decode, tag=TAG_PD_PREFILL_LOST))
        self._prefill_again(self.je.router.lose(te))

    def _prefill_again(self, req_ids) -> None:
        je = self.je
        for req_id in req_ids:
            self.prefill(je.records[req_id].req)
            task = je.pd_book.tasks.get(req_id)
            loss = self.loss_of(task.prefill_rank) if task else None
            (loss or self.losses[-1]).moved.append(req_id)

    def prefill(self, req) -> None:
        """Send `req` to a live prefill TE (its leader's pool), chosen by length and load."""
        je = self.je
        je.router.prefilled(req.req_id)  # no-op unless it was counted somewhere
        leader = je.pd_plan.leaders[je.router.dispatch(req.req_id, len(req.prompt))]
        je.sends.append(self.comm.isend(req, dest=leader, tag=TAG_REQUEST))

    def loss_of(self, die: int) -> TeLoss | None:
        return next((loss for loss in self.losses if die in loss.ranks), None)

    def close(self) -> None:
        if self.sender is not None:  # the stop path's bound, as the JE's other waits there
            self.sender.close(timeout_s=self.je.ctx.cfg.xccl.poll_timeout_s)
