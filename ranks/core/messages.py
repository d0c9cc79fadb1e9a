"""Control-plane messages between the TE-shell and the dies (the VPC plane: two-sided MPI).

TE-shell -> die: TAG_REQUEST (a list of Requests: those of one TE-shell turn), TAG_STOP (None:
finish when every die is idle), TAG_CANCEL (a req_id: drop it and free its KV; serve's
cancelled requests).
die -> TE-shell: TAG_TOKENS (TokenBatch, the output shortcut), TAG_REPORT (DieReport, once at
the end).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ranks.core.tags import TAG_CANCEL, TAG_REPORT, TAG_REQUEST, TAG_STOP, TAG_TOKENS  # noqa: F401
from xds_mpi.scheduling.scheduler import VerifiedDrafts

SHELL = 0  # the TE-shell's rank
JE = SHELL  # PD: the job executor takes the TE-shell's place (the decode TE-shell is rank 1)


@dataclass(frozen=True, kw_only=True)
class FaultBegan:
    """A die's note to its watcher (TAG_FAILURE_BEGAN): its injected `kind` fault
    (ranks/faults/) began at its iteration `iteration`, at wall time `wall_time` (time.time())
    and virtual second `virtual_s`. For the failure record only: detection never reads it."""

    die: int
    kind: str
    iteration: int
    wall_time: float
    virtual_s: float


@dataclass(frozen=True, kw_only=True)
class TokenBatch:
    """Tokens one die produced in one iteration: (req_id, token, is_finished) each."""

    die_rank: int
    iteration: int
    wall_time: float  # time.time() on the die when sampled
    tokens: tuple[tuple[int, int, bool], ...]
    steps: tuple[VerifiedDrafts, ...] = ()  # the decode steps that sampled them, in order
    vclock_s: float = 0.0  # the die's 910C virtual clock after the iteration (sum of vtime_s)
    iteration_s: float = 0.0  # the iteration's wall time (IterationTiming.total_s)
    xccl_s: float = 0.0  # of which dispatch + combine, waiting for peers included
    admitted_s: float = -1.0  # PD, virtual clock: a prefill's only token: its first step's start


@dataclass(frozen=True, kw_only=True)
class DieReport:
    die_rank: int
    num_iterations: int
    timings: dict = field(default_factory=dict)  # IterationTiming field -> list per iteration
    virtual_spent: dict = field(
        default_factory=dict
    )  # operation -> virtual seconds, all iterations
    recovery: dict = field(
        default_factory=dict
    )  # token recomputation (ranks/recovery/recompute.py)
    cancelled: dict = field(default_factory=dict)  # serve: requests dropped, KV blocks freed
    ems: dict = field(default_factory=dict)  # the EMS client's counts (ranks/ems/client.py)
    num_timings_dropped: int = 0  # the oldest iterations' timings let go (`serve --max-iterations`)
