"""The `faults` section: injected transient XCCL errors and the table that declares them.

Part of the config schema (`xds_mpi.config.schema` re-exports it);
`xds_mpi.execution.faults.FaultPlan` turns it into per-die decisions. Rows are read with the
loader's key and type checks like any section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xccl.recovery.faults import OPS as FAULT_OPS  # the operations XCCL can fail: one definition
from xds_mpi.config.failures import failure_rows
from xds_mpi.config.loader import build_record, non_negative, require

# What faults.rate counts: per XCCL call (the chance it fails), per die and iteration, or per die
# and hour of the pod's virtual clock (expected faults).
RATE_UNITS = ("call", "iteration", "die_hour")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One row of the fault table: die `die` fails operation `op` at MoE layer `layer` of
    iteration `iteration` with error `code`, on `times` consecutive attempts (1 = transient)."""

    die: int
    op: str
    layer: int
    iteration: int
    code: int = 1
    times: int = 1


@dataclass(frozen=True, kw_only=True)
class FaultsConfig:
    """Injected transient XCCL errors and token recomputation (xDeepServe §6.2 stage 3).

    table: list of {die, op, layer, iteration, code?, times?} (die: the die's rank; op: one of
    FAULT_OPS; layer: a MoE layer's index, num_layers + k - 1 for MTP depth k; iteration: the
    run's n-th iteration with work, from 0, the same on every die). rate: seeded probabilistic
    mode, in `rate_unit`: "call" (default) the chance each operation call fails; "iteration" the
    expected faults per die per iteration; "die_hour" the expected faults per die per hour of the
    pod's (virtual) clock. The last two are converted to the per-call chance the injector draws
    with from the deployment's calls per die per iteration and projected iteration time
    (xds_mpi/plan/failures/rates.py, docs/failures.md "Fault rates"). An iteration may be
    re-executed max_retries times; one more failure ends the run with an error naming die,
    operation and iteration.
    on_timeout: what a dispatch/combine wait that reached xccl.poll_timeout_s does: "stop" ends
    the run, "recompute" fails the attempt like an injected error (the iteration is recomputed;
    a lost peer is left to the heartbeats, docs/design.md).
    events: failures beyond transient errors, rows of xds_mpi/config/failures.py FailureSpec
    (stuck, dead, link, saturated, memory); detected and recovered per the `health` section."""

    table: list = field(default_factory=list)
    rate: float = 0.0
    rate_unit: str = "call"  # "call" | "iteration" | "die_hour" (RATE_UNITS)
    ops: list = field(default_factory=lambda: list(FAULT_OPS))
    seed: int = 0
    max_retries: int = 3
    events: list = field(default_factory=list)
    on_timeout: str = "stop"  # "recompute": a timed-out XCCL wait is recomputed (§6.2 stage 3)

    def __post_init__(self) -> None:
        require(
            self.rate_unit in RATE_UNITS,
            f"faults.rate_unit must be one of {', '.join(RATE_UNITS)}, got {self.rate_unit!r}",
        )
        if self.rate_unit == "die_hour":  # expected faults per die-hour: any rate >= 0
            require(self.rate >= 0.0, f"faults.rate must be >= 0, got {self.rate}")
        else:
            require(
                0.0 <= self.rate < 1.0,
                f"faults.rate must be in [0, 1) with faults.rate_unit({self.rate_unit}), "
                f"got {self.rate}",
            )
        non_negative("faults", max_retries=self.max_retries)
        require(
            self.on_timeout in ("stop", "recompute"),
            f"faults.on_timeout must be stop or recompute, got {self.on_timeout!r}",
        )
        for op in self.ops:
            _check_op("faults.ops", op)
        object.__setattr__(self, "table", [_fault_row(i, row) for i, row in enumerate(self.table)])
        object.__setattr__(self, "events", failure_rows(self.events))

    @property
    def is_enabled(self) -> bool:
        return bool(self.table) or self.rate > 0


def _check_op(where: str, op: str) -> None:
    require(op in FAULT_OPS, f"{where}: unknown operation {op!r} (known: {', '.join(FAULT_OPS)})")


def _fault_row(index: int, row) -> FaultSpec:
    where = f"faults.table[{index}]"
    spec = row if isinstance(row, FaultSpec) else build_record(FaultSpec, row, where)
    _check_op(f"{where}.op", spec.op)
    require(
        spec.die >= 0 and spec.iteration >= 0 and spec.layer >= 0,
        f"{where}: die, layer and iteration must be >= 0, got die={spec.die}, "
        f"layer={spec.layer}, iteration={spec.iteration}",
    )
    require(
        spec.code > 0 and spec.times > 0,
        f"{where}: code and times must be > 0, got code={spec.code}, times={spec.times}",
    )
    return spec
