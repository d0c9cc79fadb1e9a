"""A standby colocated die's weights at scale-out (DeepServe §6.2; docs/scaling.md, "Weights at
scale-out"). The die starts over a model of zeroed weights (its window,
ranks/core/weights_window.py, is zeroed) and hosts no expert. When the JE scales out to its TE,
the TE-shell passes on the JE's `LoadOrder`; the die then

1. moves each of its tensors into its own window by the path the order names: `fork`,
   one-sided reads from the same die of a serving TE of its shape (the same tensors at the same
   offsets; a source scaled out earlier is read once its `is_loaded` word says its own weights
   arrived); `dram`, from its TE-shell's window holding the packed model; `cold` / `ems`, from
   the file. A fork whose source died mid-fork comes as its fallback's order (dram or cold):
   nothing is read from the dead source;
2. checks every tensor against the checksum it took from the file at start-up;
3. builds its model over its window and makes its hosted experts, as a serving die does at
   start-up, marks its window loaded (a source for the next fork), and reports the wall time
   and bytes to its TE-shell.

It does so when the order reaches it, and at the latest before its first busy iteration (it
waits for the order then, bounded). The virtual clock does not see any of it: the scale event's
priced steps stay what they are (xds_mpi/scaling/).
"""

from __future__ import annotations

import time

from mpi4py import MPI

from ranks.core.control import WaitTimeout, wait_all
from ranks.core.messages import SHELL
from ranks.core.weights_window import (
    TAG_WEIGHTS_LOAD,
    TAG_WEIGHTS_LOADED,
    DieLoaded,
    LoadOrder,
    WeightsWindow,
)
from xccl.wake import Doze
from xds_mpi.execution.executor import ColocatedExecutor
from xds_mpi.model.packed import checksum, tensor_bytes
from xds_mpi.model.weights import build_model, stored_weights


class LoadingExecutor(ColocatedExecutor):
    """A standby die's executor: over the zeroed model until `take_model`, before its first
    iteration."""

    def take_model(self, model) -> None:
        if self.num_iterations:
            raise RuntimeError(f"weights taken after {self.num_iterations} iterations")
        self.model = model
        self.build_hosted_experts()


class StandbyWeights:
    """The die's side of its load: the order from its TE-shell, the pull, the check, the model."""

    def __init__(self, comm: MPI.Comm, cfg, window: WeightsWindow) -> None:
        self.comm, self.cfg, self.window = comm, cfg, window
        self.timeout_s = cfg.xccl.poll_timeout_s
        self.where = f"die rank {comm.rank} of TE {window.te} (world rank {window.world_rank})"
        self.sends: list[MPI.Request] = []

    def source(self):
        """The model's weight source: this die's window (zeroed until the pull)."""
        return self.window.weights(self.where)

    def take(self, *, wait: bool):
        """The model over the pulled weights once the order came (None before it); `wait`: the
        die has work, so the order must come (bounded)."""
        order = self._order(wait)
        if order is None:
            return None
        started, read_start = time.perf_counter(), time.time()
        peer = self.pull(order)  # Step 1
        moved, read_end = time.perf_counter(), time.time()
        self.check(order, peer)  # Step 2
        model = build_model(  # Step 3
            self.cfg.model, unpacked_under=self.cfg.run.output_dir, source=self.source()
        )
        self.window.mark_loaded()
        layout = self.window.layout
        loaded = DieLoaded(
            die_rank=self.comm.rank,
            event=order.event,
            path=order.path,
            wall_s=moved - started,
            check_s=time.perf_counter() - moved,
            num_bytes=layout.tensor_bytes,
            num_tensors=len(layout.tensors),
            peer=peer,
            read_start=read_start,
            read_end=read_end,
        )
        self.sends.append(self.comm.isend(loaded, dest=SHELL, tag=TAG_WEIGHTS_LOADED))
        return model

    def _order(self, wait: bool) -> LoadOrder | None:
        deadline, doze = time.monotonic() + self.timeout_s, Doze()
        while (message := self.comm.improbe(source=SHELL, tag=TAG_WEIGHTS_LOAD)) is None:
            if not wait:
                return None
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"{self.where}: has requests but no weights: no load order from its TE-shell "
                    f"(rank {SHELL}) after {self.timeout_s:g} s (the JE's scale-out to TE "
                    f"{self.window.te} not passed on)"
                )
            doze.pause()
        return message.recv()

    def pull(self, order: LoadOrder) -> int:
        """Each tensor into this die's window by `order.path`; the world rank read from (-1:
        the file)."""
        window = self.window
        mem, layout = window.mem, window.layout
        if order.path == "fork":  # the same die of the source TE: the same layout
            peer, offset_of = order.source_ranks[self.comm.rank], (lambda t: t.offset)
            self._wait_loaded(peer, order)
        elif order.path == "dram":  # the host's packed model
            peer, offset_of = order.host_rank, (lambda t: window.model_layout.find(t.name).offset)
        else:  # cold / ems: the file
            stored, _, _ = stored_weights(self.cfg.model, unpacked_under=self.cfg.run.output_dir)
            for t in layout.tensors:
                tensor_bytes(mem.local, t)[:] = stored.value(t.name).reshape(-1).view("u1")
            mem.sync()
            return -1
        for t in layout.tensors:
            mem.get(peer, offset_of(t), tensor_bytes(mem.local, t))
        mem.flush(peer)  # every Get complete
        mem.sync()
        return peer

    def _wait_loaded(self, peer: int, order: LoadOrder) -> None:
        """Until the source die's `is_loaded` word is set (bounded): at once for a TE serving
        from the start; a TE scaled out earlier (a chain) may still be pulling its own."""
        mem, offset = self.window.mem, self.window.loaded_offset
        deadline, doze = time.monotonic() + self.timeout_s, Doze()
        while not mem.fetch_word(peer, offset):
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"{self.where}: fork source world rank {peer} (TE {order.source_te}) has not "
                    f"loaded its own weights after {self.timeout_s:g} s (scale event {order.event})"
                )
            mem.serve_far_peers()
            doze.pause()

    def check(self, order: LoadOrder, peer: int) -> None:
        """Every tensor's bytes against its checksum from the file."""
        layout, local = self.window.layout, self.window.mem.local
        wrong = [
            t.name
            for t in layout.tensors
            if checksum(tensor_bytes(local, t)) != self.window.sums[t.name]
        ]
        if wrong:
            source = f"world rank {peer}" if peer >= 0 else "the file"
            raise RuntimeError(
                f"{self.where}: {len(wrong)} of {len(layout.tensors)} tensors arrived wrong by "
                f"{order.path} from {source} (scale event {order.event}): {wrong[:4]}"
            )

    def drain(self) -> None:
        """Complete the report sent (bounded)."""
        wait_all(self.sends, timeout_s=self.timeout_s, me=self.where, event="load report")
        self.sends = []


def standby_weights(comm: MPI.Comm, cfg, window: WeightsWindow | None) -> StandbyWeights | None:
    """A standby TE's die's load, or None (any other die: its weights from the file)."""
    if window is None or not window.is_standby:
        return None
    return StandbyWeights(comm, cfg, window)
