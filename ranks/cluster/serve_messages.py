"""The JE <-> TE-shell messages of `xds-mpi serve` on a cluster (docs/serve.md, "A cluster"), on
the link communicator.

JE -> TE-shell, TAG_CLUSTER_SERVE: one `Commands` per JE turn with news for that TE: the
endpoint's requests routed there (with their wall arrival), the cancels, and at the end the
shutdown, applied in that order. One tag for all three, so a cancel never overtakes its request.
TE-shell -> JE, TAG_CLUSTER_NEWS: one `TeNews` per TE-shell turn with news: the tokens of its
requests since the last, whether it serves and whether it fails over, and its gauges. At the
end the TE-shell sends its `TeResult` (ranks/cluster/messages.py) as in a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ranks.core.tags import TAG_CLUSTER_NEWS, TAG_CLUSTER_SERVE  # noqa: F401
from xds_mpi.workload.requests import Request


@dataclass(frozen=True, kw_only=True)
class Admit:
    """A request the JE routed to this TE; arrived_at: time.time() when the endpoint took it."""

    req: Request
    arrived_at: float


@dataclass(frozen=True, kw_only=True)
class Commands:
    """What the JE tells one TE-shell in one turn: admits first, then cancels (req_id, reason),
    then, once, shutdown (no request will come; serve what is open, then stop)."""

    admits: tuple[Admit, ...] = ()
    cancels: tuple[tuple[int, str], ...] = ()
    shutdown: bool = False


@dataclass(frozen=True, kw_only=True)
class TokenNews:
    """One request's news since the TE-shell's last message.

    tokens, token_times (time.time()), token_vtimes (its die's 910C clock): the tokens sampled
    since the last news, with their times. die_rank: its die's rank inside the TE (-1 before
    dispatch); dispatched_vtime: that die's virtual clock at dispatch (the projected TTFT's
    start). finished_at: time.time() of its end (0: open); ended: why it ended early (cancelled,
    rejected or its KV lost: the record's reason; "" otherwise)."""

    req_id: int
    tokens: tuple[int, ...]
    token_times: tuple[float, ...]
    token_vtimes: tuple[float, ...]
    die_rank: int
    dispatched_vtime: float
    finished_at: float
    ended: str


@dataclass(frozen=True, kw_only=True)
class DieTimes:
    """A token batch's timings for /metrics: die_rank inside the TE, its iteration's and its
    dispatch/combine's wall seconds, MTP drafts verified and accepted."""

    die_rank: int
    iteration_s: float
    xccl_s: float
    num_drafts: int
    num_accepted: int


@dataclass(frozen=True, kw_only=True)
class TeGauges:
    """A TE-shell's load as /metrics shows it: num_open: its requests not finished (queued or
    on a die); queued: the req_ids in its queue (not on a die); groups: its DP groups (die
    ranks inside the TE) serving now; kv_reserved: KV tokens reserved per group; kv_capacity:
    a group's KV tokens."""

    num_open: int
    queued: tuple[int, ...]
    groups: tuple[int, ...]
    kv_reserved: tuple[int, ...]
    kv_capacity: int


@dataclass(frozen=True, kw_only=True)
class TeNews:
    """A TE-shell's news: te: its index; is_ready: its dies are up and its loop turns;
    is_failing_over: a die of it was found silent and the others rebuild; num_detections: the
    failures its heartbeats found so far; requests, batches: since the last news; gauges: now."""

    te: int
    is_ready: bool
    is_failing_over: bool
    num_detections: int
    requests: tuple[TokenNews, ...]
    batches: tuple[DieTimes, ...]
    gauges: TeGauges
