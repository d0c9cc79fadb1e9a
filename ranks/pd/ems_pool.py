"""An EMS pool rank (docs/ems.md; CloudMatrix-Infer §4.4.1): no die; its window stands for the
CPU DRAM a server gives the pool, reached by every die over UB.

The prefill dies read it one-sidedly (records, then payloads: ranks/pd/ems_client.py). Puts
arrive as messages: this rank owns the slots and the LRU order, so it alone writes the window;
a put through RMA would need the writer to take a slot it does not own (a remote lock or an
atomic on a shared free list and LRU) and still tell this rank so it can keep the LRU order. A
put is off the prefill's critical path (the die isends and goes on), a read is on it: reads are
one-sided, puts two-sided. Reads are reported as small touch messages for the LRU.

A slot is rewritten as: version odd, payload and record written, version even; a reader that
saw another version, or an odd one, recomputes (ems_client.py `verified`).
"""

from __future__ import annotations

import time

import numpy as np

from ranks.core.context import RankContext
from ranks.core.die_io import SHELL
from ranks.core.ems_messages import EmsDone, EmsPoolReport, EmsPut, EmsTouch
from ranks.core.handshake import handshake
from ranks.core.ready import report_ready
from xds_mpi.engine.ems import Directory
from xds_mpi.plan.ems import RECORD_WORDS, WORD_BYTES
from xds_mpi.tags import TAG_EMS, TAG_EMS_REPORT


def run(ctx: RankContext) -> None:
    from xccl.gmem import DieMemory

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

    def _record(self, slot: int) -> np.ndarray:
        at = (self.base + self.ems.record_offset(slot)) // WORD_BYTES
        return self.mem.words[at : at + RECORD_WORDS]

    def serve(self) -> None:
        """Take puts and touches until every prefill die said it is done (bounded by
        run.timeout_s: a die that never says so ends the run naming it)."""
        waiting = set(self.ems.prefill)
        deadline = time.monotonic() + self.ctx.cfg.run.timeout_s
        while waiting:
            msg = self.comm.improbe(tag=TAG_EMS)
            if msg is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"EMS pool rank {self.comm.rank}: prefill dies {sorted(waiting)} never "
                        f"said they were done within run.timeout_s({self.ctx.cfg.run.timeout_s})"
                    )
                time.sleep(0.0005)
                continue
            message = msg.recv()  # one tag: a die's messages arrive in the order it sent them
            if isinstance(message, EmsPut):
                self._put(message)
            elif isinstance(message, EmsTouch):
                for key in message.keys:
                    self.directory.touch(key)
                self.num_touched += len(message.keys)
            elif isinstance(message, EmsDone):
                waiting.discard(message.rank)
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

    def report(self) -> EmsPoolReport:
        return EmsPoolReport(
            rank=self.comm.rank,
            num_put=self.num_put,
            num_put_held=self.num_put_held,
            num_evicted=self.num_evicted,
            num_held=len(self.directory),
            num_touched=self.num_touched,
        )
