"""Weights at scale-out, the JE's and the TE-shell's sides (docs/scaling.md, "Weights at
scale-out"; the dies' side: ranks/colocated/weights_pull.py).

1. The JE (`ScaleOutLoads.send_orders`), at the routing decision that scales out to a standby TE
   for the first time: a `LoadOrder` to its TE-shell on the link (TAG_CLUSTER_LOAD), before the
   grant that may route requests there, naming the TE-Load path the autoscaler planned
   (xds_mpi/cluster/scale_out.py: the TE's `scaling.path`, or a fork's fallback when its source
   dies mid-fork) and its source: fork, the world ranks of the serving TE of its shape the
   autoscaler chose (one scaled out earlier too: a chain); dram, its own TE-shell's window (the
   packed model).
2. The TE-shell (`TeWeightsLoad`; a PD pair's: its JE, to its prefill and decode dies) passes it
   on to each of its dies (TAG_WEIGHTS_LOAD) and keeps
   serving until every die reported (TAG_WEIGHTS_LOADED), bounded; then it sends the JE the
   TE's `TeLoaded` (TAG_CLUSTER_LOADED).
3. The JE takes them at the end and writes them beside the scale events (`/cluster/scaling`
   `load_wall_s`, `load_check_s`, `load_bytes`, `load_path`, `load_source_te`).

A TE drained and scaled out again keeps its weights (its dies still hold them): no second order,
`load_path` "kept". The virtual clock prices the scale-out as before (its `serves_s`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ranks.core.control import WaitTimeout, recv_from_each
from ranks.core.tags import TAG_CLUSTER_LOAD, TAG_CLUSTER_LOADED
from ranks.core.weights_window import TAG_WEIGHTS_LOAD, TAG_WEIGHTS_LOADED, DieLoaded, LoadOrder
from xds_mpi.plan.cluster import JE_RANK


@dataclass(frozen=True, kw_only=True)
class TeLoaded:
    """A TE's load at a scale-out: wall_s, check_s: its slowest die's move, and checks and
    model; num_bytes: every die's tensors moved; dies: each die's `DieLoaded`."""

    te: int
    event: int
    path: str
    source_te: int
    wall_s: float
    check_s: float
    num_bytes: int
    dies: tuple[DieLoaded, ...]


class ScaleOutLoads:
    """The JE's side: orders out at scale-outs, the TEs' loads in at the end."""

    def __init__(self, cfg, cluster, comm, log) -> None:
        self.cluster, self.comm, self.log = cluster, comm, log
        self.timeout_s = cfg.xccl.poll_timeout_s
        self.has_weights = {t.te for t in cluster.tes if not t.standby}
        self.num_seen = 0  # scale events looked at
        self.ordered: dict[int, int] = {}  # scale event index -> the TE ordered to load
        self.loaded: dict[int, TeLoaded] = {}  # scale event index -> its TE's load

    def send_orders(self, events, sends: list) -> None:
        """A load order for each scale-out decided since the last call to a TE without weights
        (`events`: the autoscaler's, in decision order); the sends go to `sends`."""
        for index in range(self.num_seen, len(events)):
            te = events[index].te
            if events[index].kind != "out" or te in self.has_weights:
                continue
            order = self._order(index, events[index])
            sends.append(self.comm.isend(order, dest=te + 1, tag=TAG_CLUSTER_LOAD))
            self.ordered[index] = te
            self.has_weights.add(te)
        self.num_seen = len(events)

    def _order(self, index: int, event) -> LoadOrder:
        """Scale event `index`'s order: its planned path, a fork's source TE's world ranks, a
        dram host's rank. A fallback reads nothing from the source that died."""
        path, source, cluster = event.path, event.source_te, self.cluster
        given = dict(event=index, source_te=source, fallback_from=event.fallback_from)
        if path == "fork":
            first = cluster.first_rank(source)
            ranks = tuple(range(first, first + cluster.tes[source].size))
            return LoadOrder(path=path, source_ranks=ranks, **given)
        if path == "dram":
            return LoadOrder(path=path, host_rank=cluster.first_rank(event.te), **given)
        return LoadOrder(path=path, **given)

    def collect(self) -> None:
        """Every ordered TE's load (bounded: each TE-shell sent it before its result)."""
        got = recv_from_each(
            self.comm,
            sorted(te + 1 for te in self.ordered.values()),  # one order per TE at most
            tag=TAG_CLUSTER_LOADED,
            timeout_s=self.timeout_s,
            me="JE",
            event="weights loaded at scale-out",
        )
        self.loaded = {loaded.event: loaded for loaded in got.values()}
        for loaded in self.loaded.values():
            self.log.info(
                "TE %d: weights by %s%s: %d bytes to %d dies in %.4f s (checks and model %.4f s)",
                loaded.te,
                loaded.path,
                f" from TE {loaded.source_te}" if loaded.source_te >= 0 else "",
                loaded.num_bytes,
                len(loaded.dies),
                loaded.wall_s,
                loaded.check_s,
            )

    def columns(self, events) -> dict[str, list]:
        """Per scale event: load_wall_s, load_check_s, load_bytes, load_path, load_source_te (a
        drain: nan, nan, 0, "", -1; a TE that kept its weights: 0, 0, 0, "kept", -1); from the
        autoscaler's plan, load_fallback_from (b"fork" when the fork's source died mid-fork,
        load_path then the fallback's, load_source_te the dead source; else b"") and
        load_fallback_s (the virtual seconds the fallback added; 0 without)."""
        nan = float("nan")
        columns: dict[str, list] = {
            k: [] for k in ("load_wall_s", "load_check_s", "load_bytes", "load_path")
        }
        columns["load_source_te"] = []
        for index, event in enumerate(events):
            loaded = self.loaded.get(index)
            if loaded is not None:
                row = (
                    loaded.wall_s,
                    loaded.check_s,
                    loaded.num_bytes,
                    loaded.path,
                    loaded.source_te,
                )
            elif event.kind == "out":
                row = (0.0, 0.0, 0, "kept", -1)
            else:
                row = (nan, nan, 0, "", -1)
            for key, value in zip(columns, row, strict=True):
                columns[key].append(value)
        # bytes, not str: written as they are (h5py stores fixed-length bytes)
        columns["load_fallback_from"] = [e.fallback_from.encode() for e in events]
        columns["load_fallback_s"] = [e.fallback_s for e in events]
        return columns


class TeWeightsLoad:
    """The TE-shell's side: the JE's order to its dies, their loads to the JE."""

    def __init__(self, frontend, link) -> None:
        self.comm, self.link, self.sends = frontend.comm, link, frontend.sends
        # A colocated TE's dies; a PD pair's prefill and decode dies (its JE is the TE-shell)
        roles = ("colocated", "prefill")
        self.dies = [info.rank for info in frontend.ctx.topo.ranks if info.role in roles]
        self.timeout_s = frontend.ctx.cfg.xccl.poll_timeout_s
        self.order: LoadOrder | None = None
        self.loaded: dict[int, DieLoaded] = {}
        self.deadline = 0.0

    @property
    def is_pending(self) -> bool:
        """An order passed on whose dies have not all reported."""
        return self.order is not None

    def take_order(self, order: LoadOrder) -> None:
        if self.order is not None:
            raise RuntimeError(
                f"TE-shell of TE {self.link.te}: load order for scale event {order.event} while "
                f"the dies still load for scale event {self.order.event}"
            )
        self.order, self.loaded = order, {}
        self.deadline = time.monotonic() + self.timeout_s
        for die in self.dies:
            self.sends.append(self.comm.isend(order, dest=die, tag=TAG_WEIGHTS_LOAD))

    def turn(self) -> int:
        """The dies' reports; once all are in, the TE's to the JE."""
        if self.order is None:
            return 0
        num = 0
        for die in self.dies:
            message = self.comm.improbe(source=die, tag=TAG_WEIGHTS_LOADED)
            if message is not None:
                self.loaded[die] = message.recv()
                num += 1
        missing = [die for die in self.dies if die not in self.loaded]
        if not missing:
            self._report()
            return num + 1
        if time.monotonic() > self.deadline:
            raise WaitTimeout(
                f"TE-shell of TE {self.link.te}: no weights loaded by die rank(s) {missing} "
                f"after {self.timeout_s:g} s ({self.order.path}, scale event {self.order.event})"
            )
        return num

    def _report(self) -> None:
        order, dies = self.order, tuple(self.loaded[d] for d in self.dies)
        loaded = TeLoaded(
            te=self.link.te,
            event=order.event,
            path=order.path,
            source_te=order.source_te,
            wall_s=max(d.wall_s for d in dies),
            check_s=max(d.check_s for d in dies),
            num_bytes=sum(d.num_bytes for d in dies),
            dies=dies,
        )
        self.sends.append(self.link.comm.isend(loaded, dest=JE_RANK, tag=TAG_CLUSTER_LOADED))
        self.order = None
