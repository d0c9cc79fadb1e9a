"""The pure parts of a served run's record cap (ranks/shell/serve_records.py `RecordCap`): its
setting, read from the environment so that the launcher sets it without importing a rank's
code, and TokenClock, when the tokens of the records let go arrived."""

from __future__ import annotations

import os

import numpy as np

MAX_RECORDS_ENV = "XDS_SERVE_MAX_RECORDS"  # `xds-mpi serve --max-records`; 0: keep every one
# `xds-mpi serve --max-iterations`: each die's per-iteration timings kept (the newest); 0: all
MAX_ITERATIONS_ENV = "XDS_SERVE_MAX_ITERATIONS"


def max_records() -> int:
    value = os.environ.get(MAX_RECORDS_ENV, "0")
    if not value.isdigit():
        raise ValueError(f"${MAX_RECORDS_ENV} must be a count of records (0: all), got {value!r}")
    return int(value)


def max_iterations() -> int:
    value = os.environ.get(MAX_ITERATIONS_ENV, "0")
    if not value.isdigit():
        raise ValueError(f"${MAX_ITERATIONS_ENV} must be a count (0: all), got {value!r}")
    return int(value)


class TokenClock:
    """How many tokens arrived in each BUCKET_S of wall time (time.time()): 4 bytes a bucket,
    ~140 KiB an hour, whatever the number of requests."""

    BUCKET_S = 0.1

    def __init__(self) -> None:
        self.t0 = 0.0  # the wall time of bucket 0, set by the first token
        self.counts = np.zeros(0, np.int32)

    def add(self, times) -> None:
        if not len(times):
            return
        times = np.asarray(times, float)
        if not self.t0:
            self.t0 = float(times.min())
        idx = np.maximum(((times - self.t0) / self.BUCKET_S).astype(np.int64), 0)
        if idx.max() >= len(self.counts):
            grown = np.zeros(max(int(idx.max()) + 1, 2 * len(self.counts)), np.int32)
            grown[: len(self.counts)] = self.counts
            self.counts = grown
        np.add.at(self.counts, idx, 1)

    def count(self, t0: float, t1: float) -> int:
        """Tokens in the buckets that start in [t0, t1) (to BUCKET_S)."""
        if not self.t0 or t1 <= t0:
            return 0
        lo = max(0, round((t0 - self.t0) / self.BUCKET_S))
        hi = max(0, round((t1 - self.t0) / self.BUCKET_S))
        return int(self.counts[lo:hi].sum())
