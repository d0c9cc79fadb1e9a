"""The JE's autoscaler (DeepServe §6: the cluster manager scales TEs on load; docs/cluster.md
"Scaling"), on the virtual clock: at each routing decision it looks at the serving TEs' load then
and may scale out (a standby TE serves once its scale-out time has passed: its scaling steps,
`autoscaler.scale_out_s` or priced per TE-Load path) or in (the least loaded serving TE is
drained: no new request, and once its last one finished it is standby again). Pure: its events
depend only on the decisions' virtual times and the loads then, so a run's scaling is the same
on any machine.

The metric, `autoscaler.metric`: "load", unfinished requests per die of the serving TEs, averaged
over the decisions of the last `window_s`; or "slo", the share of the requests finished in the
last `window_s` whose TTFT missed `run.slo_ttft_ms` (the TE-shells report each finish with its
first token's virtual time; no finish in the window: no event). A scale event waits `cooldown_s`
after the previous one; the serving TEs (those scaling out counted) stay within [min_tes, max_tes].
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

INF = float("inf")


def scale_out_steps(cfg, te) -> tuple[tuple[str, float], ...]:
    """(name, virtual seconds) of each step from scaling out to TE `te` (xds_mpi/plan/cluster.py
    TeInfo) until it serves: one step of `autoscaler.scale_out_s`, or DeepServe's five scaling
    steps priced with the TE's own config's `scaling` section for a TE of
    `autoscaler.pod_dies` dies (docs/scaling.md)."""
    if cfg.autoscaler.scale_out_s is not None:
        return (("scale-out (autoscaler.scale_out_s)", cfg.autoscaler.scale_out_s),)
    # Lazy imports: an autoscaled cluster's only.
    from xds_mpi.plan.cluster import te_config
    from xds_mpi.scaling.steps import scale_out

    te_cfg = te_config(cfg, te.overrides)
    return scale_out(te_cfg, num_dies=cfg.autoscaler.pod_dies, num_new_tes=1).steps


def scale_out_s(cfg, te) -> float:
    """The virtual seconds of `scale_out_steps`."""
    return sum(seconds for _, seconds in scale_out_steps(cfg, te))


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


class Autoscaler:
    """TEs 0..N-1; `standby`: those that start in standby (not serving); steps: per TE, the
    steps (name, virtual s) from a scale-out decision until it serves."""

    def __init__(
        self,
        cfg,
        num_dies: list[int],
        standby: set[int],
        steps: list[tuple],
        slo_ttft_s: float = INF,
    ) -> None:
        self.cfg = cfg  # the autoscaler section
        self.steps = steps
        self.slo_ttft_s = slo_ttft_s
        self.finishes: list[tuple[float, bool]] = []  # (finish s, TTFT missed), by finish
        self.num_dies = num_dies
        self.serves_from = {te: (INF if te in standby else 0.0) for te in range(len(num_dies))}
        self.draining: set[int] = set()
        self.events: list[ScaleEvent] = []
        self.samples: deque[tuple[float, float]] = deque()  # (decision s, load then)
        self.last_event_s = -INF
        self.max_tes = cfg.max_tes or len(num_dies)

    def serving(self, now_s: float) -> list[int]:
        """The TEs a request may be routed to at `now_s`."""
        return [te for te, t in self.serves_from.items() if t <= now_s and te not in self.draining]

    def observe(self, now_s: float, unfinished: list[int]) -> ScaleEvent | None:
        """At a routing decision at `now_s` with each TE's unfinished requests then: the scale
        event it decides, if any."""
        serving = self.serving(now_s)
        mean = self._metric(now_s, unfinished, serving)
        if mean is None or now_s < self.last_event_s + self.cfg.cooldown_s:
            return None
        coming = [te for te, t in self.serves_from.items() if now_s < t < INF]
        standby = sorted(te for te, t in self.serves_from.items() if t == INF)
        event = None
        if mean > self.cfg.scale_out_above and standby:
            if len(serving) + len(coming) < self.max_tes:
                te = standby[0]
                self.serves_from[te] = now_s + sum(s for _, s in self.steps[te])
                event = ScaleEvent(
                    kind="out",
                    te=te,
                    decided_s=now_s,
                    serves_s=self.serves_from[te],
                    load=mean,
                    steps=tuple(self.steps[te]),
                )
        elif mean < self.cfg.scale_in_below and len(serving) > self.cfg.min_tes and not coming:
            te = min(serving, key=lambda t: (unfinished[t], -t))
            self.draining.add(te)
            if not unfinished[te]:  # nothing to finish first: standby at once
                self.drained(te)
            event = ScaleEvent(kind="in", te=te, decided_s=now_s, serves_s=INF, load=mean)
        if event is not None:
            self.events.append(event)
            self.last_event_s = now_s
            self.samples.clear()  # the next window starts with the new set of TEs
        return event

    def finished(self, finish_s: float, ttft_s: float) -> None:
        """A request's finish as a TE-shell reported it (before or after `observe` reaches its
        time: only the finishes up to a decision's time count for it)."""
        bisect.insort(self.finishes, (finish_s, ttft_s > self.slo_ttft_s))

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

    def drained(self, te: int) -> None:
        """A draining TE's last request finished: standby again."""
        if te in self.draining:
            self.draining.discard(te)
            self.serves_from[te] = INF
