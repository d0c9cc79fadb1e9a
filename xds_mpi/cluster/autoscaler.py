"""The JE's autoscaler (DeepServe §6: the cluster manager scales TEs on load; docs/cluster.md
"Scaling"), on the virtual clock: at each routing decision it looks at the serving TEs' load then
and may scale out (a standby TE serves once its scale-out time has passed: its scaling steps,
`autoscaler.scale_out_s` or priced per TE-Load path) or in (the least loaded serving TE is
drained: no new request, and once its last one finished it is standby again). Pure: its events
depend only on the decisions' virtual times and the loads then, so a run's scaling is the same
on any machine.

The metric, `autoscaler.metric`: "load", unfinished requests per die of the serving TEs, averaged
over the decisions of the last `window_s`; or "slo", the share of the requests finished in the
last `window_s` whose TTFT missed `run.slo_ttft_ms` or whose TPOT missed `run.slo_tpot_ms` (the
TE-shells report each finish with its first token's virtual time and its tokens; no finish in
the window: no event). A scale event waits `cooldown_s` after the previous one; the serving TEs
(those scaling out counted) stay within [min_tes, max_tes]. A TE found lost serves no more and is
no standby TE. How a scale-out loads its TE (its path, a fork's source, a fallback when that
source dies mid-fork) is its planner's (xds_mpi/cluster/scale_out.py).

A pool TE (`cluster.groups` row with `pool: true`) takes its dies from the pool of ranks
(xds_mpi/cluster/pool.py) at its scale-out and gives them back at its drain: the autoscaler scales
out to the first standby TE whose dies fit the free pool ranks, passing over a pool TE that does
not fit (counted, `RankPool.num_skips`); when none fits, it scales out at a later decision
(counted, `RankPool.num_waits`). A drained pool TE's ranks are free from the first decision after
its last finish, and the TE goes behind the standby TEs that have not served since (so the
pool's ranks rotate between the pool TEs' shapes instead of returning to the lowest-numbered).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, replace

from xds_mpi.cluster.pool import RankPool
from xds_mpi.cluster.scale_out import FixedSteps, PricedPaths, TeScaling

INF = float("inf")


def scale_out_steps(cfg, te, num_new_tes: int = 1) -> tuple[tuple[str, float], ...]:
    """(name, virtual seconds) of each step from scaling out to TE `te` (xds_mpi/plan/cluster.py
    TeInfo) until it serves: one step of `autoscaler.scale_out_s`, or DeepServe's five scaling
    steps priced with the TE's own config's `scaling` section for a TE of
    `autoscaler.pod_dies` dies (docs/scaling.md), `num_new_tes` loading at once."""
    if cfg.autoscaler.scale_out_s is not None:
        return (("scale-out (autoscaler.scale_out_s)", cfg.autoscaler.scale_out_s),)
    # Lazy imports: an autoscaled cluster's only.
    from xds_mpi.plan.cluster import te_config
    from xds_mpi.scaling.steps import scale_out

    te_cfg = te_config(cfg, te.overrides)
    steps = scale_out(te_cfg, num_dies=cfg.autoscaler.pod_dies, num_new_tes=num_new_tes).steps
    if te.is_pool and te_cfg.scaling.prewarmed_tes:
        return pool_te_steps(steps, te_cfg.scaling.comm_init_s)
    return steps


def pool_te_steps(steps, comm_init_s: float) -> tuple[tuple[str, float], ...]:
    """A pool TE's steps (docs/cluster.md "A pool of ranks"): its TE-shell and its pool ranks
    are pre-warmed (runtime imported, NPU set up), but its communication domain is formed at
    the scale-out, so TE-Pre-Load is `scaling.comm_init_s` (an assumption, as for any TE)
    instead of a pre-warmed TE's 0."""
    return tuple(
        (name, comm_init_s if name == "TE-Pre-Load" else seconds) for name, seconds in steps
    )


def scale_out_s(cfg, te) -> float:
    """The virtual seconds of `scale_out_steps`."""
    return sum(seconds for _, seconds in scale_out_steps(cfg, te))


def priced_paths(cfg, tes) -> PricedPaths:
    """The planner of a cluster's scale-outs (tes: xds_mpi/plan/cluster.py TeInfo): each TE's
    path and steps, a fork TE's fallback (`autoscaler.fork_fallback`) and its TEs of the same
    shape, the TEs lost by `cluster.te_losses`."""
    # Lazy import: an autoscaled cluster's only.
    from xds_mpi.plan.cluster import te_config

    shapes = [_shape(te_config(cfg, t.overrides)) for t in tes]
    fallback = cfg.autoscaler.fork_fallback
    infos = []
    for t in tes:
        path = te_config(cfg, t.overrides).scaling.path
        info = TeScaling(path=path, steps=scale_out_steps(cfg, t))
        if path == "fork":
            as_fallback = _with_path(t, fallback)
            info = TeScaling(
                path=path,
                steps=info.steps,
                fallback_path=fallback,
                fallback_steps=scale_out_steps(cfg, as_fallback),
                # a pool TE too: the JE names its current turn's ranks (ranks/cluster/
                # weights_load.py), its dies expose their weights in their world slot
                same_shape=frozenset(u.te for u in tes if shapes[u.te] == shapes[t.te]) - {t.te},
                # the k-th TE one source feeds at once (xds_mpi/cluster/fork_fanout.py)
                fanout_steps=tuple(scale_out_steps(cfg, t, k) for k in range(1, len(tes))),
                fanout=te_config(cfg, t.overrides).scaling.fork_fanout,
            )
        infos.append(info)
    return PricedPaths(infos, {loss.te: loss.at_s for loss in cfg.cluster.te_losses})


def fork_source_pool_tes(cfg, tes) -> set[int]:
    """The pool TEs (tes: xds_mpi/plan/cluster.py TeInfo) that a TE scaled out by NPU-fork may
    read: those of another fork TE's shape. Their dies' world slots are reserved at launch
    (ranks/core/weights_window.py); none without one."""
    # Lazy import: an autoscaled cluster's only.
    from xds_mpi.plan.cluster import te_config

    configs = {t.te: te_config(cfg, t.overrides) for t in tes}
    forks = [(te, _shape(c)) for te, c in configs.items() if c.scaling.path == "fork"]
    return {
        t.te
        for t in tes
        if t.is_pool and any(u != t.te and s == _shape(configs[t.te]) for u, s in forks)
    }


def _shape(te_cfg) -> dict:
    """A TE's shape: its config but the scaling section (the same dies, slots and tensors)."""
    return {k: v for k, v in te_cfg.to_dict().items() if k != "scaling"}


def _with_path(te, path: str):
    """TE `te` (a TeInfo) as if its scaling.path were `path`."""
    return replace(te, overrides=(*te.overrides, f"scaling.path={path}"))


def make_autoscaler(cfg, tes, pool_ranks: tuple[int, ...] = ()) -> Autoscaler:
    """The JE's autoscaler for a cluster's TEs (xds_mpi/plan/cluster.py TeInfo) and its pool's
    world ranks (ClusterPlan.pool_ranks)."""
    pool_tes = {t.te: t.num_dies for t in tes if t.is_pool}
    return Autoscaler(
        cfg.autoscaler,
        [t.num_dies for t in tes],
        {t.te for t in tes if t.standby},
        priced_paths(cfg, tes),
        slo_ttft_s=cfg.run.slo_ttft_ms / 1e3,
        slo_tpot_s=cfg.run.slo_tpot_ms / 1e3,
        pool=RankPool(pool_ranks, pool_tes) if pool_tes else None,
    )


@dataclass(frozen=True, kw_only=True)
class ScaleEvent:
    """kind "out" (te serves from serves_s on) or "in" (te drained from decided_s on; standby
    again at its last finish, `standby_s`, filled in when it is known: inf until then)."""

    kind: str
    te: int
    decided_s: float
    serves_s: float
    load: float  # the metric's value then (autoscaler.metric: load per die, or the SLO misses)
    steps: tuple[tuple[str, float], ...] = ()  # a scale-out's steps, (name, virtual s)
    path: str = ""  # a scale-out's TE-Load path that loaded the weights
    source_te: int = -1  # fork: the TE read from; a fallback: the source that died mid-fork
    fallback_from: str = ""  # "fork" when its source died mid-fork (path: the fallback)
    fallback_s: float = 0.0  # the virtual seconds the fallback added to the fork as priced
    fork_group: int = -1  # a fork's group: its first TE (TEs sharing one source; -1: no fork)
    fork_receivers: int = 0  # the group's new TEs with this one (its TE-Load priced for them)
    pool_ranks: tuple[int, ...] = ()  # a pool TE's scale-out: the pool's world ranks it took


class Autoscaler:
    """TEs 0..N-1; `standby`: those that start in standby (not serving); planner: a scale-out's
    plan (xds_mpi/cluster/scale_out.py: its steps, path and source), or per TE the fixed steps
    (name, virtual s) from a scale-out decision until it serves; pool: the pool of ranks the
    pool TEs' dies come from (None: no pool TE)."""

    def __init__(
        self,
        cfg,
        num_dies: list[int],
        standby: set[int],
        planner,
        *,
        slo_ttft_s: float = INF,
        slo_tpot_s: float = INF,
        pool: RankPool | None = None,
    ) -> None:
        self.cfg = cfg  # the autoscaler section
        self.pool = pool
        self.giving_back: list[int] = []  # pool TEs drained since the last decision
        self.drained_at: dict[int, float] = {}  # pool TE -> the decision that took its ranks back
        self.planner = planner if hasattr(planner, "plan") else FixedSteps(planner)
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.finishes: list[tuple[float, bool]] = []  # (finish s, an SLO missed), by finish
        self.lost: set[int] = set()
        self.num_dies = num_dies
        self.serves_from = {te: (INF if te in standby else 0.0) for te in range(len(num_dies))}
        self.draining: set[int] = set()
        self.events: list[ScaleEvent] = []
        self.samples: deque[tuple[float, float]] = deque()  # (decision s, load then)
        self.last_event_s = -INF
        self.max_tes = cfg.max_tes or len(num_dies)

    def serving(self, now_s: float) -> list[int]:
        """The TEs a request may be routed to at `now_s`."""
        return [
            te
            for te, t in self.serves_from.items()
            if t <= now_s and te not in self.draining and te not in self.lost
        ]

    def observe(self, now_s: float, unfinished: list[int]) -> ScaleEvent | None:
        """At a routing decision at `now_s` with each TE's unfinished requests then: the scale
        event it decides, if any."""
        self._give_back(now_s)
        serving = self.serving(now_s)
        mean = self._metric(now_s, unfinished, serving)
        if mean is None or now_s < self.last_event_s + self.cfg.cooldown_s:
            return None
        alive = [(te, t) for te, t in self.serves_from.items() if te not in self.lost]
        coming = [te for te, t in alive if now_s < t < INF]
        # lowest-numbered first; a drained pool TE behind those that have not served since
        standby = sorted(
            (te for te, t in alive if t == INF), key=lambda te: (self.drained_at.get(te, -INF), te)
        )
        event = None
        if mean > self.cfg.scale_out_above and standby:
            te = self._fitting(standby) if len(serving) + len(coming) < self.max_tes else None
            if te is not None:
                ranks = self.pool.take(te, now_s) if self.pool and self.pool.is_pool_te(te) else ()
                plan = self.planner.plan(te, now_s, serving, unfinished)
                # a fork joins its fork group; the members it slows priced again
                self._reprice(self.planner.taken(te, now_s, plan))
                self.serves_from[te] = now_s + plan.total_s
                event = ScaleEvent(
                    kind="out",
                    te=te,
                    decided_s=now_s,
                    serves_s=self.serves_from[te],
                    load=mean,
                    steps=plan.steps,
                    path=plan.path,
                    source_te=plan.source_te,
                    fallback_from=plan.fallback_from,
                    fallback_s=plan.fallback_s,
                    fork_group=plan.fork_group,
                    fork_receivers=plan.fork_receivers,
                    pool_ranks=ranks,
                )
        elif mean < self.cfg.scale_in_below and len(serving) > self.cfg.min_tes and not coming:
            te = min(serving, key=lambda t: (unfinished[t], -t))
            self.draining.add(te)
            if not unfinished[te]:  # nothing to finish first: standby at once
                self.drained(te)
                self._give_back(now_s)
            event = ScaleEvent(kind="in", te=te, decided_s=now_s, serves_s=INF, load=mean)
        if event is not None:
            self.events.append(event)
            self.last_event_s = now_s
            self.samples.clear()  # the next window starts with the new set of TEs
        return event

    def _reprice(self, repriced) -> None:
        """Earlier fork group members still in TE-Load, priced again at a join (none has served:
        their serves_s is after this decision): their scale-out events' steps and serves_s."""
        for r in repriced:
            index = max(i for i, e in enumerate(self.events) if e.kind == "out" and e.te == r.te)
            event = self.events[index]
            serves_s = event.decided_s + sum(seconds for _, seconds in r.steps)
            self.events[index] = replace(event, steps=r.steps, serves_s=serves_s)
            self.serves_from[r.te] = serves_s

    def _fitting(self, standby: list[int]) -> int | None:
        """The first standby TE whose dies the pool can give (any TE not of the pool); a pool
        TE passed over, or none fitting, counted."""
        if self.pool is None:
            return standby[0]
        te = next((te for te in standby if self.pool.can_take(te)), None)
        if te is None:
            self.pool.num_waits += 1
        elif te != standby[0]:
            self.pool.num_skips += 1
        return te

    def _give_back(self, now_s: float) -> None:
        """The pool ranks of the pool TEs drained since the last decision, free from now_s."""
        for te in self.giving_back:
            self.pool.give_back(te, now_s)
            self.drained_at[te] = now_s
        self.giving_back = []

    def finished(self, finish_s: float, ttft_s: float, tpot_s: float = math.nan) -> None:
        """A request's finish as a TE-shell reported it (before or after `observe` reaches its
        time: only the finishes up to a decision's time count for it); tpot_s nan: one token,
        no TPOT to miss."""
        missed = ttft_s > self.slo_ttft_s or tpot_s > self.slo_tpot_s  # nan > x is False
        bisect.insort(self.finishes, (finish_s, missed))

    def _metric(self, now_s: float, unfinished: list[int], serving: list[int]) -> float | None:
        if self.cfg.metric == "slo":
            lo = bisect.bisect_right(self.finishes, (now_s - self.cfg.window_s, True))
            hi = bisect.bisect_right(self.finishes, (now_s, True))
            window = self.finishes[lo:hi]
            return sum(missed for _, missed in window) / len(window) if window else None
        dies = sum(self.num_dies[te] for te in serving) or 1
        self.samples.append((now_s, sum(unfinished[te] for te in serving) / dies))
        while self.samples[0][0] < now_s - self.cfg.window_s:
            self.samples.popleft()
        return sum(x for _, x in self.samples) / len(self.samples)

    def lose(self, te: int, lost_s: float = math.nan) -> None:
        """TE `te` (lost at `lost_s`) found lost: it serves no more, drains no more, and is no
        standby TE; a pool TE's ranks leave the pool with it (xds_mpi/cluster/pool.py)."""
        self.lost.add(te)
        self.draining.discard(te)
        if self.pool is not None and self.pool.is_pool_te(te):  # its drain gives back none
            self.pool.lose(te, lost_s)

    def drained(self, te: int) -> None:
        """A draining TE's last request finished: standby again."""
        if te in self.draining:
            self.draining.discard(te)
            self.serves_from[te] = INF
            if self.pool is not None and self.pool.is_pool_te(te):
                self.giving_back.append(te)
