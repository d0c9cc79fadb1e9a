"""The TE-shell's failure detector for its decode dies (xDeepServe §6.1) and what follows a loss.

1. Heartbeats: the TE-shell pings every DP master (each colocated or attention die; an afd
   deployment's expert dies too, ranks/core/decode_die.py) every
   health.dp_interval_s; a die answers from its event loop only (ranks/recovery/watch.py), so a
   die stuck in an XCCL wait or an executor, or a dead one, falls silent. Silence is counted
   from the first ping (the dies built their models before the window collective preceding
   it), so a die stuck before its first answer is caught too.
2. A die silent for health.timeout_s is suspected, or for 3x the longest gap seen between two
   answers when the dies are slower than that (watch.py PACE_FACTOR). Its peers are silent too
   by then: they wait for it inside dispatch/combine or the agreement between iterations. The
   TE-shell fences: one word into every die's abort-word window (xccl/recovery/rollback.py),
   which every wait checks.
3. Released dies leave their waits and answer again within a few intervals; a die still
   silent after the grace (max(2 intervals, timeout_s / 2)) is lost. Watched for one more
   grace: answering again then makes it "stuck", else "dead".
4. If every expert keeps a replica without the lost dies, the survivors go on without them
   (vertical scaling, ranks/recovery/scale_down.py and ranks/recovery/scale_down.py; with EPLB
   its newest placement is checked, the one the survivors install without the lost slots). Otherwise
   (health.on_expert_lost "stop") the run stops with an error naming the dies, their verdicts
   and, per MoE layer, the experts whose last replica they held, after writing the failure
   records (DecodeDieLost.write_failures).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mpi4py import MPI

from ranks.core.context import RankContext
from ranks.core.messages import FaultBegan
from ranks.core.tags import TAG_FAILURE_BEGAN
from ranks.recovery.records import Detection, failure_records, with_timeouts
from ranks.recovery.watch import PACE_FACTOR, HeartbeatSender
from xccl.recovery.rollback import fence, fence_window
from xds_mpi.eplb.placement import Placement, from_topology, remove_die
from xds_mpi.eplb.ring import ring_placement
from xds_mpi.results.failures import FailureRecord, write_failures


def static_placement(ctx) -> Placement:
    """The expert placement without EPLB, the one a loss is checked against then: the ring
    replicas' (health.replicas ring), else the topology's."""
    cfg = ctx.cfg  # the MoE layers EPLB would place: main ones, then the MTP layers
    num_moe_layers = cfg.model.num_layers - cfg.model.num_dense_layers + cfg.scheduler.mtp_depth
    place = ring_placement if cfg.health.replicas == "ring" else from_topology
    return place(ctx.topo, num_moe_layers)


@dataclass(frozen=True, kw_only=True)
class Loss:
    """What a fence found: lost, the dies to go on without (none: a stuck die came back);
    verdicts, die -> "dead" / "stuck"; detected_at, the fence's wall time (time.time())."""

    lost: tuple[int, ...]
    verdicts: dict[int, str]
    detected_at: float


def stopped(why_not: str) -> str:
    """The failure record's recovery text of a run that stops."""
    if why_not.startswith("health.on_expert_lost=stop"):
        return "none, the run stops: an expert lost its last replica (health.on_expert_lost=stop)"
    return f"none, the run stops: {why_not}"


# The fence's note when no die had answered yet (HeartbeatSender.patience_s).
NO_PACE_YET = "; no die had answered yet: the ceiling, the longest the peers' XCCL waits allow"


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
        self,
        ctx: RankContext,
        groups: Sequence[int],
        placement: Callable[[], Placement],
        window_comm: MPI.Comm | None = None,
    ) -> None:
        """groups: the DP masters (colocated or attention dies); an afd deployment's expert dies
        are watched too. placement(): the expert placement now (EPLB's, or the topology's).
        window_comm: what the fence window spans (default the world; PD: the decode TE-shell
        and its dies, ranks/recovery/watch.py watch_comm)."""
        health = ctx.cfg.health
        self.ctx, self.comm, self.log = ctx, ctx.comm, ctx.log
        groups = tuple(groups) + ctx.topo.ranks_with_role("expert")
        self.groups, self.timeout_s = groups, health.timeout_s
        self.grace_s = health.release_grace_s
        window_comm = ctx.comm if window_comm is None else window_comm
        self.fence_mem = fence_window(window_comm)  # collective with the dies' Recovery window
        in_window = MPI.Group.Translate_ranks(ctx.comm.group, list(groups), window_comm.group)
        self.window_rank = dict(zip(groups, in_window))  # world rank -> its rank in the window
        # The pace may stretch the patience only while the peers' XCCL waits outlast detection
        # and release (the bound xds_mpi/plan/failures/checks.py checks for timeout_s itself).
        ceiling = ctx.cfg.xccl.poll_timeout_s - health.dp_interval_s - 2 * self.grace_s
        self.sender = HeartbeatSender(
            ctx.comm,
            groups,
            interval_s=health.dp_interval_s,
            timeout_s=health.timeout_s,
            ceiling_s=ceiling,
        )
        self.patience_told = health.timeout_s  # the patience the log last named
        self.began: dict[int, FaultBegan] = {}
        self.detections: list[Detection] = []  # one per fence, in order
        self.roles = {info.rank: info.role for info in ctx.topo.ranks if info.is_die}
        self.placement = placement

    def poll(self, requests: dict, started: float) -> Loss | None:
        """A turn of the TE-shell's loop: pings out, answers and notes in; on silence, steps 2-3,
        and the dies to go on without (raises DecodeDieLost when the run cannot go on).
        requests: the frontend's records; started: serving's start (wall)."""
        silent = self.silent_dies()
        return self.fence(silent, requests, started) if silent else None

    def silent_dies(self) -> list[int]:
        """Step 1: pings out, answers and notes in; the dies silent past the patience."""
        now = time.monotonic()
        self.sender.tick(now)
        self._take_notes()
        self._tell_patience()
        return self.sender.silent(now)

    def _tell_patience(self) -> None:
        """Log when the dies' pace makes the detector wait longer than health.timeout_s (and
        again at every doubling): an emulated iteration can outlast the timeout."""
        patience = self.sender.patience_s
        doubled = 2.0 if self.patience_told > self.timeout_s else 1.0
        if self.sender.has_pace and patience > self.patience_told * doubled:
            self.patience_told = patience
            self.log.info(
                "heartbeat: a die answered %.1f s after its last answer; a die is now suspected "
                "after %.1f s of silence (%g x that; health.timeout_s %g)",
                self.sender.pace_s,
                patience,
                PACE_FACTOR,
                self.timeout_s,
            )

    def recovered(
        self, loss: Loss, recovery: str, affected: tuple[int, ...], detected_virtual_s=-1.0
    ) -> None:
        """The dies went on without `loss.lost` (ranks/recovery/scale_down.py): one detection
        more. detected_virtual_s: run.clock virtual, the detection priced on the virtual clock
        (-1: the wall clock's projection, records.py)."""
        for die in loss.lost:
            self.sender.forget(die)
        self.groups = tuple(g for g in self.groups if g not in loss.lost)
        self.detections.append(
            Detection(
                wall_time=loss.detected_at,
                verdicts=loss.verdicts,
                recovery=recovery,
                affected=affected,
                resumed_wall=time.time(),
                detected_virtual_s=detected_virtual_s,
            )
        )

    def records(
        self, requests: dict, started: float, recovery: dict | None = None
    ) -> list[FailureRecord]:
        """recovery: die rank -> its recomputation counters (timeouts recomputed), once known."""
        cfg = self.ctx.cfg
        records = failure_records(
            cfg, self.roles, self.began, requests, started=started, detections=self.detections
        )
        return with_timeouts(records, recovery or {}, self.roles, started)

    def close(self) -> None:
        """As the dies close: free the window with them (not after a failover: it spans the
        lost dies), take every live die's answers up to its last, complete the pings."""
        self._take_notes()
        if not self.detections:
            self.fence_mem.free()
        self.sender.close(timeout_s=self.ctx.cfg.xccl.poll_timeout_s, last_from=self.groups)
        self._take_notes()  # sent before their last answers

    def _take_notes(self) -> None:
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_FAILURE_BEGAN)) is not None:
            note: FaultBegan = msg.recv()
            self.began[note.die] = note

    def fence(self, silent: list[int], requests: dict, started: float) -> Loss:
        """Steps 2-3 on `silent` (from `silent_dies`): fence, judge; the dies to go on without
        (raises DecodeDieLost when the run cannot go on)."""
        detected_at, fenced = time.time(), time.monotonic()
        silence = max(self.sender.silence_s(d, fenced) for d in silent)
        # Step 2: release every die from its waits.
        fence(self.fence_mem, [self.window_rank[g] for g in self.groups], len(self.detections) + 1)
        self.sender.restart_pace(fenced)
        self.log.warning(
            "dies %s silent for more than %g s (health.timeout_s %g%s); fenced every die",
            silent,
            self.sender.patience_s,
            self.timeout_s,
            "" if self.sender.has_pace else NO_PACE_YET,
        )
        # Step 3: who answers again once released, and who only later.
        back = self._answers_after(fenced, 2 * self.grace_s)
        lost = [d for d in self.groups if back.get(d, float("inf")) > fenced + self.grace_s]
        if not lost:  # every die answered again: slow, not lost; the recompute is as slow
            self.sender.count_silence(silence)
        # The peers were silent too, waiting for the lost die, and answer at once when
        # released; with none lost, the die that answered last was the stuck one.
        judged = lost or [max(back, key=back.get)]
        verdicts = {d: "dead" if d not in back else "stuck" for d in judged}
        self._take_notes()
        why_not = self._why_not_scale(lost)
        if why_not:
            self._stop(
                Detection(wall_time=detected_at, verdicts=verdicts, recovery=stopped(why_not)),
                lost,
                why_not,
                requests,
                started,
            )
        return Loss(lost=tuple(lost), verdicts=verdicts, detected_at=detected_at)

    def _stop(self, detection, lost, why_not: str, requests: dict, started: float) -> None:
        self.detections.append(detection)
        records = self.records(requests, started)
        for record in records:
            self.log.info(record.describe())
        named = ", ".join(f"die rank {d} ({v})" for d, v in detection.verdicts.items())
        raise DecodeDieLost(
            f"{named} silent for more than {self.sender.patience_s:g} s "
            f"(health.timeout_s {self.timeout_s:g}); "
            f"{len(lost)} still silent {self.grace_s:g} s after the fence; {why_not}",
            records,
        )

    def _why_not_scale(self, lost: Sequence[int]) -> str:
        """Why the dies cannot go on without `lost` ("" when they can)."""
        expert_loss = self._expert_loss(lost)
        if expert_loss:
            return expert_loss
        if all(d in lost for d in self.groups if self.roles[d] != "expert"):
            return "no decode die is left: the run stops"
        return ""

    def _expert_loss(self, dies: Sequence[int]) -> str:
        """What losing `dies` does to the experts, in words (the end of the stop message)."""
        placement, lost = self.placement(), []
        for die in dies:
            if not self.ctx.topo.ranks[die].expert_slots:  # an afd attention die hosts none
                continue
            try:
                placement = remove_die(placement, self.ctx.topo.ranks[die].die_idx)
            except ValueError as exc:
                lost.append(f"die rank {die}: {exc}")
        return "health.on_expert_lost=stop: " + "; ".join(lost) if lost else ""

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
