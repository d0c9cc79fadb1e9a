"""The JE <-> TE-shell messages of a cluster (docs/cluster.md), on their link communicator.

JE -> every TE-shell, TAG_VTIME_GRANT: a `Grant` (ranks/core/vtime_messages.py) with the
requests routed to that TE, each with its routing time (`times`), and the *promise* as its
horizon: no request routed before it is still to come (inf: none is). TE-shell -> JE,
TAG_CLUSTER_FINISHED: (req_id, virtual finish s) of the requests its dies finished since the
last; then TAG_VTIME_CLOCK: a `ClockReport` once per grant, counting those messages. At the end
TAG_CLUSTER_RESULT: the TE's `TeResult`, to JE 0. With several JEs (cluster.num_jes), each
JE's grants and each TE-shell's reports and finishes go between every JE and every TE-shell, and
JE j > 0 hands JE 0 its `JeShare` at the end (TAG_CLUSTER_SHARE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ranks.core.tags import (  # noqa: F401
    TAG_CLUSTER_FINISHED,
    TAG_CLUSTER_POOL,
    TAG_CLUSTER_RESULT,
    TAG_CLUSTER_SHARE,
    TAG_CLUSTER_TE_LOST,
    TAG_POOL_GROUP,
    TAG_POOL_RANK,
    TAG_VTIME_CLOCK,
    TAG_VTIME_GRANT,
)

# On the link communicator only (JE and TE-shells), apart from every TE's own tags.


@dataclass(kw_only=True)
class TeResult:
    """What a TE-shell hands the JE once its TE has served: te: its index; status: "completed"
    or "failed: <why>"; records: req_id -> RequestRecord of the requests it served; admitted:
    req_id -> virtual admission; die_timings: its die rank (inside the TE) -> per-iteration
    timings; summary: its own summary (xds_mpi/results/results.py `summarize` and the
    projection); started: its serving's wall start; own: the TE's own run file (HDF5 bytes, as
    it would write it alone: its /pd, /failures, /slo, its own /summary, ...), which the JE keeps
    under /cluster/te<k>/ but for what it merges (/requests, /dies)."""

    te: int
    status: str
    records: dict = field(default_factory=dict)
    admitted: dict = field(default_factory=dict)
    die_timings: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    started: float = 0.0
    own: bytes = b""


@dataclass(frozen=True, kw_only=True)
class TeLost:
    """TE-shell -> each JE still routing (TAG_CLUSTER_TE_LOST): its dies cannot go on (a die lost
    whose experts had no other replica); at_s: the loss's virtual time (the fault's); why: the
    TE-shell's reason; num_batches: the finish messages sent to this JE before it, all to be
    taken first."""

    at_s: float
    why: str
    num_batches: int


@dataclass(kw_only=True)
class JeShare:
    """What JE j > 0 hands JE 0 once it routed its share (JE 0 writes the one run file):
    routed_s and te_of: req_id -> its routing (virtual s) and its TE; orphaned: req_id -> the lost
    TE it was first routed to; decisions: its decision log (xds_mpi/cluster/decisions.py)."""

    je: int
    routed_s: dict = field(default_factory=dict)
    te_of: dict = field(default_factory=dict)
    orphaned: dict = field(default_factory=dict)
    decisions: list = field(default_factory=list)


# The pool of ranks (docs/cluster.md "A pool of ranks"): JE -> a pool TE's TE-shell on the link,
# and JE -> a pool rank on the world, a `PoolActivation` at a scale-out (before the load order),
# a `PoolRelease` once a drained pool TE's ranks are given back; JE -> every pool rank at the
# end, a `PoolStop` (TAG_CLUSTER_POOL, TAG_POOL_RANK). A pool TE's communicator is made with
# TAG_POOL_GROUP (Comm.Create_group).


@dataclass(frozen=True, kw_only=True)
class PoolActivation:
    """Pool TE `te` is formed for scale event `event`: members: its world ranks, its TE-shell
    first and then its dies, die i (rank i inside the TE) on members[i]."""

    te: int
    event: int
    members: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class PoolRelease:
    """Pool TE `te` was drained (its last request finished by `at_s`, virtual): its dies free
    their windows and communicator and go back to the pool."""

    te: int
    at_s: float


@dataclass(frozen=True, kw_only=True)
class PoolStop:
    """The job's end: a pool rank leaves its loop."""
