"""The TE-shell's side of vertical scaling (xDeepServe §6.2 stage 2: "we reduce the number of DP
groups and EP ranks, allowing decode to proceed with fewer NPUs"), after its detector found lost
dies whose experts all keep a replica (ranks/recovery/detector.py).

  1. Every surviving die is told which dies are lost; each rebuilds its communicator, window,
     XCCL buffers and expert placement without them (ranks/recovery/die_failover.py) and says how
     many
     token batches it has sent. With EPLB, the TE-shell's EPLB agent drops the lost dies first
     and the message carries its placement without their slots (ranks/shell/eplb.py).
  2. The TE-shell takes every one of those batches, so that what each request emitted is known.
  3. The lost dies' unfinished requests are re-prefilled on the other DP groups: the prompt and
     every token already emitted, continued to the same max_new_tokens (greedy decoding of the
     same prefix gives the same next tokens, which `--check` verifies against the reference).
"""

from __future__ import annotations

import time
from dataclasses import replace

from ranks.recovery.detector import Loss
from ranks.recovery.die_failover import Failover
from xds_mpi.control import WaitTimeout, recv_from_each, send_to_each
from xds_mpi.plan.failures import release_bound_s
from xds_mpi.tags import TAG_FAILOVER, TAG_FAILOVER_READY


def scale_down(frontend, loss: Loss) -> None:
    """Steps 1-3 on the TE-shell's Frontend (ranks/shell/frontend.py); the detector records it."""
    before = len(frontend.groups)
    # With EPLB: its newest placement without the lost dies' slots, as its next version.
    eplb = frontend.eplb.scale_down(loss.lost)
    placement, version = eplb if eplb is not None else (None, 0)
    failover = Failover(lost=loss.lost, eplb_placement=placement, eplb_version=version)
    comm, cfg = frontend.comm, frontend.ctx.cfg
    ready, timeout_s = rebuild(comm, cfg, frontend.detector, loss, failover=failover)  # Step 1
    take_batches(frontend, {g: r.num_batches for g, r in ready.items()}, timeout_s)  # Step 2
    orphans: list[int] = []  # Step 3
    for die in loss.lost:
        if die in frontend.groups:  # a DP group (an afd expert die serves no requests)
            orphans += frontend.balancer.remove_group(die)
    frontend.groups = tuple(g for g in frontend.groups if g not in loss.lost)
    frontend.lost = frontend.lost + loss.lost
    for req_id in sorted(orphans, reverse=True):
        frontend.queue.appendleft(resumed(frontend.records[req_id]))
    recovery = _recovery(frontend, loss, before, len(orphans), len(ready))
    frontend.log.warning("failover: %s", recovery)
    frontend.detector.recovered(loss, recovery, tuple(sorted(orphans)))


def rebuild(
    comm, cfg, detector, loss: Loss, me: str = "TE-shell", failover: Failover | None = None
) -> tuple[dict, float]:
    """Step 1: every surviving watched die (the DP groups, an afd deployment's expert dies)
    rebuilds without `loss.lost`; (die -> its Ready, the timeout the failover's waits use).
    failover: the message (default: the lost dies alone, no EPLB placement)."""
    # The survivors' rebuild is no XCCL wait: a short poll timeout (faults.on_timeout
    # recompute) does not bound it.
    timeout_s = max(cfg.xccl.poll_timeout_s, release_bound_s(cfg.health))
    survivors = tuple(g for g in detector.groups if g not in loss.lost)
    opts = {"tag": TAG_FAILOVER, "timeout_s": timeout_s, "me": me, "event": "failover"}
    failover = Failover(lost=loss.lost) if failover is None else failover
    send_to_each(comm, dict.fromkeys(survivors, failover), **opts)
    opts = {**opts, "tag": TAG_FAILOVER_READY, "event": "failover ready"}
    return recv_from_each(comm, survivors, **opts), timeout_s


def _recovery(frontend, loss: Loss, before: int, num_orphans: int, num_left: int) -> str:
    """What the failover did, in words."""
    if not loss.lost:
        return f"buffers rebuilt on all {num_left} dies; the interrupted iteration recomputed"
    experts = frontend.ctx.topo.ranks_with_role("expert")
    if any(d in experts for d in loss.lost):  # afd: the expert dies' slots
        return (
            f"vertical scaling: {len(experts)} -> {len(experts) - len(loss.lost)} expert dies; "
            "their slots removed, every expert kept a replica"
        )
    kind = "attention" if frontend.ctx.cfg.deployment.kind == "afd" else "decode"
    return (
        f"vertical scaling: {before} -> {len(frontend.groups)} {kind} dies; "
        f"{num_orphans} requests re-prefilled on other DP groups"
    )


def resumed(record):
    """A lost request again: its prompt and the tokens it emitted, the rest still to come."""
    req = record.req
    return replace(
        req,
        prompt=tuple(req.prompt) + tuple(record.tokens),
        max_new_tokens=req.max_new_tokens - len(record.tokens),
    )


def take_batches(frontend, expected: dict[int, int], timeout_s: float) -> None:
    """Take token batches until each die's count reached `expected` (die rank -> batches)."""
    deadline = time.monotonic() + timeout_s
    while any(frontend.batches_from[g] < n for g, n in expected.items()):
        if not frontend._take_tokens():
            time.sleep(0.0005)
        if time.monotonic() > deadline:
            missing = {g: n - frontend.batches_from[g] for g, n in expected.items()}
            raise WaitTimeout(
                f"{type(frontend).__name__}: failover: token batches still missing after "
                f"{timeout_s:g} s (die rank -> batches): {missing}"
            )
