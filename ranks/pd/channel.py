"""The KV-transfer channel's injected faults (`faults.events` rows `link` and `saturated`,
xDeepServe §6.1), emulated at the die that owns them; the detector (ranks/recovery/link_probe.py)
never reads this state, it only sees transfers and dummies arrive late or not at all.

link (prefill die `die`, decode die `peer`): while it lasts, a KV send the prefill die starts
to `peer`, and a dummy it sends there, is dropped: nothing reaches the decode die. The send is
held, not lost: when the link is back the transport sends it again (ranks/pd/send.py), unless
the prefill die withdrew it first for re-routing. saturated (decode die `die`): while it lasts,
the die takes every KV transfer, and every dummy, delay_s late (its receive is posted, and the
dummy echoed, delay_s after they reach it).

A fault begins when its die reaches iteration `iteration` (prefill: prefill batches; decode:
decode iterations) and lasts duration_s wall seconds (0: to the end of the run); the die tells
the JE when it began (FaultBegan), for the failure record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ranks.core.die_io import SHELL
from ranks.core.tags import TAG_PD_FAULT_BEGAN


@dataclass(frozen=True, kw_only=True)
class FaultBegan:
    """Row `row` of faults.events began at die `die` (its iteration, wall time since the epoch,
    the die's virtual seconds)."""

    row: int
    kind: str
    die: int
    peer: int
    iteration: int
    wall: float
    virtual_s: float


class ChannelFaults:
    """This die's `link` or `saturated` rows and the wall time each began (monotonic)."""

    def __init__(self, cfg, rank: int, kind: str) -> None:
        self.rank = rank
        self.rows = {
            i: spec
            for i, spec in enumerate(cfg.faults.events)
            if spec.die == rank and spec.kind == kind
        }
        self.began: dict[int, float] = {}

    def tick(self, comm, iteration: int, virtual_s: float, sends: list) -> None:
        """Start the rows whose iteration the die reached; tell the JE."""
        for i, spec in self.rows.items():
            if i in self.began or iteration < spec.iteration:
                continue
            self.began[i] = time.monotonic()
            began = FaultBegan(
                row=i,
                kind=spec.kind,
                die=self.rank,
                peer=spec.peer,
                iteration=iteration,
                wall=time.time(),
                virtual_s=virtual_s,
            )
            sends.append(comm.isend(began, dest=SHELL, tag=TAG_PD_FAULT_BEGAN))

    def _active(self, now: float):
        for i, spec in self.rows.items():
            start = self.began.get(i)
            if start is not None and (spec.duration_s == 0 or now < start + spec.duration_s):
                yield spec

    def is_link_down(self, peer: int) -> bool:
        now = time.monotonic()
        return any(spec.peer == peer for spec in self._active(now))

    def delay_s(self) -> float:
        """Seconds this (decode) die takes a transfer late now (0: not saturated)."""
        return max((spec.delay_s for spec in self._active(time.monotonic())), default=0.0)
