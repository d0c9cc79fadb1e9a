"""The decode die's KV-receive path under channel faults (xDeepServe §6.1), beside
ranks/pd/receive.py.

- Saturation (ranks/pd/channel.py): while it lasts the die takes each transfer delay_s late: it
  asks the prefill die to send at once but posts its receive delay_s later (the send waits
  unacknowledged meanwhile), and echoes each dummy delay_s late (ranks/recovery/link_probe.py).
- A prefill TE lost (TAG_PD_PREFILL_LOST, ranks/recovery/je_prefill_loss.py): every transfer from
its
  dies not yet complete here, and every later task from them, is withdrawn the same way and
  named back to the JE (TAG_PD_WITHDRAWN), which has those requests prefilled again elsewhere
  (the pairs from a lost die are never used again, so cancelling mid-message is safe).
- Re-routing after a link verdict: the JE names the requests whose KV will come over another
  pair (TAG_PD_CANCEL); their sends were withdrawn before any byte was published, so the die
  cancels the receives, gives back their blocks and forgets them.
"""

from __future__ import annotations

import time

from ranks.core.control import wait_all
from ranks.core.die_io import SHELL
from ranks.core.tags import TAG_PD_CANCEL, TAG_PD_PREFILL_LOST, TAG_PD_WITHDRAWN
from ranks.recovery.link_probe import ProbeEchoer
from xccl.errors import XcclError


class ReceiveFailover:
    def __init__(self, ctx, receiver, channel, clock) -> None:
        """channel: the die's injected `saturated` rows (ranks/pd/channel.py ChannelFaults, built
        by the die); clock: the die's virtual clock (its seconds go into the channel's
        records)."""
        self.comm, self.rank, self.receiver, self.clock = ctx.comm, ctx.comm.rank, receiver, clock
        self.channel = channel
        self.echoer = ProbeEchoer(self.comm, self.channel)
        self.sends: list = []
        self.timeout_s = ctx.cfg.xccl.poll_timeout_s  # completing the sends at the end
        self.num_cancelled = 0
        self.lost: set[int] = set()  # prefill dies of lost TEs

    def step(self, iteration: int) -> None:
        self.channel.tick(self.comm, iteration, self.clock.now_ns / 1e9, self.sends)
        self.echoer.step()
        self._take_cancels()
        self._withdraw_lost()

    def post_delay_s(self) -> float:
        """Seconds the receive of a transfer asked for now is posted late (0: at once)."""
        return self.channel.delay_s()

    def post_due(self) -> None:
        """Post the receives a saturated channel held back, once due."""
        now = time.monotonic()
        for incoming in self.receiver.posted.values():
            if incoming.handle is None and not incoming.is_resyncing and incoming.post_at <= now:
                self.receiver.post_irecv(incoming)

    def _take_cancels(self) -> None:
        rx = self.receiver
        while (msg := self.comm.improbe(source=SHELL, tag=TAG_PD_CANCEL)) is not None:
            for req_id in msg.recv():
                incoming = rx.posted.pop(req_id, None)
                if incoming is None:
                    raise XcclError(
                        f"decode die rank {self.rank}: the JE re-routes request {req_id}, "
                        "but no receive of it is in flight here"
                    )
                self._cancel(incoming)

    def _cancel(self, incoming) -> None:
        rx, req = self.receiver, incoming.task.req
        if incoming.handle is not None:
            rx.p2p.cancel(incoming.handle)
        rx.scheduler.table.free(req.req_id)
        rx.scheduler.reserved_blocks -= rx.scheduler._blocks(req)
        self.num_cancelled += 1

    def _withdraw_lost(self) -> None:
        """Withdraw what waits on a lost prefill die (posted or deferred); tell the JE."""
        rx = self.receiver
        while (msg := self.comm.improbe(source=SHELL, tag=TAG_PD_PREFILL_LOST)) is not None:
            self.lost.update(msg.recv())
        if not self.lost:
            return
        posted = [i for i in rx.posted.values() if i.task.prefill_rank in self.lost]
        for incoming in posted:
            del rx.posted[incoming.task.req.req_id]
            self._cancel(incoming)
        deferred = [i for i in rx.deferred if i.task.prefill_rank in self.lost]
        for incoming in deferred:
            rx.deferred.remove(incoming)
        ids = [i.task.req.req_id for i in posted + deferred]
        if ids:
            self.sends.append(self.comm.isend(ids, dest=SHELL, tag=TAG_PD_WITHDRAWN))

    def close(self) -> None:
        """The echoes and the withdrawn requests' news to the JE complete (the bound of every
        wait on the way out)."""
        self.echoer.close(timeout_s=self.timeout_s)
        me = f"die rank {self.comm.rank}"
        wait_all(self.sends, timeout_s=self.timeout_s, me=me, event="withdrawals to the JE")
