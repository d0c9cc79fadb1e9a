"""The prefill die's KV-send path under link faults and link probing (xDeepServe §6.1).

A send the die starts while its link to the decode die is down (ranks/pd/channel.py) is held:
nothing reaches the pair; it goes out when the link is back, unless it is withdrawn first.
Every loop turn the prober (ranks/recovery/link_probe.py) sees each decode die's oldest send without
progress (held or in XCCL) and probes the pair; on a "link" verdict the die withdraws the sends
held for that pair (none of their bytes were published, so the decode die can cancel its
receive) and names them in the report, and the JE sends their tasks to another decode die,
which pulls the KV over another pair. Sends held on a pair already down are withdrawn as they
come ("reroute" reports). The blocks stay with the die until some decode die took the KV.

A decode die lost (ranks/recovery/je_decode_loss.py, TAG_PD_DECODE_WITHDRAW): every pull from it is
dropped (those arriving later too), every send to it cancelled (its pair is never used again, so
cancelling mid-message is safe), and the die names the tasks it still holds to the JE
(TAG_PD_DECODE_HELD): those of the lost die are re-routed, their KV still here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from ranks.core.control import wait_all
from ranks.core.die_io import SHELL
from ranks.core.tags import TAG_PD_DECODE_HELD, TAG_PD_DECODE_WITHDRAW
from ranks.recovery.link_probe import LinkProber, LinkReport


class SendFailover:
    def __init__(self, ctx, channel, clock) -> None:
        """channel: the die's injected `link` rows (ranks/pd/channel.py ChannelFaults, built by
        the die: recovery reads the injection only through it)."""
        comm, rank = ctx.comm, ctx.comm.rank
        self.comm = comm
        self.channel = channel
        self.prober = LinkProber(comm, rank, ctx.cfg.health, clock, self.channel.is_link_down)
        self.clock = clock
        self.held: dict[int, tuple[object, float]] = {}  # req -> (its KvPull, held since)
        self.sends: list = []
        self.timeout_s = ctx.cfg.xccl.poll_timeout_s  # completing the sends at the end
        self.num_withdrawn = 0
        self.lost_decode: set[int] = set()  # decode dies lost (ranks/recovery/je_decode_loss.py)
        self.num_decode_failovers = 0  # the dies rebuilt: the world window is never freed

    def take_decode_lost(self, sender) -> None:
        """Withdraw what waits on a lost decode die; name the tasks still held to the JE."""
        while (msg := self.comm.improbe(source=SHELL, tag=TAG_PD_DECODE_WITHDRAW)) is not None:
            self.lost_decode.update(msg.recv())
            self.num_decode_failovers += 1
            self._drop_lost(sender)
            held = tuple(sender.held)
            self.sends.append(self.comm.isend(held, dest=SHELL, tag=TAG_PD_DECODE_HELD))
        if self.lost_decode:
            self._drop_lost(sender)  # pulls the lost die sent before it was lost

    def _drop_lost(self, sender) -> None:
        lost = self.lost_decode
        sender.pulls = deque(p for p in sender.pulls if p.decode_rank not in lost)
        for req_id in [r for r, (p, _) in self.held.items() if p.decode_rank in lost]:
            del self.held[req_id]
        for out in [o for o in sender.outgoing.values() if o.pull.decode_rank in lost]:
            sender.p2p.cancel(out.handle)
            del sender.outgoing[out.pull.req_id]

    def tick(self, iteration: int) -> None:
        self.channel.tick(self.comm, iteration, self.clock(), self.sends)

    def holds(self, pull) -> bool:
        """Does the channel drop this send (its link is down)? Then it waits here."""
        if not self.channel.is_link_down(pull.decode_rank):
            return False
        self.held[pull.req_id] = (pull, time.monotonic())
        return True

    def release(self, pulls: deque) -> None:
        """Held sends whose link is back go first, in the order they were held (a pair's
        receives are queued in that order at the decode die)."""
        back = [
            pull
            for pull, _ in self.held.values()
            if not self.channel.is_link_down(pull.decode_rank)
        ]
        for pull in back:
            del self.held[pull.req_id]
        pulls.extendleft(reversed(back))

    def watch(self, outgoing: dict) -> None:
        """Probe the pairs whose sends make no progress; withdraw sends on pairs found down."""
        outstanding: dict[int, tuple[float, list[int]]] = {}
        started = [(p.decode_rank, p.req_id, t) for p, t in self.held.values()]
        started += [(o.pull.decode_rank, o.pull.req_id, o.started) for o in outgoing.values()]
        for decode, req_id, since in started:
            oldest, ids = outstanding.get(decode, (since, []))
            outstanding[decode] = (min(oldest, since), [*ids, req_id])
        for report in self.prober.step(outstanding):
            if report.kind == "link":
                report = replace(report, req_ids=self._withdraw(report.decode))
            self.prober.tell(report)
        for decode in {p.decode_rank for p, _ in self.held.values()}:
            if self.prober.verdict(decode) == "link":
                self._reroute(decode)

    def _withdraw(self, decode: int) -> tuple[int, ...]:
        ids = tuple(r for r, (p, _) in self.held.items() if p.decode_rank == decode)
        for req_id in ids:
            del self.held[req_id]
        self.num_withdrawn += len(ids)
        return ids

    def _reroute(self, decode: int) -> None:
        ids = self._withdraw(decode)
        report = LinkReport(
            kind="reroute",
            prefill=self.prober.rank,
            decode=decode,
            wall=time.time(),
            virtual_s=self.clock(),
            req_ids=ids,
        )
        self.prober.tell(report)

    def close(self) -> None:
        """The probes and the held news to the JE complete (the bound of every wait on the way
        out)."""
        self.prober.close(timeout_s=self.timeout_s)
        me = f"die rank {self.prober.rank}"
        wait_all(self.sends, timeout_s=self.timeout_s, me=me, event="held requests to the JE")
