"""The TE-shell's failure detector for its decode dies (xDeepServe §6.1) and what follows a loss.

1. Heartbeats: the TE-shell pings every DP master (each colocated die) every
   health.dp_interval_s; a die answers from its event loop only (ranks/die_health.py), so a
   die stuck in an XCCL wait or an executor, or a dead one, falls silent. Silence is counted
   from the first answer of any die (the dies start serving together), so a die dead before
   its first answer is still caught.
2. A die silent for health.timeout_s is suspected. Its peers are silent too by then: they wait
   for it inside dispatch/combine or the agreement between iterations. The TE-shell fences:
   one word into every die's abort-word window (xccl/recovery.py), which every wait checks.
3. Released dies leave their waits and answer again within a few intervals; a die still
   silent after the grace (max(2 intervals, timeout_s / 2)) is lost. Watched for one more
   grace: answering again then makes it "stuck", else "dead".
4. Recovery by vertical scaling is not emulated yet: the run stops with an error naming the
   die(s) and verdicts, after writing the failure records (DecodeDieLost.write_failures).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from mpi4py import MPI

from ranks.context import RankContext
from ranks.die_health import FaultBegan
from ranks.failure_book import Detection, failure_records
from ranks.heartbeat import HeartbeatSender
from xccl.recovery import fence, fence_window
from xds_mpi.eplb.placement import Placement, remove_die
from xds_mpi.failures import FailureRecord, write_failures
from xds_mpi.tags import TAG_FAILURE_BEGAN

STOPPED = "none: vertical scaling is not emulated, the run stops"


class DecodeDieLost(RuntimeError):
    """A decode die was lost (or stuck past health.timeout_s); the run stops. records: the
    failure records, for the run file."""

    def __init__(self, message: str, records: list[FailureRecord]) -> None:
        super().__init__(message)
        self.records = records

    def write_failures(self, f) -> None:
        write_failures(f, self.records)


class Detector:
    def __init__(
        self, ctx: RankContext, groups: Sequence[int], placement: Callable[[], Placement]
    ) -> None:
        """placement(): the expert placement now (EPLB's, or the topology's static one)."""
        health = ctx.cfg.health
        self.ctx, self.comm, self.log = ctx, ctx.comm, ctx.log
        self.groups, self.timeout_s = tuple(groups), health.timeout_s
        self.grace_s = health.release_grace_s
        self.fence_mem = fence_window(ctx.comm)  # collective with the dies' Recovery window
        self.sender = HeartbeatSender(
            ctx.comm, groups, interval_s=health.dp_interval_s, timeout_s=health.timeout_s
        )
        self.began: dict[int, FaultBegan] = {}
        self.detection: Detection | None = None
        self.roles = {info.rank: info.role for info in ctx.topo.ranks if info.is_die}
        self.placement = placement

    def poll(self, requests: dict, started: float) -> int:
        """A turn of the TE-shell's loop: pings out, answers and notes in; on silence, step 2-4
        (raises DecodeDieLost). requests: the frontend's records; started: serving's start."""
        now = time.monotonic()
        self.sender.tick(now)
        self._take_notes()
        silent = self.sender.silent(now)
        if silent:
            self._fence_and_stop(silent, requests, started)
        return 0

    def records(self, requests: dict, started: float) -> list[FailureRecord]:
        cfg = self.ctx.cfg
        return failure_records(
            cfg, self.roles, self.began, requests, started=started, detection=self.detection
        )

    def close(self) -> None:
        """After the dies' responders closed: free the window with them, complete the pings."""
        self._take_notes()
        self.fence_mem.free()
        self.sender.close()

    def _take_notes(self) -> None:
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_FAILURE_BEGAN)) is not None:
            note: FaultBegan = msg.recv()
            self.began[note.die] = note

    def _fence_and_stop(self, silent: list[int], requests: dict, started: float) -> None:
        detected_at, fenced = time.time(), time.monotonic()
        # Step 2: release every die from its waits.
        fence(self.fence_mem, self.groups, 1)
        self.log.warning(
            "dies %s silent for more than health.timeout_s(%g) s; fenced every die",
            silent,
            self.timeout_s,
        )
        # Step 3: who answers again once released, and who only later.
        before = dict(self.sender.last_answer)
        back = self._answers_after(fenced, 2 * self.grace_s)
        lost = [d for d in self.groups if back.get(d, float("inf")) > fenced + self.grace_s]
        # The peers were silent too, waiting for the lost die; with none lost, the die silent
        # the longest is the one that was stuck.
        judged = lost or [min(silent, key=lambda d: before.get(d, 0.0))]
        verdicts = {d: "dead" if d not in back else "stuck" for d in judged}
        self.detection = Detection(wall_time=detected_at, verdicts=verdicts, recovery=STOPPED)
        self._take_notes()
        records = self.records(requests, started)
        for record in records:
            self.log.info(record.describe())
        named = ", ".join(f"die rank {d} ({v})" for d, v in verdicts.items())
        raise DecodeDieLost(
            f"{named} silent for more than health.timeout_s({self.timeout_s:g}) s; "
            f"{len(lost)} still silent {self.grace_s:g} s after the fence; "
            f"{self._expert_loss(judged)}",
            records,
        )

    def _expert_loss(self, dies: Sequence[int]) -> str:
        """What losing `dies` does to the experts, in words (the end of the stop message)."""
        placement, lost = self.placement(), []
        for die in dies:
            try:
                placement = remove_die(placement, self.ctx.topo.ranks[die].die_idx)
            except ValueError as exc:
                lost.append(f"die rank {die}: {exc}")
        if lost:
            return "health.on_expert_lost=stop: " + "; ".join(lost)
        return "every expert keeps a replica, but vertical scaling is not emulated: the run stops"

    def _answers_after(self, since: float, window_s: float) -> dict[int, float]:
        """die -> the first time it answered after `since`, watching for window_s seconds."""
        first: dict[int, float] = {}
        while (now := time.monotonic()) < since + window_s:
            self.sender.tick(now)
            for die, at in self.sender.last_answer.items():
                if at > since and die not in first:
                    first[die] = at
            time.sleep(0.005)
        return first
