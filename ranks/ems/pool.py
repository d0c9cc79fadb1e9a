"""An EMS pool rank (docs/ems.md; CloudMatrix-Infer §4.4.1): no die; its window stands for the
CPU DRAM a server gives the pool, reached by every die over UB.

The dies that prefill read it one-sidedly (records, then payloads: ranks/ems/client.py). Puts
arrive as messages: this rank owns the slots and the LRU order, so it alone writes the window;
a put through RMA would need the writer to take a slot it does not own (a remote lock or an
atomic on a shared free list and LRU) and still tell this rank so it can keep the LRU order. A
put is off the prefill's critical path (the die isends and goes on), a read is on it: reads are
one-sided, puts two-sided. Reads are reported as small touch messages for the LRU.

A slot is rewritten as: version odd, payload and record written, version even; a reader that
saw another version, or an odd one, recomputes (client.py `verified`).

An `ems.faults` dead row: once the rank has taken `after_puts` put messages it dies. Its status
word turns LOST, then its DRAM is gone (every payload overwritten with 0xFF bytes, NaN as
float64, the records left as they were: a reader that trusted them would serve wrong tokens).
It takes no put, touch or evict from then on: what reaches it is dropped unread, as the fabric
would drop it, and the process stays alive (MPI aborts a job whose rank exits) until every
prefill die said done, then reports.
"""

from __future__ import annotations

import time

import numpy as np

from ranks.core.context import RankContext
from ranks.core.die_io import SHELL
from ranks.core.handshake import handshake
from ranks.core.ready import report_ready
from ranks.core.tags import TAG_EMS, TAG_EMS_EVICTED, TAG_EMS_REPORT
from ranks.ems.messages import EmsDone, EmsEvict, EmsEvicted, EmsPoolReport, EmsPut, EmsTouch
from xccl.gmem import DieMemory
from xds_mpi.ems.cache import Directory
from xds_mpi.plan.ems import LOST, RECORD_WORDS, STATUS_OFFSET, WORD_BYTES

POISON = 0xFF  # a dead pool rank's DRAM, and an evicted slot's bytes


def run(ctx: RankContext) -> None:
    handshake(ctx)
    rank, plan = ctx.comm.rank, ctx.plan
    mem = DieMemory(ctx.comm, plan.window_bytes[rank])  # collective, as every rank
    alone = ctx.comm.Split(1000 + rank, rank)  # the dies' and hosts' Split: every rank joins
    pool = PoolServer(ctx, mem)
    report_ready(ctx.comm)
    pool.serve()
    ctx.comm.send(pool.report(), dest=SHELL, tag=TAG_EMS_REPORT)
    mem.free()
    alone.Free()


class PoolServer:
    def __init__(self, ctx: RankContext, mem) -> None:
        self.ctx, self.comm, self.mem, self.ems = ctx, ctx.comm, mem, ctx.plan.ems
        self.base = ctx.plan.p2p.window_bytes(ctx.comm.rank)  # 0: a pool rank holds no ring
        self.directory = Directory(self.ems.capacity)
        self.num_put = self.num_put_held = self.num_evicted = self.num_touched = 0
        self.dies_after = self.ems.dead_after(ctx.comm.rank)  # put messages; None: never
        self.num_put_msgs = self.num_dropped = 0
        self.is_lost = False

    def _record(self, slot: int) -> np.ndarray:
        at = (self.base + self.ems.record_offset(slot)) // WORD_BYTES
        return self.mem.words[at : at + RECORD_WORDS]

    def serve(self) -> None:
        """Take puts and touches until every die using the pool said it is done (bounded by
        run.timeout_s: a die that never says so ends the run naming it)."""
        waiting = set(self.ems.clients)
        self._die_if_due()  # after_puts 0: dead from the start
        deadline = time.monotonic() + self.ctx.cfg.run.timeout_s
        while waiting:
            msg = self.comm.improbe(tag=TAG_EMS)
            if msg is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"EMS pool rank {self.comm.rank}: dies {sorted(waiting)} never "
                        f"said they were done within run.timeout_s({self.ctx.cfg.run.timeout_s})"
                    )
                time.sleep(0.0005)
                continue
            message = msg.recv()  # one tag: a die's messages arrive in the order it sent them
            if isinstance(message, EmsDone):
                waiting.discard(message.rank)
            elif self.is_lost:
                self.num_dropped += isinstance(message, EmsPut)
            elif isinstance(message, EmsPut):
                self._put(message)
                self.num_put_msgs += 1
                self._die_if_due()
            elif isinstance(message, EmsTouch):
                for key in message.keys:
                    self.directory.touch(key)
                self.num_touched += len(message.keys)
            elif isinstance(message, EmsEvict):
                answer = EmsEvicted(key=message.key, was_held=self._evict(message.key))
                self.comm.send(answer, dest=message.rank, tag=TAG_EMS_EVICTED)
            else:
                raise TypeError(f"EMS pool rank {self.comm.rank}: unexpected {message!r}")

    def _put(self, put: EmsPut) -> None:
        size = self.ems.block_bytes
        for i, key in enumerate(put.keys):
            if key in self.directory:  # another request put it first
                self.directory.touch(key)
                self.num_put_held += 1
                continue
            placed = self.directory.place(key)
            self.num_evicted += bool(placed.evicted)
            record = self._record(placed.slot)
            record[1] += 1  # odd: being written
            self.mem.sync()
            at = self.base + self.ems.payload_offset(placed.slot)
            self.mem.local[at : at + size] = put.payload[i * size : (i + 1) * size]
            record[0], record[2] = key, size
            self.mem.sync()
            record[1] += 1  # even: stable
            self.mem.sync()
            self.num_put += 1

    def _evict(self, key: int) -> bool:
        """An ems.faults evict row: the slot freed, its version moved, its bytes overwritten."""
        slot = self.directory.evict(key)
        if slot is None:
            return False
        record = self._record(slot)
        record[1] += 1  # odd: being written
        self.mem.sync()
        at = self.base + self.ems.payload_offset(slot)
        self.mem.local[at : at + self.ems.block_bytes] = POISON
        record[0] = record[2] = 0
        self.mem.sync()
        record[1] += 1  # even: a free slot
        self.mem.sync()
        self.num_evicted += 1
        return True

    def _die_if_due(self) -> None:
        """The ems.faults dead row, once its put messages are taken: LOST first, then the DRAM
        gone (a reader checks the status after its pulls, so what it pulled after the first
        write it throws away)."""
        if self.is_lost or self.dies_after is None or self.num_put_msgs < self.dies_after:
            return
        self.is_lost = True
        self.mem.words[(self.base + STATUS_OFFSET) // WORD_BYTES] = LOST
        self.mem.sync()
        # The payloads only: the records still name their keys with even versions, so nothing
        # but the status word tells a reader the bytes are gone (as nothing but the read's
        # error completion would on UB).
        start = self.base + self.ems.payload_offset(0)
        self.mem.local[start : self.base + self.ems.window_bytes] = POISON
        self.mem.sync()
        self.directory = Directory(self.ems.capacity)  # held nothing any more

    def report(self) -> EmsPoolReport:
        return EmsPoolReport(
            rank=self.comm.rank,
            num_put=self.num_put,
            num_put_held=self.num_put_held,
            num_evicted=self.num_evicted,
            num_held=len(self.directory),
            num_touched=self.num_touched,
            is_lost=self.is_lost,
            num_dropped=self.num_dropped,
        )
