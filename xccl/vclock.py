"""Virtual time: each die's clock, and what a UB transfer costs on the emulated pod.

Wall time says what MPI on this machine took; virtual time says what a 910C die would take.
Senders stamp their clock into XCCL records; a receiver's clock becomes max(own, arrival) where
arrival = send time + the link's cost of the bytes (docs/projection.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Path = Literal["mte", "dma"]


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """Cost of one transfer between two dies over UB (numbers from a hardware profile)."""

    write_gb_per_s_intra: float
    write_gb_per_s_inter: float
    write_latency_us_intra: float
    write_latency_us_inter: float
    mte_gb_per_s_per_core: float
    dma_startup_us: float
    max_cores: int

    @classmethod
    def from_profile(cls, profile: dict) -> LinkModel:
        ub = profile["ub"]
        return cls(
            write_gb_per_s_intra=ub["write_gb_per_s_intra"],
            write_gb_per_s_inter=ub["write_gb_per_s_inter"],
            write_latency_us_intra=ub["write_latency_us_intra"],
            write_latency_us_inter=ub["write_latency_us_inter"],
            mte_gb_per_s_per_core=ub["mte_gb_per_s_per_core"],
            dma_startup_us=ub["dma_startup_us"],
            max_cores=profile["die"]["aiv_cores"],
        )

    def transfer_ns(
        self, nbytes: int, *, num_cores: int = 1, path: Path = "mte", same_server: bool = False
    ) -> float:
        """Virtual ns from the start of a write of `nbytes` to its arrival at the peer."""
        latency_us = self.write_latency_us_intra if same_server else self.write_latency_us_inter
        if path == "dma":
            latency_us += self.dma_startup_us
        return latency_us * 1e3 + self.serialization_ns(
            nbytes, num_cores=num_cores, path=path, same_server=same_server
        )

    def serialization_ns(
        self, nbytes: int, *, num_cores: int = 1, path: Path = "mte", same_server: bool = False
    ) -> float:
        """Virtual ns the link is busy pushing `nbytes` (no start-up latency)."""
        return nbytes / self.gb_per_s(num_cores=num_cores, path=path, same_server=same_server)

    def gb_per_s(
        self, *, num_cores: int = 1, path: Path = "mte", same_server: bool = False
    ) -> float:
        """The rate a write pushes bytes at (bytes / (GB/s) = ns)."""
        gb_per_s = self.write_gb_per_s_intra if same_server else self.write_gb_per_s_inter
        if path == "mte":  # each AIV core moves its share through its unified buffer
            gb_per_s = min(gb_per_s, self.mte_gb_per_s_per_core * min(num_cores, self.max_cores))
        return gb_per_s

    def latency_ns(self, *, same_server: bool = False) -> float:
        """A one-word flag write (an acknowledgement)."""
        return self.transfer_ns(8, same_server=same_server)


class VirtualClock:
    """A die's virtual time in ns. Compute advances it; arrivals can only move it forward."""

    def __init__(self, start_ns: float = 0.0) -> None:
        self.now_ns = float(start_ns)

    def advance(self, ns: float) -> float:
        if ns < 0:
            raise ValueError(f"a clock cannot go back: advance by {ns} ns")
        self.now_ns += ns
        return self.now_ns

    def arrive(self, arrival_ns: float) -> float:
        """Something sent at an earlier virtual time lands at `arrival_ns`: wait for it."""
        self.now_ns = max(self.now_ns, float(arrival_ns))
        return self.now_ns

    def show(self, stream_ns: float) -> None:
        """A die running two streams (xds_mpi/execution/two_streams.py): the clock shows the
        stream about to run, which may be behind the other stream's time."""
        self.now_ns = float(stream_ns)

    def snapshot(self) -> float:
        """The time now, for `restore` (token recomputation re-runs an iteration from it)."""
        return self.now_ns

    def restore(self, snapshot: float) -> None:
        """Back to a `snapshot`: the only way the clock goes back (a failed attempt's time is
        counted by the recomputer, not by the iteration that re-runs)."""
        self.now_ns = float(snapshot)
