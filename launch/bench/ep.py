"""Per-rank program of `xds-mpi bench ep` (run under mpiexec; rank 0 reports).

Every rank dispatches `tokens` rows of `hidden` float32 values to top-k of `experts` experts
(spread evenly over the ranks, random routing from a fixed seed), the experts are the identity, and
combine brings the rows home. In the same run, a two-sided baseline moves the same rows:
Alltoall of the counts + Alltoallv of the rows there, Alltoallv of the outputs back. The
projected column is one dispatch + combine on the 910C virtual clock. The floor column is two
bare meetings of every rank (launch/bench/floor_meetings.py): what any protocol in which every die
meets every die pays on these cores before it moves a row.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from launch.bench.floor_meetings import Meetings
from launch.bench.results import rank_parser, report
from xccl.ep.buffer import EpBuffer, select_slots
from xccl.gmem import DieMemory
from xccl.moe_layout import EpLayout
from xccl.quant import quant_dequant
from xccl.vclock import LinkModel, VirtualClock
from xds_mpi.config.hardware import load_profile

comm = MPI.COMM_WORLD
COLUMNS = [
    "tokens",
    "hidden",
    "topk",
    "int8",
    "xccl_us",
    "alltoallv_us",
    "floor_us",
    "speedup",
    "vs_floor",
    "proj_910c_us",
]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        if args.experts % comm.size:
            raise SystemExit(f"--experts({args.experts}) must be a multiple of --np({comm.size})")
        self.args = args
        per_die = args.experts // comm.size
        self.slot_owner = [e // per_die for e in range(args.experts)]
        self.log2phy = [(e,) for e in range(args.experts)]
        self.layout = EpLayout(
            members=tuple(range(comm.size)),
            base=(0,) * comm.size,
            hidden=args.hidden,
            max_tokens=max(args.tokens),
            num_columns=args.topk,
            itemsize=4,
            use_int8=args.int8,
        )
        self.mem = DieMemory(comm, self.layout.area_bytes())
        self.clock = VirtualClock()
        self.ep = EpBuffer(
            self.mem,
            self.layout,
            self.slot_owner,
            dtype=np.float32,
            clock=self.clock,
            link=LinkModel.from_profile(load_profile(args.profile)),
            timeout_s=300,
        )
        self.event = 0
        self.meetings = Meetings(comm)

    def close(self) -> None:
        comm.Barrier()
        self.mem.free()
        self.meetings.free()

    def inputs(self, num_tokens: int):
        rng = np.random.default_rng((7, comm.rank))
        x = rng.normal(size=(num_tokens, self.args.hidden)).astype(np.float32)
        topk = np.argsort(rng.random((num_tokens, self.args.experts)), axis=1)[:, : self.args.topk]
        return x, topk, rng.random((num_tokens, self.args.topk))

    def xccl_round(self, x, topk, w) -> np.ndarray:
        self.event += 1
        recv_x, _, handle = self.ep.dispatch(x, topk, w, self.event, log2phy=self.log2phy)
        return self.ep.combine(recv_x, handle)

    def alltoallv_round(self, x, topk, w) -> np.ndarray:
        phy = select_slots(topk, self.log2phy, (), comm.rank)  # [T, K]
        token, column = np.nonzero(phy >= 0)
        dest = np.asarray(self.slot_owner)[phy[token, column]]
        order = np.argsort(dest, kind="stable")
        token, column, dest = token[order], column[order], dest[order]
        rows = quant_dequant(x[token]) if self.args.int8 else x[token]
        send_counts = np.bincount(dest, minlength=comm.size).astype(np.int64)
        recv_counts = np.empty_like(send_counts)
        comm.Alltoall(send_counts, recv_counts)
        hidden = self.args.hidden
        recv = np.empty((int(recv_counts.sum()), hidden), np.float32)
        comm.Alltoallv(
            [rows, send_counts * hidden, MPI.FLOAT], [recv, recv_counts * hidden, MPI.FLOAT]
        )
        back = np.empty_like(rows)
        comm.Alltoallv(
            [recv, recv_counts * hidden, MPI.FLOAT], [back, send_counts * hidden, MPI.FLOAT]
        )
        y = np.zeros_like(x)
        np.add.at(y, token, w[token, column, None].astype(np.float32) * back)
        return y

    def timed(self, body) -> float:
        body()
        comm.Barrier()
        times = []
        for _ in range(self.args.iters):
            start = time.perf_counter()
            body()
            times.append(time.perf_counter() - start)
        return float(np.median(comm.allgather(float(np.median(times)))))

    def row(self, num_tokens: int) -> dict:
        x, topk, w = self.inputs(num_tokens)
        y = self.xccl_round(x, topk, w)
        y_base = self.alltoallv_round(x, topk, w)
        if not np.allclose(y, y_base, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"rank {comm.rank}: dispatch/combine and Alltoallv disagree")
        xccl = self.timed(lambda: self.xccl_round(x, topk, w))
        base = self.timed(lambda: self.alltoallv_round(x, topk, w))
        floor = self.timed(self.meetings.round) if self.meetings.available else float("nan")
        comm.Barrier()
        start = self.clock.now_ns
        self.xccl_round(x, topk, w)
        projected = comm.allreduce(self.clock.now_ns - start, op=MPI.MAX)
        return {
            "tokens": num_tokens,
            "hidden": self.args.hidden,
            "topk": self.args.topk,
            "int8": int(self.args.int8),
            "xccl_us": xccl * 1e6,
            "alltoallv_us": base * 1e6,
            "floor_us": floor * 1e6,
            "speedup": base / xccl,
            "vs_floor": xccl / floor,
            "proj_910c_us": projected / 1e3,
        }


def main(argv: list[str] | None = None) -> None:
    parser = rank_parser("launch.bench.ep")
    args = parser.parse_args(argv)
    bench = Bench(args)
    rows = []
    for num_tokens in args.tokens:
        rows.append(bench.row(num_tokens))
        if comm.rank == 0:
            print(f"  measured {num_tokens} tokens per die", flush=True)
    bench.close()
    if comm.rank == 0:
        title = (
            f"xds-mpi bench ep: {comm.size} ranks, {args.experts} experts, identity experts,"
            f" float32 rows{' (INT8 on the wire)' if args.int8 else ''}"
        )
        report(
            rows,
            COLUMNS,
            args,
            title=title,
            legend="speedup: Alltoallv round / dispatch+combine round (higher is better); "
            "floor_us: two bare meetings of every rank (a doorbell each, a poll; "
            "launch/bench/floor_meetings.py), nan across nodes; vs_floor: xccl_us / floor_us; "
            "proj_910c_us: one dispatch + combine on the virtual clock (slowest die).",
        )


if __name__ == "__main__":
    main()
