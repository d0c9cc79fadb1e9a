"""A prefill die lost (`faults.events` kind `dead`, or `stuck` for good, xDeepServe §6.1),
emulated on the die: at its iteration `iteration` (its n-th prefill batch) it leaves its event
loop. It answers no heartbeat, takes no request and sends no KV from then on; the process
stays alive (MPI aborts a job whose rank exits) and waits for the JE's stop at the end of the
run to leave cleanly. The two kinds look alike from outside (a silent die): the detector
(ranks/recovery/je_prefill_loss.py) names the die silent, not why.
"""

from __future__ import annotations

import time

from mpi4py import MPI

from ranks.core.control import WaitTimeout
from ranks.core.die_io import SHELL
from ranks.core.messages import TAG_STOP
from ranks.core.tags import TAG_PD_FAULT_BEGAN
from ranks.pd.channel import FaultBegan


class PrefillLoss:
    def __init__(self, cfg, rank: int) -> None:
        self.rank, self.timeout_s = rank, cfg.run.timeout_s
        rows = [
            (i, s) for i, s in enumerate(cfg.faults.events) if s.die == rank and s.kind in KINDS
        ]
        self.row, self.spec = rows[0] if rows else (-1, None)

    def is_due(self, iteration: int) -> bool:
        return self.spec is not None and iteration >= self.spec.iteration

    def play(self, comm, iteration: int, virtual_s: float) -> None:
        """Tell the JE when (for the record only), then stay silent until the run's stop."""
        began = FaultBegan(
            row=self.row,
            kind=self.spec.kind,
            die=self.rank,
            peer=-1,
            iteration=iteration,
            wall=time.time(),
            virtual_s=virtual_s,
        )
        comm.isend(began, dest=SHELL, tag=TAG_PD_FAULT_BEGAN).wait()
        deadline = time.monotonic() + self.timeout_s
        while (stop := comm.improbe(source=SHELL, tag=TAG_STOP)) is None:
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"prefill die rank {self.rank} ({self.spec.kind} since iteration "
                    f"{iteration}): no stop from the JE after run.timeout_s({self.timeout_s:g})"
                )
            time.sleep(0.01)
        stop.recv()
        # What reached the silent die meanwhile (requests, KV pulls) is dropped unread.
        while (msg := comm.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)) is not None:
            msg.recv()


KINDS = ("dead", "stuck")
