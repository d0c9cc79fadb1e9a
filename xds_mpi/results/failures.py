"""What happened to each injected failure (xDeepServe §6): one record per `faults.events` row,
for the summary line and the run file's `failures` group.

The TE-shell (or the JE, in a PD run) assembles the records from what the dies and the
detectors report; `write_failures` / `read_failures` are the run file's side.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # h5py is imported where the run file is written: dies never need it
    import h5py  # start-up: the dies import this module, only the host writes (docs/design.md)


@dataclass(frozen=True, kw_only=True)
class FailureRecord:
    """kind, die, role: the row and the role of its die. injected_*: when the fault began
    (iteration; wall seconds since serving started; the die's virtual clock). detected_*: when
    a detector named it (-1: never; wall seconds since serving started, virtual seconds);
    detected_by: "heartbeat", "link probe", "transfer outcome", "xccl timeout", "memory check";
    verdict: what the detector concluded (e.g. "dead", "stuck", "link", "saturated").
    recovery: what was done, in words (e.g. "vertical scaling: 8 -> 7 decode dies").
    requests_affected: ids moved or re-run; requests_lost: ids that ended with a reason (memory
    faults only). tokens_per_s_before / _after: served tokens/s over the windows either side.
    resumed_wall_s: when the dies served again after the fence and rebuild (wall seconds since
    serving started; -1: no rebuild, or a run file written before it was kept)."""

    kind: str
    die: int
    role: str
    injected_iteration: int
    injected_wall_s: float
    injected_virtual_s: float
    detected_wall_s: float = -1.0
    detected_virtual_s: float = -1.0
    detected_by: str = ""
    verdict: str = ""
    recovery: str = ""
    requests_affected: tuple[int, ...] = ()
    requests_lost: tuple[int, ...] = ()
    tokens_per_s_before: float = 0.0
    tokens_per_s_after: float = 0.0
    resumed_wall_s: float = -1.0

    @property
    def detection_s(self) -> float:
        """Wall seconds from injection to detection (-1: never detected)."""
        if self.detected_wall_s < 0:
            return -1.0
        return self.detected_wall_s - self.injected_wall_s

    def describe(self) -> str:
        """One summary line."""
        found = (
            f"detected after {self.detection_s:.2f} s by {self.detected_by} ({self.verdict})"
            if self.detected_wall_s >= 0
            else "never detected"
        )
        lost = f", lost {list(self.requests_lost)}" if self.requests_lost else ""
        return (
            f"failure {self.kind} on {self.role} die {self.die} at iteration "
            f"{self.injected_iteration}: {found}; {self.recovery or 'no recovery'}; "
            f"{len(self.requests_affected)} requests affected{lost}; tokens/s "
            f"{self.tokens_per_s_before:.1f} -> {self.tokens_per_s_after:.1f}"
        )


def with_resumed(records: list[FailureRecord], resumed: dict[int, float]) -> list[FailureRecord]:
    """`records` with `resumed_wall_s` of each die the detector judged (`resumed`: die rank ->
    wall seconds since serving started when the dies served again; a record of another die, or
    one never detected, unchanged)."""
    return [
        replace(r, resumed_wall_s=resumed[r.die])
        if r.die in resumed and r.detected_wall_s >= 0
        else r
        for r in records
    ]


_LISTS = ("requests_affected", "requests_lost")


def write_failures(f: h5py.File, records: list[FailureRecord]) -> None:
    """The run file's `failures` group: one dataset per field, one entry per record (the two
    request lists as variable-length int arrays)."""
    import h5py  # start-up: the dies import this module, only the host writes (docs/design.md)

    group = f.create_group("failures")
    for field in fields(FailureRecord):
        values = [getattr(r, field.name) for r in records]
        if field.name in _LISTS:
            dtype = h5py.vlen_dtype(np.int64)
            data = np.empty(len(values), dtype=object)
            data[:] = [np.asarray(v, np.int64) for v in values]
            group.create_dataset(field.name, data=data, dtype=dtype)
        elif field.type == "str":
            group[field.name] = np.array(values, dtype=h5py.string_dtype())
        else:
            group[field.name] = np.array(values, dtype=float if field.type == "float" else int)


def read_failures(f: h5py.File) -> list[FailureRecord]:
    """The records `write_failures` wrote ([] for a run file without failures)."""
    if "failures" not in f:
        return []
    group = f["failures"]
    columns = {}
    for field in fields(FailureRecord):
        if field.name not in group:  # an older run file: the field's default
            continue
        raw = group[field.name][()]
        if field.name in _LISTS:
            columns[field.name] = [tuple(int(x) for x in v) for v in raw]
        elif field.type == "str":
            columns[field.name] = [v.decode() if isinstance(v, bytes) else str(v) for v in raw]
        else:
            cast = float if field.type == "float" else int
            columns[field.name] = [cast(v) for v in raw]
    count = len(columns["kind"])
    return [FailureRecord(**{k: v[i] for k, v in columns.items()}) for i in range(count)]
