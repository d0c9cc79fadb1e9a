"""Failures beyond transient XCCL errors (xDeepServe §6.1-6.2): the `faults.events` rows and the
`health` section (heartbeats, link probing, what to do when an expert has no replica left).

Part of the config schema (`xds_mpi.config.schema` re-exports it). The rows are checked here one by
one (types, ranges, which fields a kind takes); against the deployment (does the die exist, does the
kind apply to its role, do two rows overlap) in `xds_mpi/plan/deployment.py` `check_failures`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.loader import build_record, non_negative, positive, require

# stuck: the die blocks inside an operation (process alive) for duration_s (0 = for good).
# dead: the die stops taking part until the run ends (a live process: MPI aborts a job whose rank
#   exits). link: every KV transfer between prefill die `die` and decode die `peer` is dropped.
# saturated: decode die `die` takes each KV transfer delay_s late. memory: KV blocks
#   [first_block, first_block + num_blocks) of die `die`, or expert slot `slot`, become faulty.
FAILURE_KINDS = ("stuck", "dead", "link", "saturated", "memory")
# The kinds a row may time by `at_s` (virtual seconds) instead of `iteration`: a colocated die's
# (ranks/faults/dead.py, ranks/faults/stuck.py), on the virtual clock.
AT_S_KINDS = ("stuck", "dead")
# The roles (xds_mpi/plan/topology.py Role) each kind can hit; `link` and `saturated` need PD.
KIND_ROLES = {
    "stuck": ("prefill", "colocated", "attention", "expert"),
    "dead": ("prefill", "colocated", "attention", "expert"),
    "link": ("prefill",),
    "saturated": ("colocated", "attention"),
    "memory": ("colocated", "attention", "expert"),
}


@dataclass(frozen=True, kw_only=True)
class FailureSpec:
    """One row of `faults.events`: `kind` hits die rank `die` at its iteration `iteration` (the
    run's n-th iteration with work, from 0, as in faults.table; a prefill die's n-th prefill
    batch), or, stuck and dead rows on the virtual clock (run.clock virtual), at virtual time
    `at_s`: the first iteration whose virtual start is at or after it (docs/virtual_time.md);
    a row gives one of the two. duration_s: wall seconds a stuck / link / saturated fault
    lasts (0 = to the end of the run). peer: link only, the decode die at the other end.
    delay_s: saturated only. first_block, num_blocks: memory, a range of the die's KV blocks;
    slot: memory, one of the die's expert slots (its index in the die's slot list) instead."""

    kind: str
    die: int
    iteration: int | None = None
    at_s: float | None = None
    duration_s: float = 0.0
    peer: int = -1
    delay_s: float = 0.0
    first_block: int = -1
    num_blocks: int = 0
    slot: int = -1

    @property
    def is_permanent(self) -> bool:
        return self.kind in ("dead", "memory") or self.duration_s == 0


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """Failure detection and recovery (xDeepServe §6.1, §6.2 stages 1-2).

    control_interval_s: the control plane's heartbeat to each TE-shell; dp_interval_s: the
    TE-shell's heartbeat to each DP group's master (decoupled, as in §6.1). A die answers only
    from its event loop, between iterations; one silent for timeout_s is suspected, or for 3x
    the longest gap the dies showed between two answers when that is longer (an emulated
    iteration at pod width outlasts any fixed timeout: ranks/recovery/watch.py PACE_FACTOR).
    probe_interval_s / probe_timeout_s: link probing of the KV-transfer path with dummy payloads
    (ranks/recovery/link_probe.py): a pair whose KV send has made no progress for probe_interval_s
    gets a dummy; no echo within probe_timeout_s is a link fault, an echo later than probe_slow_s a
    saturated decode die (probe_slow_s must exceed a decode iteration, the echo waits for one).
    on_expert_lost: when a lost die held the last replica of an expert, "restart" the decode side
    from the config on the remaining dies (stage 1) or "stop" with an error naming expert and die.
    replicas: "ring" fills each routed die's redundant slots, from the start, with copies of the
    next routed die's experts, so that losing any one die keeps a replica of every expert
    (vertical scaling, ranks/recovery/scale_down.py); "none" leaves them to EPLB.
    """

    enabled: bool = True
    control_interval_s: float = 0.5
    dp_interval_s: float = 0.2
    timeout_s: float = 10.0
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 5.0
    probe_slow_s: float = 1.0
    on_expert_lost: Literal["restart", "stop"] = "stop"
    replicas: Literal["none", "ring"] = "none"

    @property
    def release_grace_s(self) -> float:
        """How long the TE-shell waits, after fencing the dies, for the released ones to answer
        (and once more, to tell a stuck die from a dead one): ranks/recovery/detector.py."""
        return max(2 * self.dp_interval_s, self.timeout_s / 2)

    def __post_init__(self) -> None:
        positive(
            "health",
            control_interval_s=self.control_interval_s,
            dp_interval_s=self.dp_interval_s,
            timeout_s=self.timeout_s,
            probe_interval_s=self.probe_interval_s,
            probe_timeout_s=self.probe_timeout_s,
            probe_slow_s=self.probe_slow_s,
        )
        require(
            self.probe_slow_s < self.probe_timeout_s,
            f"health.probe_slow_s({self.probe_slow_s}) must be below health.probe_timeout_s"
            f"({self.probe_timeout_s}): a delayed echo would be taken for a lost one",
        )
        slowest = max(self.control_interval_s, self.dp_interval_s)
        require(
            self.timeout_s > 2 * slowest,
            f"health.timeout_s({self.timeout_s}) must exceed two heartbeat intervals "
            f"(control_interval_s {self.control_interval_s}, dp_interval_s "
            f"{self.dp_interval_s}): a healthy die would be suspected",
        )


def failure_rows(rows: list) -> list[FailureSpec]:
    """`faults.events` read and checked row by row."""
    return [_failure_row(i, row) for i, row in enumerate(rows)]


def _failure_row(index: int, row) -> FailureSpec:
    where = f"faults.events[{index}]"
    spec = row if isinstance(row, FailureSpec) else build_record(FailureSpec, row, where)
    require(
        spec.kind in FAILURE_KINDS,
        f"{where}.kind: unknown kind {spec.kind!r} (known: {', '.join(FAILURE_KINDS)})",
    )
    non_negative(
        where,
        die=spec.die,
        **({"iteration": spec.iteration} if spec.iteration is not None else {}),
        **({"at_s": spec.at_s} if spec.at_s is not None else {}),
        duration_s=spec.duration_s,
        delay_s=spec.delay_s,
        num_blocks=spec.num_blocks,
    )
    _check_kind_fields(where, spec)
    _check_when(where, spec)
    return spec


def _check_when(where: str, spec: FailureSpec) -> None:
    """A row says when by `iteration` or by `at_s`: one of the two."""
    require(
        spec.iteration is None or spec.at_s is None,
        f"{where}: gives both iteration({spec.iteration}) and at_s({spec.at_s}); give one: "
        "iteration (the n-th iteration with work, from 0) or at_s (virtual seconds, "
        "run.clock virtual)",
    )
    require(
        spec.iteration is not None or spec.at_s is not None,
        f"{where}: needs iteration (the n-th iteration with work, from 0) or at_s (virtual "
        "seconds, run.clock virtual)",
    )
    require(
        spec.at_s is None or spec.kind in AT_S_KINDS,
        f"{where}.at_s: a {spec.kind} row takes iteration, not at_s (at_s is built for "
        f"{' and '.join(AT_S_KINDS)} rows)",
    )


def _check_kind_fields(where: str, spec: FailureSpec) -> None:
    """Each kind takes its own fields and no other's, so a typo is not silently ignored."""
    takes = {
        "stuck": {"duration_s"},
        "dead": set(),
        "link": {"duration_s", "peer"},
        "saturated": {"duration_s", "delay_s"},
        "memory": {"first_block", "num_blocks", "slot"},
    }[spec.kind]
    given = {
        "duration_s": spec.duration_s != 0,
        "peer": spec.peer != -1,
        "delay_s": spec.delay_s != 0,
        "first_block": spec.first_block != -1,
        "num_blocks": spec.num_blocks != 0,
        "slot": spec.slot != -1,
    }
    extra = sorted(name for name, is_set in given.items() if is_set and name not in takes)
    require(not extra, f"{where}: a {spec.kind} fault takes no {', '.join(extra)}")
    if spec.kind == "link":
        require(spec.peer >= 0, f"{where}: a link fault needs peer (the decode die's rank)")
    if spec.kind == "saturated":
        require(spec.delay_s > 0, f"{where}: a saturated fault needs delay_s > 0")
    if spec.kind == "memory":
        is_blocks, is_slot = spec.first_block >= 0 and spec.num_blocks > 0, spec.slot >= 0
        require(
            is_blocks != is_slot,
            f"{where}: a memory fault names either a KV block range (first_block >= 0, "
            f"num_blocks > 0) or an expert slot (slot >= 0), got first_block="
            f"{spec.first_block}, num_blocks={spec.num_blocks}, slot={spec.slot}",
        )
