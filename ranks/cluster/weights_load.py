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
   `load_wall_s`, `load_check_s`, `load_bytes`, `load_path`, `load_source_te`; a fork group's
   `load_fork_group`, `load_fork_receivers` and `load_fork_wall_s`, the wall time from its
   first die's read until its last's: the concurrent reads of one source).

A TE drained and scaled out again keeps its weights (its dies still hold them): no second order,
`load_path` "kept". The virtual clock prices the scale-out as before (its `serves_s`).

A pool TE (docs/cluster.md "A pool of ranks") has new dies at every scale-out: before its order,
the JE sends its TE-shell (on the link) and each pool rank it took (on the world) the
`PoolActivation`; at its drain's end the TE-shell the `PoolRelease`; at the job's end every pool
rank the `PoolStop` (`stop_pool`). Each of its scale-outs has an order and a load. A pool TE may
be a fork's source (its dies' weights in their world slots, ranks/cluster/pool_window.py): the
order names its current ranks, and its release waits until every TE that forked from it has
reported its load (`poll_loads`, each JE round), since its dies zero their slots when released.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mpi4py import MPI

from ranks.cluster.messages import (
    TAG_CLUSTER_POOL,
    TAG_POOL_RANK,
    PoolActivation,
    PoolRelease,
    PoolStop,
)
from ranks.core.control import WaitTimeout, recv_from_each, send_to_each
from ranks.core.tags import TAG_CLUSTER_LOAD, TAG_CLUSTER_LOADED
from ranks.core.weights_window import (
    TAG_WEIGHTS_LOAD,
    TAG_WEIGHTS_LOADED,
    DieLoaded,
    LoadOrder,
    weights_window,
)
from xccl.wake import Doze
from xds_mpi.cluster.pool import ReleaseGate
from xds_mpi.cluster.scale_out import load_window
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

    @property
    def read_span(self) -> tuple[float, float]:
        """(first read's start, last read's end), time.time() of this host."""
        return min(d.read_start for d in self.dies), max(d.read_end for d in self.dies)


class ScaleOutLoads:
    """The JE's side: orders out at scale-outs, the TEs' loads in at the end."""

    def __init__(self, cfg, cluster, comm, log) -> None:
        self.cluster, self.comm, self.log = cluster, comm, log
        self.timeout_s = cfg.xccl.poll_timeout_s
        self.has_weights = {t.te for t in cluster.tes if not t.standby}
        self.num_seen = 0  # scale events looked at
        self.ordered: dict[int, int] = {}  # scale event index -> the TE ordered to load
        self.loaded: dict[int, TeLoaded] = {}  # scale event index -> its TE's load
        self.window = weights_window()  # the source dies' fork tables
        self.num_forks: dict[int, int] = {}  # source die's world rank -> forks noted there
        # scale event index -> its fork's TE-Load window and (source die, slot) where noted
        self.noted: dict[int, tuple[tuple[float, float], list[tuple[int, int]]]] = {}
        self.gate = ReleaseGate()  # a pool fork source's release after its readers' loads

    def send_orders(self, events, sends: list, pool=None) -> None:
        """A load order for each scale-out decided since the last call to a TE without weights
        (`events`: the autoscaler's, in decision order), a pool TE's activation before it, and
        first the release of each pool TE whose drain ended (`pool`: the autoscaler's RankPool);
        the sends go to `sends`."""
        self.gate.hold(pool.take_released() if pool is not None else [])
        self._release(sends)
        for index in range(self.num_seen, len(events)):
            te = events[index].te
            if events[index].pool_ranks and self.gate.is_held(te):
                self._await_readers(te, sends)  # its last turn's release first (rare)
            if events[index].kind != "out" or te in self.has_weights:
                continue
            if events[index].pool_ranks:
                self._activate(index, events[index], sends)
            order = self._order(index, events[index], pool)
            if order.path == "fork":
                self._note_fork(index, events[index], order)
                if pool is not None and pool.is_pool_te(order.source_te):
                    self.gate.read_by(order.source_te, index)
            sends.append(self.comm.isend(order, dest=te + 1, tag=TAG_CLUSTER_LOAD))
            self.ordered[index] = te
            self.has_weights.add(te)
        self.num_seen = len(events)
        self._renote(events)

    def poll_loads(self, sends: list) -> int:
        """The loads reported so far (without waiting) while a release waits for them; the
        releases they allow sent. The count of loads taken."""
        if not self.gate.held:
            return 0
        num = 0
        for index, te in self.ordered.items():
            if index not in self.loaded:
                message = self.comm.improbe(source=te + 1, tag=TAG_CLUSTER_LOADED)
                if message is not None:
                    loaded = message.recv()
                    self.loaded[loaded.event] = loaded
                    self.gate.load_reported(loaded.event)
                    num += 1
        self._release(sends)
        return num

    def _release(self, sends: list) -> None:
        """A `PoolRelease` to each ended pool turn's TE-shell whose fork readers all loaded."""
        read = {turn.te: sorted(self.gate.readers.get(turn.te, ())) for turn in self.gate.held}
        for turn in self.gate.due():
            if read[turn.te]:
                self.log.info(
                    "pool: TE %d released after the loads of the forks that read it (scale "
                    "events %s)",
                    turn.te,
                    read[turn.te],
                )
            release = PoolRelease(te=turn.te, at_s=turn.given_back_s)
            sends.append(self.comm.isend(release, dest=turn.te + 1, tag=TAG_CLUSTER_POOL))
            self.has_weights.discard(turn.te)  # its dies went back to the pool

    def _await_readers(self, te: int, sends: list) -> None:
        """Pool TE `te` scaled out again while its last turn's release waits for its readers:
        their loads (bounded), then the release, before the new activation."""
        deadline, doze = time.monotonic() + self.timeout_s, Doze()
        while self.gate.is_held(te):
            if not self.poll_loads(sends):
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"JE: the forks of scale events {self.gate.waiting_for(te)} from pool "
                        f"TE {te} have not reported their loads after {self.timeout_s:g} s"
                    )
                doze.pause()

    def _activate(self, index: int, event, sends: list) -> None:
        """Pool TE `event.te`'s activation to its TE-shell and to each pool rank it took."""
        info = self.cluster.tes[event.te]
        hosts = tuple(range(info.first_rank, info.first_rank + info.num_launched))
        activation = PoolActivation(te=event.te, event=index, members=(*hosts, *event.pool_ranks))
        for rank in event.pool_ranks:  # their fork tables were zeroed at their last release
            self.num_forks.pop(rank, None)
        self.noted = {  # forks noted there in an earlier turn: nothing to note again
            i: (window, where)
            for i, (window, where) in self.noted.items()
            if not any(rank in event.pool_ranks for rank, _ in where)
        }
        sends.append(self.comm.isend(activation, dest=event.te + 1, tag=TAG_CLUSTER_POOL))
        world = MPI.COMM_WORLD
        for rank in activation.members[1:]:  # a PD pair's decode TE-shell too
            sends.append(world.isend(activation, dest=rank, tag=TAG_POOL_RANK))
        self.log.info(
            "pool: TE %d formed of pool ranks %s (scale event %d)",
            event.te,
            event.pool_ranks,
            index,
        )

    def stop_pool(self) -> None:
        """Every pool rank out of its loop (bounded): the TEs have all sent their results."""
        ranks = (*self.cluster.pool_ranks, *self.cluster.pool_hosts)
        send_to_each(
            MPI.COMM_WORLD,
            dict.fromkeys(ranks, PoolStop()),
            tag=TAG_POOL_RANK,
            timeout_s=self.timeout_s,
            me="JE",
            event="stop to the pool ranks",
        )

    def _order(self, index: int, event, pool) -> LoadOrder:
        """Scale event `index`'s order: its planned path, a fork's source TE's world ranks (a
        pool TE's: its host ranks, then the pool ranks it holds now), a dram host's rank. A
        fallback reads nothing from the source that died."""
        path, source, cluster = event.path, event.source_te, self.cluster
        given = dict(event=index, source_te=source, fallback_from=event.fallback_from)
        if path == "fork":
            first, info = cluster.first_rank(source), cluster.tes[source]
            if info.is_pool:
                hosts = tuple(range(first, first + info.num_launched))
                ranks = (*hosts, *pool.ranks_of(source))
            else:
                ranks = tuple(range(first, first + info.size))
            return LoadOrder(path=path, source_ranks=ranks, **given)
        if path == "dram":
            return LoadOrder(path=path, host_rank=cluster.first_rank(event.te), **given)
        return LoadOrder(path=path, **given)

    def _note_fork(self, index: int, event, order: LoadOrder) -> None:
        """The fork's TE-Load window into each source die's fork table, complete there before
        the grant that lets the source start past the decision (its slowdown, charged by the
        die: docs/scaling.md)."""
        start_s, end_s = load_window(event.steps, event.decided_s)
        where = []
        for rank in order.source_ranks:
            if self.window.is_die_of[rank]:
                slot = self.num_forks.get(rank, 0)
                self.window.note_fork(rank, slot, start_s, end_s)
                self.num_forks[rank] = slot + 1
                where.append((rank, slot))
        self.noted[index] = ((start_s, end_s), where)

    def _renote(self, events) -> None:
        """A fork priced again at a later join (xds_mpi/cluster/fork_fanout.py): its new TE-Load
        window over the old in the same slots, before this decision's grant (the source has
        started no iteration past the decision, so none was charged by the old window's end)."""
        for index, (window, where) in self.noted.items():
            event = events[index]
            new = load_window(event.steps, event.decided_s)
            if new != window:
                for rank, slot in where:
                    self.window.note_fork(rank, slot, *new)
                self.noted[index] = (new, where)

    def collect(self) -> None:
        """Every ordered TE's load (bounded: each TE-shell sent it before its result)."""
        # a pool TE: one order per scale-out; those a release waited for are in already
        left = [te for index, te in self.ordered.items() if index not in self.loaded]
        while left:
            got = recv_from_each(
                self.comm,
                sorted({te + 1 for te in left}),
                tag=TAG_CLUSTER_LOADED,
                timeout_s=self.timeout_s,
                me="JE",
                event="weights loaded at scale-out",
            )
            self.loaded.update((loaded.event, loaded) for loaded in got.values())
            for shell in got:
                left.remove(shell - 1)
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
        columns["load_fork_group"] = [e.fork_group for e in events]
        columns["load_fork_receivers"] = [e.fork_receivers for e in events]
        walls = self.fork_walls(events)
        columns["load_fork_wall_s"] = [walls.get(e.fork_group, nan) for e in events]
        self.log_fork_groups(events, walls)  # once, with the columns at the end
        return columns

    def fork_walls(self, events) -> dict[int, float]:
        """Each fork group's wall time (this machine's) from its first die's read until its
        last's, over its members' loads: the concurrent reads of one source."""
        spans: dict[int, list[tuple[float, float]]] = {}
        for index, event in enumerate(events):
            loaded = self.loaded.get(index)
            if loaded is not None and event.fork_group >= 0 and loaded.path == "fork":
                spans.setdefault(event.fork_group, []).append(loaded.read_span)
        return {
            group: max(end for _, end in s) - min(start for start, _ in s)
            for group, s in spans.items()
        }

    def log_fork_groups(self, events, walls: dict[int, float]) -> None:
        """A line per fork group of more than one TE: its TEs, source, reads' wall time."""
        for group, wall_s in walls.items():
            members = [e.te for e in events if e.kind == "out" and e.fork_group == group]
            if len(members) > 1:
                self.log.info(
                    "fork group of TE %d: TEs %s read TE %d's dies at once: %.4f s wall from "
                    "the first read to the last (this machine)",
                    group,
                    members,
                    next(e.source_te for e in events if e.fork_group == group),
                    wall_s,
                )


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
