"""The metadata records of A2E/E2A (xccl/afd/buffer.py): writing them, polling for them, pulling
rows.

A record is a ROWS_RECORD (xccl/records/record.py) in the receiver's window, one per (region, lane,
writer); it is published and read the one way xccl/records/record.py does it, with call + 1 as the
doorbell. Every record written and every byte pulled is counted per die. `interrupt`
(xccl/recovery/faults.py) is called on every turn of a wait.

Call numbers are the doorbells, so after an abandoned attempt none may be used again: every call
this die takes part in goes through take(), which tracks 1 + the highest (next_call) and refuses
calls below the floor that resync_calls() sets to the max of next_call over all dies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xccl.errors import XcclError
from xccl.gmem import DieMemory
from xccl.moe_layout import AfdLayout
from xccl.records import record as records
from xccl.records.record import ROWS_RECORD, Expected, RecordAt
from xccl.recovery.faults import Interrupt
from xccl.vclock import LinkModel, VirtualClock

RECORD_PUT_BYTES = records.put_bytes(ROWS_RECORD)  # the body's fields, then the doorbell word


@dataclass(frozen=True, kw_only=True)
class AfdCall:
    """One A2E/E2A round: one DP domain's microbatch at one MoE layer.

    call: sequence number, the same on every die, increasing. lane: its buffers (domain x
    microbatch). domain: the active DP domain. event_id: checked against every record."""

    call: int
    lane: int
    domain: int
    event_id: int


@dataclass
class AfdCounters:
    """Per-die traffic: records written (and their bytes), row bytes pulled, A2E calls made."""

    metadata_writes: int = 0
    metadata_bytes: int = 0
    pulled_bytes: int = 0
    calls: int = 0


class AfdRecords:
    def __init__(
        self,
        mem: DieMemory,
        layout: AfdLayout,
        *,
        clock: VirtualClock,
        link: LinkModel | None,
        num_cores: int,
        timeout_s: float,
    ) -> None:
        self.mem, self.layout, self.me = mem, layout, mem.rank
        self.clock, self.link, self.num_cores, self.timeout_s = clock, link, num_cores, timeout_s
        self.counters = AfdCounters()
        self.waiting_for = ""  # the last unmet poll: die, stage, event, missing peers
        self.missing: tuple[str, int, tuple[int, ...]] = ("", -1, ())  # (stage, event, peers)
        self.interrupt: Interrupt | None = None
        self.next_call = self.call_floor = 0  # 1 + highest call seen; lowest call allowed

    def take(self, call: AfdCall) -> None:
        """Refuse a call numbered before the last rollback: its doorbell may still ring."""
        if call.call < self.call_floor:
            raise XcclError(
                f"die rank {self.me}: call {call.call} (event {call.event_id}) was "
                f"numbered before the last rollback; calls start at "
                f"{self.call_floor}: its records may still ring"
            )
        self.next_call = max(self.next_call, call.call + 1)

    def resync_calls(self, next_call: int) -> None:
        if next_call < self.next_call:
            raise ValueError(
                f"die rank {self.me}: resync to call {next_call} would go back from "
                f"call {self.next_call}"
            )
        self.next_call = self.call_floor = next_call

    def publish(
        self, ranks: Sequence[int], region: str, call: AfdCall, writer_idx: int, **fields
    ) -> None:
        """Write a record into `region` of every rank, ROWS_RECORD fields by name (one value, or
        one per rank: count, offset, shared_count, shared_offset), ringing call + 1."""
        bodies = np.zeros(len(ranks), ROWS_RECORD)  # one per rank: Puts in flight
        bodies["event_id"], bodies["vtime_ns"] = call.event_id, self.clock.now_ns
        for name, value in fields.items():
            bodies[name] = value
        targets = [
            RecordAt(rank, self.layout.record_offset(rank, region, call.lane, writer_idx))
            for rank in ranks
        ]
        records.publish(self.mem, targets, bodies, call.call + 1)
        self.counters.metadata_writes += len(ranks)
        self.counters.metadata_bytes += len(ranks) * RECORD_PUT_BYTES

    def ready(self, call: AfdCall, region: str, writers, stage: str) -> np.ndarray | None:
        """The records [W] ROWS_RECORD of every (rank, writer_idx) if all rang for `call`, else
        None (and `waiting_for` names who is missing)."""
        sources, expected = self._sources(call, region, writers, stage)
        missing = records.missing_peers(self.mem, sources, expected.doorbell)
        if missing:
            self.waiting_for = records.no_record(self.mem, expected, missing)
            self.missing = (expected.stage, expected.event_id, tuple(missing))
            return None
        return records.read(self.mem, sources, expected, ROWS_RECORD)

    def wait(self, call: AfdCall, region: str, writers, stage: str) -> np.ndarray:
        """ready(), polled until it holds; XcclTimeout naming die, stage, event and peers."""
        sources, expected = self._sources(call, region, writers, stage)
        return records.wait(
            self.mem,
            sources,
            expected,
            ROWS_RECORD,
            timeout_s=self.timeout_s,
            interrupt=self.interrupt,
        )

    def _sources(self, call: AfdCall, region: str, writers, stage: str):
        """The records (rank, writer_idx) write in our `region` of the call's lane."""
        sources = [
            RecordAt(rank, self.layout.record_offset(self.me, region, call.lane, w))
            for rank, w in writers
        ]
        return sources, Expected(
            stage=stage,
            event_id=call.event_id,
            doorbell=call.call + 1,
            call=f"call {call.call}, domain {call.domain}, lane {call.lane}",
        )

    def get(self, rank: int, offset: int, out: np.ndarray) -> None:
        """Pull into `out` from `rank`'s window (valid after a flush)."""
        self.mem.get(rank, offset, out)
        self.counters.pulled_bytes += out.nbytes

    def arrive(self, bodies: np.ndarray, nbytes: int) -> None:
        """Virtual time: the last of `bodies` lands, then our link pulls the bytes (without a link
        model: wait for the last sender's stamp; the die's pricer prices the transfer)."""
        if self.link is None:
            self.clock.arrive(float(bodies["vtime_ns"].max(initial=0.0)))
            return
        self.clock.arrive(float(bodies["vtime_ns"].max(initial=0.0)) + self.link.latency_ns())
        self.clock.advance(self.link.serialization_ns(nbytes, num_cores=self.num_cores))
