"""The trace's way to the TE-shell: every traced rank sends its buffered events once, at the end
(one message), and the TE-shell gathers them to write the run's trace
(xds_mpi/report/trace_writer.py).
A rank that does not take part sends nothing; with run.trace off nobody sends."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mpi4py import MPI

from ranks.core.control import recv_from_each, send_to_each
from ranks.core.messages import SHELL
from ranks.core.tags import TAG_TRACE
from xds_mpi.report import trace
from xds_mpi.report.trace import SpanRecord

# The roles whose ranks send a trace. A role added later (prefill dies under PD) adds its name
# here and calls send_trace at the end of its program.
TRACED_ROLES = ("colocated", "attention", "expert")


@dataclass(frozen=True, kw_only=True)
class RankTrace:
    rank: int
    events: list[SpanRecord | tuple]  # as the rank kept them (trace.take_kept)


def send_trace(comm: MPI.Comm, *, timeout_s: float) -> None:
    """This rank's events to the TE-shell (bounded: the shell takes them after the reports)."""
    if not trace.is_enabled():
        return
    send_to_each(
        comm,
        {SHELL: RankTrace(rank=comm.rank, events=trace.take_kept())},
        tag=TAG_TRACE,
        timeout_s=timeout_s,
        me=f"rank {comm.rank}",
        event="trace",
    )


def traced_ranks(topo) -> tuple[int, ...]:
    return tuple(r for role in TRACED_ROLES for r in topo.ranks_with_role(role))


def gather_traces(
    comm: MPI.Comm,
    topo,
    *,
    timeout_s: float,
    skip: tuple[int, ...] = (),
    log: logging.Logger | None = None,
) -> dict[int, list[SpanRecord | tuple]]:
    """Every traced rank's events but those of `skip` (lost dies), by rank ({} with tracing
    off), as each rank kept them (`trace.as_records` makes them SpanRecords); with `log`, a
    progress line every 2 s."""
    if not trace.is_enabled():
        return {}
    received = recv_from_each(
        comm,
        [r for r in traced_ranks(topo) if r not in skip],
        tag=TAG_TRACE,
        timeout_s=timeout_s,
        me="TE-shell",
        event="trace",
        log=log,
    )
    if log is not None:
        for rank, message in sorted(received.items()):
            _log_cap(log, rank, message.events)
    return {rank: message.events for rank, message in received.items()}


def _log_cap(log: logging.Logger, rank: int, events: list) -> None:
    """Say that a rank dropped its oldest events (xds_mpi/report/trace.py `Tracer.trim`)."""
    note = events[0] if events else None
    if isinstance(note, SpanRecord) and note.name == "trace cap":
        log.info(
            "trace: rank %d kept its newest %d events, dropped %d older ones "
            "(max_events %d: xds-mpi serve --trace-max-events)",
            rank, len(events) - 1, note.args["dropped"], note.args["max_events"],
        )  # fmt: skip
