"""A decode die of a PD run lost, from the decode TE-shell (xDeepServe §6.1 detection, §6.2 "P/D
separate failover": the decode side recovers on its own, prefill goes on).

The decode TE-shell (host rank 1) runs the TE-shell's detector (ranks/recovery/detector.py) over its
decode dies: heartbeats answered from the dies' event loops, the fence through a window over the
decode TE-shell and the decode dies only (ranks/recovery/watch.py watch_comm), the same verdicts.
An afd decode side's dies are watched as the afd TE-shell watches them without PD: the attention
dies (its DP groups) and the expert dies, whose A2E/E2A waits the fence releases too; a lost
attention die's DP domain goes on with the attention dies it has left. On a loss:
  1. the survivors rebuild without the lost die (vertical scaling, ranks/recovery/scale_down.py, via
     ranks/recovery/scale_down.py rebuild) and say how many token batches they sent;
  2. the lost die leaves the decode balancer: no task goes there any more; the requests routed
     to it and not finished (the decode TE-shell's view) are named to the JE (DecodeLoss), with
     the survivors' batch counts, so that the JE has their tokens before it moves them
     (ranks/recovery/je_decode_loss.py: re-routed when their prefill die still holds the KV, else
     prefilled again with the tokens emitted so far).
On the virtual clock (run.clock virtual) the decode TE-shell's pacer does step 2 (it holds the
balancer there, ranks/shell/pd_pacers.py DecodePacer.lose) and prices the failover as the
colocated TE-shell does: the survivors resume at the fault plus FailoverCost, the time the JE
moves the requests at (DecodeLoss.resumed_s).
At the JE's stop the decode TE-shell hands the JE its detections and the dies' notes
(DecodeBook): the JE holds the request records the failure records need.
"""

from __future__ import annotations

from dataclasses import dataclass

from ranks.core.control import wait_all
from ranks.core.messages import JE
from ranks.core.tags import TAG_PD_DECODE_BOOK, TAG_PD_DECODE_LOST
from ranks.recovery.detector import Detector, Loss, static_placement
from ranks.recovery.scale_down import rebuild
from ranks.recovery.watch import is_watched, watch_comm
from xds_mpi.plan.failures.loss import FailoverCost


@dataclass(frozen=True, kw_only=True)
class DecodeLoss:
    """Decode TE-shell -> JE: the lost decode dies, each survivor's token batches sent so far,
    the requests routed to the lost dies and not finished, the decode dies before and after."""

    lost: tuple[int, ...]
    batches: dict[int, int]
    orphans: tuple[int, ...]
    before: int
    after: int
    detected_at: float
    resumed_s: float = -1.0  # virtual clock: the survivors' resumption (-1: the wall clock)
    dies: str = "decode"  # what the DP groups are: "decode" (colocated) or "attention" (afd)


@dataclass(frozen=True, kw_only=True)
class DecodeBook:
    """Decode TE-shell -> JE at the end: the dies' fault notes and the detector's detections."""

    began: dict
    detections: list


class DecodeWatch:
    """The decode TE-shell's detector and its side of the failover (none when unwatched)."""

    def __init__(self, shell) -> None:
        ctx = shell.ctx
        self.shell, self.comm, self.detector = shell, ctx.comm, None
        self.sends: list = []
        self.timeout_s = ctx.cfg.xccl.poll_timeout_s  # completing the sends at the end
        if is_watched(ctx.cfg, ctx.plan):
            groups = ctx.plan.pd.decode
            self.detector = Detector(ctx, groups, self.placement, watch_comm(ctx))

    def placement(self):
        """The expert placement now: the static one (a PD run balances with no EPLB)."""
        return static_placement(self.shell.ctx)

    @property
    def has_failed_over(self) -> bool:
        return self.detector is not None and bool(self.detector.detections)

    def poll(self, started: float) -> None:
        if self.detector is None:
            return
        loss = self.detector.poll({}, started)  # records are the JE's
        if loss is not None:
            self._scale_down(loss)

    def _scale_down(self, loss: Loss) -> None:
        shell, cfg = self.shell, self.shell.ctx.cfg
        pacer = shell.virtual
        balancer = shell.balancer if pacer is None else pacer.balancer
        before = len(balancer.groups)
        ready, _ = rebuild(self.comm, cfg, self.detector, loss, me="decode TE-shell")  # Step 1
        orphans: list[int] = []  # Step 2
        priced = None  # virtual clock: (fault, resumption) s
        if pacer is not None:
            orphans, fault_s, resumed_s = pacer.lose(loss.lost, ready)
            priced = (fault_s, resumed_s)
            self._log_priced(fault_s, resumed_s)
        else:
            for die in loss.lost:
                orphans += balancer.remove_group(die)
        message = DecodeLoss(
            lost=loss.lost,
            batches={g: r.num_batches for g, r in ready.items()},
            orphans=tuple(sorted(orphans)),
            before=before,
            after=len(balancer.groups),
            detected_at=loss.detected_at,
            resumed_s=priced[1] if priced else -1.0,
            dies="attention" if cfg.deployment.kind == "afd" else "decode",
        )
        self.sends.append(self.comm.isend(message, dest=JE, tag=TAG_PD_DECODE_LOST))
        recovery = (
            f"vertical scaling: {before} -> {message.after} {message.dies} dies; {len(orphans)} "
            "requests moved by the JE"
        )
        if not loss.lost:  # a stuck die back within the grace (refused before launch in PD)
            recovery = (
                f"buffers rebuilt on all {len(ready)} dies; the interrupted iteration recomputed"
            )
        shell.ctx.log.warning("decode failover: %s", recovery)
        detected_s = priced[0] + FailoverCost.of(cfg.health).detection_s if priced else -1.0
        self.detector.recovered(loss, recovery, message.orphans, detected_s)

    def _log_priced(self, fault_s: float, resumed_s: float) -> None:
        cost = FailoverCost.of(self.shell.ctx.cfg.health)
        self.shell.ctx.log.warning(
            "decode failover on the virtual clock: fault at %.6f s; detection %g s, release %g "
            "s, rebuild %g s (xds_mpi/plan/failures/loss.py); the survivors resume at %.6f s",
            fault_s,
            cost.detection_s,
            cost.release_s,
            cost.rebuild_s,
            resumed_s,
        )

    def close(self) -> None:
        """At the JE's stop (the dies' responders closed): the book to the JE, the pings done."""
        if self.detector is not None:
            self.detector.close()
            book = DecodeBook(began=self.detector.began, detections=self.detector.detections)
            self.sends.append(self.comm.isend(book, dest=JE, tag=TAG_PD_DECODE_BOOK))
        # The losses and the book: the JE takes them before its own stop (the stop path's bound).
        wait_all(
            self.sends,
            timeout_s=self.timeout_s,
            me="decode TE-shell",
            event=f"decode losses to the JE (rank {JE})",
        )
