"""Control-plane messages of disaggregated prefill-decode (xDeepServe §5.1), beside
ranks/core/messages.py's: the data (the KV cache) moves over XCCL p2p, never here.

JE -> prefill leader: TAG_REQUEST (a Request, into the shared pending pool; step 1).
prefill die -> JE: TAG_PD_PREFILLED (a PdTask: metadata and block addresses only; step 3), or
  TAG_TOKENS for a request its first token already ends.
JE -> decode TE-shell -> decode die: TAG_PD_TASK (the PdTask; the TE-shell's balancer picks the
  DP group; steps 4-5). Without a decode TE-shell rank the JE runs that balancer itself. On the
  virtual clock the JE sends the decode TE-shell `Promised` batches instead, and the decode
  TE-shell hands the tasks to the dies inside its grants (ranks/shell/pd_pacers.py).
decode die -> decode TE-shell: TAG_PD_DONE (request ids finished: completions for balancing).
decode TE-shell -> JE: TAG_PD_LOSS_BOUND (LossBound, virtual clock with a decode die that may be
  lost: how early a decode loss could still send the JE a request to prefill again).
decode die -> prefill die: TAG_PD_PULL (KvPull: the irecv is posted, send now; step 6).
decode die -> JE: TAG_PD_TRANSFER (KvTransferDone: the transfer's numbers, for the TTFT split).
prefill and decode die -> JE: TAG_PD_READY (None: built, the JE's clock may start).
prefill die -> JE: TAG_REPORT (PrefillReport, once at the end, after TAG_STOP).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ranks.core.tags import (  # noqa: F401
    TAG_PD_DONE,
    TAG_PD_LOSS_BOUND,
    TAG_PD_PREFILLED,
    TAG_PD_PULL,
    TAG_PD_READY,
    TAG_PD_TASK,
    TAG_PD_TRANSFER,
)


@dataclass(frozen=True, kw_only=True)
class KvPull:
    """The decode die posted its irecv for request req_id: the prefill die may isend."""

    req_id: int
    decode_rank: int
    attempt: int = 0  # 0, then one more per retry after a failed transfer


@dataclass(frozen=True, kw_only=True)
class KvTransferDone:
    """A completed KV transfer as the decode die saw it. deferred_s: wall seconds the task
    waited for free KV blocks (backpressure); transfer_s: irecv posted -> completed (wall);
    transfer_v: its virtual seconds at the cost shape; nbytes: tiny-model bytes moved;
    first_step_v: virtual seconds of the decode iteration that streamed the first token;
    num_retries: attempts after the first; num_recv_faults: of them, failed at this die."""

    req_id: int
    decode_rank: int
    received_at: float
    posted_at: float
    completed_at: float
    nbytes: int
    transfer_v: float
    num_deferred: int
    num_retries: int
    num_recv_faults: int = 0
    first_step_v: float = 0.0


@dataclass(frozen=True, kw_only=True)
class PrefillReport:
    """A prefill die's run: iterations, virtual seconds per operation, KV transfers sent,
    bytes and wall seconds spent in them, pulls that were retries, faults injected here."""

    die_rank: int
    num_iterations: int
    virtual_spent: dict = field(default_factory=dict)
    num_sent: int = 0
    bytes_sent: int = 0
    send_wall_s: float = 0.0
    num_send_retries: int = 0
    num_faults: int = 0
    ems: dict = field(default_factory=dict)  # the EMS context cache's counts (ranks/ems/client.py)


@dataclass(frozen=True, kw_only=True)
class Promised:
    """Virtual clock, JE -> decode TE-shell (TAG_PD_TASK): prefilled tasks (Routed) and the
    promise that no task whose prefill ends before `promise_s` (virtual s) is still to come."""

    routed: tuple
    promise_s: float
    num_losses: int = 0  # decode losses the JE has handled (their moved tasks are in, or before)


@dataclass(frozen=True, kw_only=True)
class LossBound:
    """Virtual clock, decode TE-shell -> JE: no decode loss can send the JE a request to prefill
    again that arrives before `bound_s` (virtual s: the earliest a decode die may still be lost,
    plus the failover's price); valid once the JE has handled `num_losses` decode losses."""

    bound_s: float
    num_losses: int
