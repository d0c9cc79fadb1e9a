"""The metadata records of A2E/E2A (xccl/afd.py): writing them, polling for them, pulling rows.

A record is RECORD_BYTES in the receiver's window, one per (region, lane, writer); the writer Puts
words 1..6 (event id, count, offset, its virtual time, shared-row count, shared-row offset),
flushes, then rings the doorbell word with call + 1, so a reader never acts on a half-written
record (shared/MPI_NOTES.md). Every record written and every byte pulled is counted per die.
`interrupt` (xccl/faults.py) is called on every turn of a wait.

Call numbers are the doorbells, so after an abandoned attempt none may be used again: every call
this die takes part in goes through take(), which tracks 1 + the highest (next_call) and refuses
calls below the floor that resync_calls() sets to the max of next_call over all dies.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from xccl.errors import EventMismatch, XcclError
from xccl.faults import Interrupt
from xccl.gmem import DieMemory, poll_until
from xccl.layout import EP_DOORBELL, EP_EVENT_ID, EP_VTIME_NS, RECORD_BYTES, AfdLayout
from xccl.vclock import LinkModel, VirtualClock

RECORD_PUT_BYTES = 6 * 8 + 8        # body words 1..6, then the doorbell word


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
    def __init__(self, mem: DieMemory, layout: AfdLayout, *, clock: VirtualClock,
                 link: LinkModel | None, num_cores: int, timeout_s: float) -> None:
        self.mem, self.layout, self.me = mem, layout, mem.rank
        self.clock, self.link, self.num_cores, self.timeout_s = clock, link, num_cores, timeout_s
        self.counters = AfdCounters()
        self.waiting_for = ""               # the last unmet poll: die, stage, event, missing peers
        self.interrupt: Interrupt | None = None
        self.next_call = self.call_floor = 0   # 1 + highest call seen; lowest call allowed

    def take(self, call: AfdCall) -> None:
        """Refuse a call numbered before the last rollback: its doorbell may still ring."""
        if call.call < self.call_floor:
            raise XcclError(f"die rank {self.me}: call {call.call} (event {call.event_id}) was "
                            f"numbered before the last rollback; calls start at "
                            f"{self.call_floor}: its records may still ring")
        self.next_call = max(self.next_call, call.call + 1)

    def resync_calls(self, next_call: int) -> None:
        if next_call < self.next_call:
            raise ValueError(f"die rank {self.me}: resync to call {next_call} would go back from "
                             f"call {self.next_call}")
        self.next_call = self.call_floor = next_call

    def publish(self, ranks, region: str, call: AfdCall, writer_idx: int, bodies) -> None:
        """Write (event, count, offset, time, count2, offset2) into each rank's record, flush,
        then ring each doorbell with call + 1."""
        mem, layout = self.mem, self.layout
        words = np.zeros((len(ranks), 6), np.uint64)                 # one per rank: Puts in flight
        for i, (c, o, c2, o2) in enumerate(bodies):
            words[i] = (call.event_id, c, o, 0, c2, o2)
        words.view(np.float64)[:, EP_VTIME_NS - 1] = self.clock.now_ns
        for i, rank in enumerate(ranks):
            mem.put(rank, layout.record_offset(rank, region, call.lane, writer_idx) + 8, words[i])
        mem.flush_all()
        for rank in ranks:
            mem.store_word(rank, layout.record_offset(rank, region, call.lane, writer_idx) +
                           8 * EP_DOORBELL, call.call + 1)
            mem.flush(rank)
        self.counters.metadata_writes += len(ranks)
        self.counters.metadata_bytes += len(ranks) * RECORD_PUT_BYTES

    def ready(self, call: AfdCall, region: str, writers, stage: str) -> np.ndarray | None:
        """The records [W, 8] words of every (rank, writer_idx) if all rang for `call`, else None
        (and `waiting_for` names who is missing)."""
        mem, layout = self.mem, self.layout
        offsets = [layout.record_offset(self.me, region, call.lane, w) for _, w in writers]
        missing = [rank for (rank, _), at in zip(writers, offsets)
                   if mem.load_word(at + 8 * EP_DOORBELL, rank) != call.call + 1]
        if missing:
            self.waiting_for = (f"die rank {self.me}: {stage} event {call.event_id} (call "
                                f"{call.call}, domain {call.domain}, lane {call.lane}): no record"
                                f" from rank(s) {missing}")
            return None
        mem.sync()
        words = np.stack([mem.words[at // 8:at // 8 + RECORD_BYTES // 8] for at in offsets])
        bad = np.flatnonzero(words[:, EP_EVENT_ID] != call.event_id)
        if len(bad):
            raise EventMismatch(f"die rank {self.me}: {stage} call {call.call} expected event "
                                f"{call.event_id}, rank {writers[int(bad[0])][0]} wrote event "
                                f"{int(words[bad[0], EP_EVENT_ID])}")
        return words.copy()

    def wait(self, call: AfdCall, region: str, writers, stage: str) -> np.ndarray:
        """ready(), polled until it holds; XcclTimeout naming die, stage, event and peers."""
        found = []

        def is_ready() -> bool:
            words = self.ready(call, region, writers, stage)
            if words is not None:
                found.append(words)
            return bool(found)
        poll_until(is_ready, deadline=time.monotonic() + self.timeout_s, interrupt=self.interrupt,
                   describe=lambda: f"{self.waiting_for} after {self.timeout_s:g} s")
        return found[0]

    def get(self, rank: int, offset: int, out: np.ndarray) -> None:
        """Pull into `out` from `rank`'s window (valid after a flush)."""
        self.mem.get(rank, offset, out)
        self.counters.pulled_bytes += out.nbytes

    def arrive(self, words: np.ndarray, nbytes: int) -> None:
        """Virtual time: the last record of `words` lands, then our link pulls the bytes."""
        if self.link is None:
            return
        stamps = np.ascontiguousarray(words[:, EP_VTIME_NS]).view(np.float64)
        self.clock.arrive(float(stamps.max(initial=0.0)) + self.link.latency_ns())
        self.clock.advance(self.link.serialization_ns(nbytes, num_cores=self.num_cores))
