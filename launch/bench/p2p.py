"""Per-rank program of `xds-mpi bench p2p` (run under mpiexec; rank 0 reports).

Ranks pair up (0,1), (2,3), ...; every pair measures at once, so at 8 ranks the numbers include
oversubscription. For each size and core count, in the same run:
  xccl   - round trip: A sends (sync: returns after the ack), B receives and sends back;
           one way: a sync send of the whole message (until the ack), for bandwidth, received
           into a private buffer (through the ring: two copies) and into window memory
           ("direct": a message of more than one publication lands with one copy, xccl/p2p/send.py).
           On both memory paths (xccl/gmem_paths.py): "ls" (load/store into the peer's window,
           what the default config uses on one node) and "rma" (Put/Get/atomics, as across nodes)
  put    - the raw-MPI baseline: Put data + Flush + one-word flag + Flush, peer polls the flag
  ls     - the raw load/store baseline: numpy stores into the peer's window (Shared_query),
           Win.Sync, a one-word flag store; the peer polls Win.Sync + a load of the flag
  sendrecv - two-sided MPI Send/Recv ping-pong of the same bytes
  floor  - the protocol floor (launch/bench/floor_pair.py): the ring steps alone, in plain numpy
  projected - what one sync send costs a 910C die on the virtual clock (dies on two servers)
Medians over iterations, then the median over pairs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from launch.bench.floor_pair import FloorPair
from launch.bench.raw_pair import RawPair
from launch.bench.results import report
from xccl.gmem import DieMemory
from xccl.layout import P2PLayout
from xccl.p2p import P2P
from xccl.vclock import LinkModel, VirtualClock
from xds_mpi.config.hardware import load_profile

comm = MPI.COMM_WORLD
COLUMNS = (
    "bytes cores xccl_rtt_us xccl_rma_rtt_us put_rtt_us ls_rtt_us sendrecv_rtt_us floor_rtt_us "
    "rtt_vs_best rtt_vs_floor rtt_vs_put rma_rtt_vs_put xccl_gb_s xccl_rma_gb_s put_gb_s "
    "ls_gb_s bw_vs_put rma_bw_vs_put xccl_direct_gb_s xccl_rma_direct_gb_s direct_bw_vs_put "
    "rma_direct_bw_vs_put proj_910c_send_us"
).split()
PATHS = ("auto", "rma")  # xccl over load/store (one node), xccl over RMA


def iterations(nbytes: int, base: int) -> int:
    return max(40, min(base, int(base * 65536 / max(nbytes, 65536))))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.peer = comm.rank ^ 1
        self.is_a = comm.rank % 2 == 0
        pairs = {(r, r ^ 1) for r in range(comm.size)}
        self.layout = P2PLayout.build(comm.size, args.slots, args.slot_bytes, pairs)
        link = LinkModel.from_profile(load_profile(args.profile))
        self.mems, self.p2ps = {}, {}
        self.landing_at = self.layout.window_bytes(comm.rank)  # a receive buffer in the window
        for path in PATHS:
            self.mems[path] = DieMemory(comm, self.landing_at + max(args.sizes), memory_path=path)
            # Dies on different servers, as the paper measured (xDeepServe §3.1, Figure 5).
            self.p2ps[path] = P2P(
                self.mems[path],
                self.layout,
                link=link,
                timeout_s=120,
                server_of=list(range(comm.size)),
            )
        self.raw = RawPair(comm, self.peer, max(args.sizes))
        self.floor = FloorPair(comm, self.peer, max(args.sizes))
        self.args = args

    def close(self) -> None:
        comm.Barrier()
        for mem in (*self.mems.values(), self.raw, self.floor):
            mem.free()

    def timed_together(self, bodies: dict, iters: int) -> dict:
        """Median seconds of every `bodies[key](i)` over `iters` iterations, each iteration
        running every body once in turn, after a warm-up; pairs in step."""
        for i in range(2):
            for body in bodies.values():
                body(-1 - i)
        comm.Barrier()
        times = {key: [] for key in bodies}
        for i in range(iters):
            for key, body in bodies.items():
                start = time.perf_counter()
                body(i)
                times[key].append(time.perf_counter() - start)
        return {key: float(np.median(spent)) for key, spent in times.items()}

    def xccl_rtt(self, p2p: P2P, buf: np.ndarray, event: int, cores: int) -> None:
        peer = self.peer
        if self.args.mode == "async":
            handles = (
                [p2p.isend(buf, peer, event, num_cores=cores), p2p.irecv(buf, peer, event)]
                if self.is_a
                else [p2p.irecv(buf, peer, event)]
            )
            [h.wait() for h in handles]
            if not self.is_a:
                p2p.isend(buf, peer, event, num_cores=cores).wait()
        elif self.is_a:
            p2p.send(buf, peer, event, num_cores=cores)
            p2p.recv(buf, peer, event)
        else:
            p2p.recv(buf, peer, event)
            p2p.send(buf, peer, event, num_cores=cores)

    def xccl_one_way(self, p2p: P2P, buf: np.ndarray, cores: int, out=None) -> None:
        if self.is_a:
            p2p.send(buf, self.peer, 0, num_cores=cores)
        else:
            p2p.recv(buf if out is None else out, self.peer, 0)

    def projected_send_ns(self, buf: np.ndarray, cores: int) -> float:
        """Nanoseconds one sync send of `buf` takes on a fresh virtual clock."""
        clock, p2p = VirtualClock(), self.p2ps["auto"]
        p2p.set_clock(clock)
        comm.Barrier()
        self.xccl_one_way(p2p, buf, cores)
        return clock.now_ns

    def measure(self, nbytes: int, cores: int) -> dict:
        """Every quantity of one row, in seconds or GB/s, on this rank. The round trips take
        turns every iteration, and so do the one-way sends: a machine whose speed drifts during
        the row moves every column of a ratio alike."""
        buf, out = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        iters = iterations(nbytes, self.args.iters)
        raw = self.raw
        rtts = {"rtt_put": lambda i: raw.put_rtt(buf), "rtt_ls": lambda i: raw.ls_rtt(buf)}
        rtts["rtt_sendrecv"] = lambda i: raw.sendrecv_rtt(buf)
        if self.floor.theirs is not None:
            rtts["rtt_floor"] = lambda i: self.floor.rtt(buf, out, i)
        one_way = {
            "bw_put": lambda i: raw.put_rtt(buf, True),
            "bw_ls": lambda i: raw.ls_rtt(buf, True),
        }
        for path, p2p in self.p2ps.items():
            rtts[f"rtt_{path}"] = lambda i, p2p=p2p: self.xccl_rtt(p2p, buf, i % 1000 + 1, cores)
            one_way[f"bw_{path}"] = lambda i, p2p=p2p: self.xccl_one_way(p2p, buf, cores)
            landing = p2p.mem.local[self.landing_at : self.landing_at + nbytes]
            one_way[f"bw_direct_{path}"] = lambda i, p2p=p2p, landing=landing: self.xccl_one_way(
                p2p, buf, cores, landing
            )
        got = {"rtt_floor": float("nan"), **self.timed_together(rtts, iters)}
        got.update({key: nbytes / s for key, s in self.timed_together(one_way, iters).items()})
        got["proj_ns"] = self.projected_send_ns(buf, cores)
        return got

    def row(self, nbytes: int, cores: int) -> dict:
        values = comm.gather(self.measure(nbytes, cores), root=0)
        if comm.rank != 0:
            return {}
        senders = [v for r, v in enumerate(values) if r % 2 == 0]
        med = {key: float(np.median([v[key] for v in senders])) for key in senders[0]}
        best = min(med["rtt_put"], med["rtt_ls"], med["rtt_sendrecv"])
        return {
            "bytes": nbytes,
            "cores": cores,
            "xccl_rtt_us": med["rtt_auto"] * 1e6,
            "xccl_rma_rtt_us": med["rtt_rma"] * 1e6,
            "put_rtt_us": med["rtt_put"] * 1e6,
            "ls_rtt_us": med["rtt_ls"] * 1e6,
            "sendrecv_rtt_us": med["rtt_sendrecv"] * 1e6,
            "floor_rtt_us": med["rtt_floor"] * 1e6,
            "rtt_vs_best": med["rtt_auto"] / best,
            "rtt_vs_floor": med["rtt_auto"] / med["rtt_floor"],
            "rtt_vs_put": med["rtt_auto"] / med["rtt_put"],
            "rma_rtt_vs_put": med["rtt_rma"] / med["rtt_put"],
            "xccl_gb_s": med["bw_auto"] / 1e9,
            "xccl_rma_gb_s": med["bw_rma"] / 1e9,
            "put_gb_s": med["bw_put"] / 1e9,
            "ls_gb_s": med["bw_ls"] / 1e9,
            "bw_vs_put": med["bw_auto"] / med["bw_put"],
            "rma_bw_vs_put": med["bw_rma"] / med["bw_put"],
            "xccl_direct_gb_s": med["bw_direct_auto"] / 1e9,
            "xccl_rma_direct_gb_s": med["bw_direct_rma"] / 1e9,
            "direct_bw_vs_put": med["bw_direct_auto"] / med["bw_put"],
            "rma_direct_bw_vs_put": med["bw_direct_rma"] / med["bw_put"],
            "proj_910c_send_us": med["proj_ns"] / 1e3,
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="launch.bench.p2p")
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--cores", type=int, nargs="+", required=True)
    parser.add_argument("--mode", choices=["sync", "async"], required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--slot-bytes", type=int, required=True)
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if comm.size % 2:
        raise SystemExit(f"bench p2p pairs ranks up: --np must be even, got {comm.size}")
    bench = Bench(args)
    rows = []
    for nbytes in args.sizes:
        for cores in args.cores:
            row = bench.row(nbytes, cores)
            if comm.rank == 0:
                rows.append(row)
                print(f"  measured {nbytes} B x {cores} cores", flush=True)
    bench.close()
    if comm.rank == 0:
        report(
            rows,
            COLUMNS,
            args,
            title=f"xds-mpi bench p2p: {comm.size} ranks ({comm.size // 2} pairs at once), "
            f"mode {args.mode}, ring {args.slots} x {args.slot_bytes} B",
            legend="xccl_*: XCCL on the load/store path (default on one node); xccl_rma_*: "
            "XCCL forced onto RMA (xccl.memory_path=rma). Raw baselines: put (Put+Flush+flag), "
            "ls (numpy stores into the peer's window + Win.Sync + flag), sendrecv; floor: the "
            "ring protocol's steps alone in plain numpy (nan: no load/store path). "
            "rtt_vs_best: xccl round trip / the fastest raw round trip; rtt_vs_floor: / the "
            "floor's; rtt_vs_put, "
            "rma_rtt_vs_put: / raw Put's (lower is better); bw_vs_put, rma_bw_vs_put: one-way "
            "bandwidth / raw Put's (higher is better); *direct*: the same, received into window "
            "memory (one copy for a message of more than one publication); "
            "proj_910c_send_us: one sync send on the virtual clock.",
        )


if __name__ == "__main__":
    main()
