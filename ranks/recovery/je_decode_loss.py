"""A decode die of a PD run lost, from the JE (xDeepServe §6.2 "P/D separate failover"): the decode
TE-shell found it and scaled the decode side down (ranks/recovery/decode_loss.py); the JE moves its
requests, and prefill never stops.

On the decode TE-shell's DecodeLoss:
  1. the JE takes every token batch the survivors sent before they rebuilt, so that what each
     request emitted is known;
  2. every prefill die withdraws what waits on the lost die (pulls dropped, sends cancelled,
     ranks/recovery/pd_send_failover.py) and names the PD tasks whose KV it still holds;
  3. each request routed to the lost die and not finished continues elsewhere:
     - its KV transfer was not completed (its prefill die still holds the KV): the task is
       re-routed to another decode die (as after a link verdict, ranks/shell/je.py _route), which
       pulls the KV over its own pair;
     - it was being decoded there (the KV left its prefill die): it goes back through the JE to
       the prefill side with the prompt and every token emitted so far, continued to the same
       max_new_tokens, and a fresh KV transfer takes it to a surviving decode die (greedy
       decoding of the same prefix gives the same next tokens, which `--check` verifies).
The failure records are built here at the end, from the decode TE-shell's detections (DecodeBook)
and the JE's request records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ranks.core.control import recv_from_each, send_to_each
from ranks.core.tags import (
    TAG_PD_DECODE_BOOK,
    TAG_PD_DECODE_HELD,
    TAG_PD_DECODE_LOST,
    TAG_PD_DECODE_WITHDRAW,
    TAG_STOP,
)
from ranks.recovery.decode_loss import DecodeBook, DecodeLoss
from ranks.recovery.records import failure_records, with_timeouts
from ranks.recovery.scale_down import resumed
from ranks.recovery.watch import is_watched
from xds_mpi.plan.failures.checks import release_bound_s


@dataclass(kw_only=True)
class Moved:
    """One loss as the JE handled it: the decode dies before and after, the requests re-routed
    (KV still at prefill) and those prefilled again."""

    loss: DecodeLoss
    handled_at: float = 0.0  # time.time() once the JE moved the requests
    rerouted: list[int] = field(default_factory=list)
    prefilled: list[int] = field(default_factory=list)

    def recovery(self) -> str:
        return (
            f"vertical scaling: {self.loss.before} -> {self.loss.after} {self.loss.dies} dies; "
            f"{len(self.prefilled)} requests prefilled again through the JE, "
            f"{len(self.rerouted)} PD tasks re-routed to other decode dies"
        )


class DecodeLossWatch:
    def __init__(self, je) -> None:
        cfg = je.ctx.cfg
        self.je, self.comm = je, je.comm
        self.shell = je.pd_plan.decode_shell
        self.is_watched = is_watched(cfg, je.ctx.plan)
        self.timeout_s = max(cfg.xccl.poll_timeout_s, release_bound_s(cfg.health))
        self.moved: list[Moved] = []
        self.book: DecodeBook | None = None

    def poll(self) -> int:
        num = 0
        while self.is_watched and (
            msg := self.comm.improbe(source=self.shell, tag=TAG_PD_DECODE_LOST)
        ):
            self._recover(msg.recv())
            num += 1
        return num

    def _recover(self, loss: DecodeLoss) -> None:
        je = self.je
        je.take_batches(loss.batches, self.timeout_s)  # Step 1
        prefill = [p for p in je.pd_plan.prefill if je.watch.loss_of(p) is None]  # Step 2
        opts = {"timeout_s": self.timeout_s, "me": "JE", "event": "decode die lost"}
        send_to_each(self.comm, {p: loss.lost for p in prefill}, tag=TAG_PD_DECODE_WITHDRAW, **opts)
        held = recv_from_each(self.comm, prefill, tag=TAG_PD_DECODE_HELD, **opts)
        held_ids = {r for ids in held.values() for r in ids}
        je.drop_groups(loss.lost)  # the decode TE-shell named the orphans (loss.orphans)
        moved = Moved(loss=loss)
        for req_id in loss.orphans:  # Step 3
            record = je.records[req_id]
            if record.finished_at:
                continue
            if req_id in held_ids:
                moved.rerouted.append(req_id)
                je.route_again(je.pd_book.tasks[req_id])
            else:
                moved.prefilled.append(req_id)
                if je.virtual is None:
                    je.watch.prefill(resumed(record))
                else:  # arriving at the JE when the decode failover ends
                    je.virtual.prefill_again(resumed(record), loss.resumed_s)
        if je.virtual is not None:  # the re-routed tasks go with the news (pd_pacers.py)
            je.virtual.handled_loss()
        moved.handled_at = time.time()
        self.moved.append(moved)
        je.log.warning("decode failover (dies %s lost): %s", list(loss.lost), moved.recovery())

    def stop_shell(self) -> None:
        """At the end of serving, before the decode dies are stopped: the decode TE-shell's
        heartbeats end (it answers with its DecodeBook once the dies closed)."""
        if self.is_watched:
            opts = {"timeout_s": self.timeout_s, "me": "JE", "event": "stop"}
            send_to_each(self.comm, {self.shell: None}, tag=TAG_STOP, **opts)

    def take_book(self) -> None:
        """After the JE's stop to the decode TE-shell: its detections and the dies' notes."""
        if self.is_watched:
            books = recv_from_each(
                self.comm,
                (self.shell,),
                tag=TAG_PD_DECODE_BOOK,
                me="JE",
                event="decode book",
                timeout_s=self.timeout_s,
            )
            self.book = books[self.shell]

    @property
    def lost(self) -> set[int]:
        return {d for m in self.moved for d in m.loss.lost}

    def records(self, requests: dict, started: float, recovery: dict) -> list:
        """One failure record per decode die's stuck/dead row (xds_mpi/results/failures.py)."""
        if self.book is None:
            return []
        by_time = {m.loss.detected_at: m for m in self.moved}
        detections = []
        for d in self.book.detections:
            m = by_time.get(d.wall_time)
            if m is not None and m.loss.lost:
                affected = tuple(sorted(m.rerouted + m.prefilled))
                d = replace(d, recovery=m.recovery(), affected=affected)
            detections.append(d)
        cfg, topo = self.je.ctx.cfg, self.je.ctx.topo
        roles = {info.rank: info.role for info in topo.ranks if info.is_die}
        out = failure_records(
            cfg, roles, self.book.began, requests, started=started, detections=detections
        )
        return with_timeouts(out, recovery, roles, started)

    def explained(self, records: list, started: float) -> list:
        """PD failure records without the verdicts a decode loss explains: on the lost die's
        pairs (its dummies go unanswered), and on any pair from the fault until probe_timeout_s
        after the JE moved the requests (the survivors wait for the lost die until the fence
        releases them, and echo late meanwhile)."""
        began = self.book.began if self.book else {}
        probe_s = self.je.ctx.cfg.health.probe_timeout_s
        windows = [
            (min(began[d].wall_time for d in m.loss.lost if d in began), m.handled_at + probe_s)
            for m in self.moved
            if any(d in began for d in m.loss.lost)
        ]

        def is_explained(r) -> bool:
            at = started + r.detected_wall_s
            return r.die in self.lost or any(t0 <= at <= t1 for t0, t1 in windows)

        return [r for r in records if not (r.kind == "none" and is_explained(r))]
