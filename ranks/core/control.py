"""Bounded waits on the control plane (two-sided MPI between the TE-shell and the dies).

Control messages are the VPC plane, not UB, so they use ordinary pickled send/receive; but like
every wait in the project they poll with a deadline, yield the CPU between polls and then sleep
(xccl/wake.py Doze: ranks are oversubscribed), and on timeout name who waited for what from whom.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from mpi4py import MPI

from xccl.wake import Doze

PROGRESS_EVERY_S = 2.0  # seconds between two progress lines of a long wait that logs


class WaitTimeout(TimeoutError):
    """A bounded wait passed its deadline; the message names die/rank, peer and event."""


def recv_from_each(
    comm: MPI.Comm,
    peers: Iterable[int],
    *,
    tag: int,
    timeout_s: float,
    me: str,
    event: str,
    log: logging.Logger | None = None,
) -> dict[int, object]:
    """Receive one pickled message with `tag` from every peer, in any order, within `timeout_s`;
    with `log`, a line every PROGRESS_EVERY_S seconds saying how many have arrived."""
    pending = set(peers)
    total, received = len(pending), {}
    started = time.monotonic()
    deadline, next_line = started + timeout_s, started + PROGRESS_EVERY_S
    doze = Doze()
    while pending:
        got_one = False
        for peer in sorted(pending):
            message = comm.improbe(source=peer, tag=tag)
            if message is not None:
                received[peer] = message.recv()
                pending.discard(peer)
                got_one = True
        if got_one:
            doze.reset()
        elif pending:
            now = time.monotonic()
            if log is not None and now >= next_line:
                log.info("%s: %d of %d ranks (%.1f s)", event, len(received), total, now - started)
                next_line = now + PROGRESS_EVERY_S
            if now > deadline:
                raise WaitTimeout(
                    f"{me}: no {event} from rank(s) {sorted(pending)} after "
                    f"{timeout_s:g} s (got {len(received)} of "
                    f"{len(received) + len(pending)})"
                )
            doze.pause()
    return received


def send_to_each(
    comm: MPI.Comm, messages: dict[int, object], *, tag: int, timeout_s: float, me: str, event: str
) -> None:
    """Send a pickled message to each peer; complete all sends within `timeout_s`."""
    requests = {peer: comm.issend(obj, dest=peer, tag=tag) for peer, obj in messages.items()}
    deadline, doze = time.monotonic() + timeout_s, Doze()
    while requests:
        left = {peer: req for peer, req in requests.items() if not req.Test()}
        if len(left) < len(requests):
            doze.reset()
        requests = left
        if requests:
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"{me}: {event} not taken by rank(s) {sorted(requests)} after {timeout_s:g} s"
                )
            doze.pause()


def wait_all(
    requests: Sequence[MPI.Request],
    *,
    timeout_s: float,
    me: str,
    event: str,
    peers: Sequence[int] | None = None,
) -> None:
    """Complete every request within `timeout_s`, dozing between polls (MPI's Waitall spins at
    full speed, taking the cores the peers need to take the messages). `peers`: each request's
    peer, in the same order, named on timeout with `event`; without it the requests are named
    by their place in the list."""
    if peers is not None and len(peers) != len(requests):
        raise ValueError(f"wait_all: {len(peers)} peers for {len(requests)} requests")
    left = list(range(len(requests)))
    deadline, doze = time.monotonic() + timeout_s, Doze()
    while left:
        still = [i for i in left if not requests[i].Test()]
        if len(still) < len(left):
            doze.reset()
        left = still
        if left:
            if time.monotonic() > deadline:
                who = (
                    f"rank(s) {sorted({peers[i] for i in left})}"
                    if peers is not None
                    else f"request(s) {left} of {len(requests)}"
                )
                raise WaitTimeout(
                    f"{me}: {event}: {len(left)} of {len(requests)} not complete after "
                    f"{timeout_s:g} s ({who})"
                )
            doze.pause()
