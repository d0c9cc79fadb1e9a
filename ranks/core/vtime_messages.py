"""Virtual-time serving's control-plane messages (run.clock virtual, docs/virtual_time.md).

TE-shell -> every die, TAG_VTIME_GRANT: a `Grant` (the requests decided for this die, the new
horizon, the warp). Die -> TE-shell, TAG_VTIME_CLOCK: a `ClockReport`, once per grant: parked at
the horizon, or with no work of its own left.
"""

from __future__ import annotations

from dataclasses import dataclass

from ranks.core.tags import TAG_VTIME_CLOCK, TAG_VTIME_GRANT  # noqa: F401
from xds_mpi.workload.requests import Request


@dataclass(frozen=True, kw_only=True)
class Grant:
    """seq: the grant's number (1, 2, ...; a die starts at 0 with horizon 0, nothing granted);
    requests: those decided for this die, in order (PD's decode dies: their PdTasks); horizon_s:
    iterations starting before this virtual time may run (inf: no request left to decide);
    warp_s: an idle die's clock jumps to it (-inf: none); times: PD's prefill leader: each
    request's decision, its virtual arrival in the TE's pool (empty otherwise)."""

    seq: int
    requests: tuple[Request, ...]
    horizon_s: float
    warp_s: float
    times: tuple[float, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ClockReport:
    """die_rank: the die; seq: the grant it answers; start_s: the virtual start of the die's next
    iteration (the dies' common start, xds_mpi/scheduling/admission.py); is_idle: no request of its
    own waiting or running, so it emits nothing until the next grant; num_batches: token batches
    it sent so far (the TE-shell takes them all before deciding; PD: a prefill TE's messages to
    the JE, a decode die's completions to the decode TE-shell); admitted: (req_id, virtual
    admission s) of the requests it admitted since its last report."""

    die_rank: int
    seq: int
    start_s: float
    is_idle: bool
    num_batches: int
    admitted: tuple[tuple[int, float], ...] = ()
