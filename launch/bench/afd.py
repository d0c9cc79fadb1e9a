"""Per-rank program of `xds-mpi bench afd` (launch/bench/afd_command.py; under mpiexec, rank 0
reports).

One DP domain: ranks 0..G-1 are attention dies, the other E ranks expert dies (experts spread
evenly over them, E need not be a multiple of G). Every attention die sends `tokens` rows of
`hidden` float32 values to top-k experts (random routing, fixed seed); the experts are the
identity. Three variants move the same tokens in the same run:
  trampoline  A2E -> A2E' -> experts -> E2A' -> E2A (xccl/afd/buffer.py, Fig. 8)
  direct      A2E / E2A straight between attention and expert dies (no trampolines)
  colocated   XCCL dispatch/combine (Fig. 7) over all N dies, the expert dies sending 0 tokens
a2e_us / e2a_us: from a common start (after a barrier) until the slowest die finished its part of
the phase (dispatch / combine for colocated), median over iterations. meta_attn: records one
attention die writes per round; meta_max: the most any die writes. proj_910c_us: one round on
the virtual clock (slowest die).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from launch.bench.results import _fmt, rank_parser, write
from launch.report.tables import format_table
from xccl.afd.buffer import AfdBuffer, AfdCall
from xccl.ep.buffer import EpBuffer
from xccl.gmem import DieMemory
from xccl.moe_layout import AfdLayout, EpLayout
from xccl.vclock import LinkModel, VirtualClock
from xds_mpi.config.hardware import load_profile

comm = MPI.COMM_WORLD
COLUMNS = [
    "variant",
    "tokens",
    "a2e_us",
    "e2a_us",
    "round_us",
    "meta_attn",
    "meta_max",
    "proj_910c_us",
]
TIMEOUT_S = 300.0


def _spin(step, what: str):
    """Call step() until it returns something truthy; bounded."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (result := step()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {comm.rank}: {what} not done after {TIMEOUT_S:g} s")
        os.sched_yield()
    return result


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, groups = args, args.groups
        if not 1 <= groups < comm.size or comm.size - groups < groups:
            raise SystemExit(
                f"--groups({groups}) needs 1 <= G and G <= N - G expert dies (N = {comm.size})"
            )
        self.attention = tuple(range(groups))
        self.experts = tuple(range(groups, comm.size))
        num_experts_dies = len(self.experts)
        self.slot_owner = [
            self.experts[e * num_experts_dies // args.experts] for e in range(args.experts)
        ]
        self.log2phy = [(e,) for e in range(args.experts)]
        self.link = LinkModel.from_profile(load_profile(args.profile))
        self.is_attention = comm.rank in self.attention
        self.windows = []
        self.afd = {variant: self._afd_buffer(variant) for variant in ("trampoline", "direct")}
        self.ep = self._ep_buffer()
        self.num_calls = self.num_ep_rounds = 0

    def _afd_buffer(self, variant: str) -> AfdBuffer:
        """A2E/E2A over one DP domain in its own window, with or without trampolines."""
        args = self.args
        layout = AfdLayout(
            attention=self.attention,
            experts=self.experts,
            group_size=args.groups,
            base=(0,) * comm.size,
            num_lanes=1,
            hidden=args.hidden,
            max_tokens=max(args.tokens),
            top_k=args.topk,
            has_shared=False,
            itemsize=4,
            use_int8=args.int8,
        )
        mem = self._window(layout.area_bytes(layout.role_of(comm.rank)))
        return AfdBuffer(
            mem,
            layout,
            self.slot_owner,
            num_routed_slots=args.experts,
            use_trampolines=variant == "trampoline",
            dtype=np.float32,
            clock=VirtualClock(),
            link=self.link,
            timeout_s=TIMEOUT_S,
        )

    def _ep_buffer(self) -> EpBuffer:
        """Colocated dispatch/combine over all ranks in its own window."""
        args = self.args
        layout = EpLayout(
            members=tuple(range(comm.size)),
            base=(0,) * comm.size,
            hidden=args.hidden,
            max_tokens=max(args.tokens),
            num_columns=args.topk,
            itemsize=4,
            use_int8=args.int8,
        )
        return EpBuffer(
            self._window(layout.area_bytes()),
            layout,
            self.slot_owner,
            dtype=np.float32,
            clock=VirtualClock(),
            link=self.link,
            timeout_s=TIMEOUT_S,
        )

    def _window(self, nbytes: int) -> DieMemory:
        self.windows.append(DieMemory(comm, nbytes))
        return self.windows[-1]

    def close(self) -> None:
        comm.Barrier()
        for mem in self.windows:
            mem.free()

    def inputs(self, num_tokens: int):
        num_tokens = num_tokens if self.is_attention else 0
        rng = np.random.default_rng((11, comm.rank))
        x = rng.normal(size=(num_tokens, self.args.hidden)).astype(np.float32)
        topk = np.argsort(rng.random((num_tokens, self.args.experts)), axis=1)[:, : self.args.topk]
        return x, topk, rng.random((num_tokens, self.args.topk))

    # -- one round of each variant: (y, seconds of phase 1, seconds of phase 2) ------------------
    def afd_round(self, variant: str, x, topk, w):
        buf = self.afd[variant]
        call = AfdCall(call=self.num_calls, lane=0, domain=0, event_id=self.num_calls)
        self.num_calls += 1
        comm.Barrier()
        start, y = time.perf_counter(), None
        if self.is_attention:
            handle = buf.a2e(x, topk, w, call, log2phy=self.log2phy)
        else:
            if buf.is_trampoline and buf.use_trampolines:
                _spin(lambda: buf.try_forward(call), "A2E'")
            received = _spin(lambda: buf.try_receive(call), "A2E")
        a2e = time.perf_counter() - start
        comm.Barrier()
        start = time.perf_counter()
        if self.is_attention:
            y = buf.e2a(handle)
        else:
            buf.send_back(received, received.x)
            if buf.is_trampoline and buf.use_trampolines:
                _spin(lambda: buf.try_return(call), "E2A")
        return y, a2e, time.perf_counter() - start

    def ep_round(self, x, topk, w):
        self.num_calls += 1
        self.num_ep_rounds += 1
        comm.Barrier()
        start = time.perf_counter()
        recv_x, _, handle = self.ep.dispatch(x, topk, w, self.num_calls, log2phy=self.log2phy)
        dispatch = time.perf_counter() - start
        comm.Barrier()
        start = time.perf_counter()
        y = self.ep.combine(recv_x, handle)
        return y, dispatch, time.perf_counter() - start

    def row(self, variant: str, num_tokens: int) -> dict:
        x, topk, w = self.inputs(num_tokens)
        run = (
            (lambda: self.ep_round(x, topk, w))
            if variant == "colocated"
            else (lambda: self.afd_round(variant, x, topk, w))
        )
        y, _, _ = run()
        if self.is_attention and variant != "trampoline":
            y_ref, _, _ = self.afd_round("trampoline", x, topk, w)
            if not np.allclose(y, y_ref, rtol=1e-4, atol=1e-4):
                raise SystemExit(f"rank {comm.rank}: {variant} and trampoline A2E/E2A disagree")
        elif variant != "trampoline":
            self.afd_round("trampoline", x, topk, w)
        writes_before = self.metadata_writes(variant)
        phases = []
        for _ in range(self.args.iters):
            _, first, second = run()
            phases.append((comm.allreduce(first, op=MPI.MAX), comm.allreduce(second, op=MPI.MAX)))
        writes = (self.metadata_writes(variant) - writes_before) / self.args.iters
        clock = self.ep.clock if variant == "colocated" else self.afd[variant].clock
        comm.Barrier()
        start = clock.now_ns
        run()
        projected = comm.allreduce(clock.now_ns - start, op=MPI.MAX)
        a2e, e2a = (float(np.median(p)) for p in zip(*phases))
        meta_attn = comm.bcast(writes, root=0)
        return {
            "variant": variant,
            "tokens": num_tokens,
            "a2e_us": a2e * 1e6,
            "e2a_us": e2a * 1e6,
            "round_us": (a2e + e2a) * 1e6,
            "meta_attn": meta_attn,
            "meta_max": comm.allreduce(writes, op=MPI.MAX),
            "proj_910c_us": projected / 1e3,
        }

    def metadata_writes(self, variant: str) -> int:
        """Records this die wrote so far. Colocated: dispatch and combine each write one record
        into every member, so 2 N per round (EpBuffer keeps no counter)."""
        if variant == "colocated":
            return self.num_ep_rounds * 2 * comm.size
        return self.afd[variant].counters.metadata_writes


def main(argv: list[str] | None = None) -> None:
    parser = rank_parser("launch.bench.afd")
    parser.add_argument("--groups", type=int, required=True)
    args = parser.parse_args(argv)
    bench = Bench(args)
    rows = []
    for num_tokens in args.tokens:
        for variant in ("trampoline", "direct", "colocated"):
            rows.append(bench.row(variant, num_tokens))
        if comm.rank == 0:
            print(f"  measured {num_tokens} tokens per attention die", flush=True)
    bench.close()
    if comm.rank == 0:
        _report(args, rows)


def _report(args: argparse.Namespace, rows: list[dict]) -> None:
    """Rank 0: print the table with its legend and write --out."""
    print(
        f"\nxds-mpi bench afd: {comm.size} ranks = {args.groups} attention dies (1 DP "
        f"domain) + {comm.size - args.groups} expert dies, {args.experts} experts, top-"
        f"{args.topk}, hidden {args.hidden}, identity experts, float32 rows"
        f"{' (INT8 on the wire)' if args.int8 else ''}, profile {args.profile}"
    )
    print(
        format_table(
            COLUMNS,
            [[r[c] if isinstance(r[c], str) else _fmt(r[c]) for c in COLUMNS] for r in rows],
        )
    )
    print(
        "a2e_us/e2a_us: A2E (dispatch) and E2A (combine) until the slowest die is done; "
        "meta_attn: records one attention die writes per round (colocated: per die); "
        "proj_910c_us: one round on the virtual clock."
    )
    if args.out:
        is_h5 = Path(args.out).suffix in (".h5", ".hdf5")  # h5py stores bytes, not str
        write(
            [{**r, "variant": r["variant"].encode()} if is_h5 else r for r in rows],
            COLUMNS,
            Path(args.out),
            args,
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
