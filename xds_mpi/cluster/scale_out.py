"""How one scale-out loads its TE, decided on the virtual clock (docs/cluster.md "Scaling";
DeepServe §6.2): which TE-Load path serves, which TE a fork reads from, and what a fork source
that dies mid-fork costs.

- A fork's source is chosen among the TEs serving at the decision whose shape is the new TE's
  (its config but the `scaling` section): the least loaded (ties: the newest), so a TE scaled
  out earlier is a source for the next one, a chain; a TE lost by then is no source.
- The fork runs during TE-Load, [load_start, load_end) on the virtual clock. A source lost
  (`cluster.te_losses`) inside it stops sending; the new TE falls back to
  `autoscaler.fork_fallback` (dram: its server's page cache holds the model; cold: object
  storage) and loads the whole model again: TE-Load becomes (loss - load_start) + the fallback's
  TE-Load. `fallback_s` is what that adds to the fork as priced.
- With a fixed `autoscaler.scale_out_s` the one step stands for any path's load: a fallback
  starts it over at the loss.
- A fork decided while an earlier fork of its shape is still in TE-Load shares that fork's
  source, a fork group (xds_mpi/cluster/fork_fanout.py), its TE-Load priced for the group's
  receivers so far; the members still in TE-Load priced again for the group's new size
  (`Repriced`: with `scaling.fork_fanout` > 1 they slow; with the chain none changes).

Pure: the same decisions, losses and loads give the same plans on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.cluster.fork_fanout import ForkGroups, receiver_position

TE_LOAD = "TE-Load"


@dataclass(frozen=True, kw_only=True)
class ScaleOutPlan:
    """steps: (name, virtual s) from the decision until the TE serves; path: the TE-Load path
    that loaded its weights ("" when not known: a fixed test plan); source_te: fork: the TE
    read from (a fallback: the one that died mid-fork), else -1; fallback_from: "fork" when its
    source died mid-fork, else ""; fallback_s: the virtual seconds that fallback added;
    fork_group: a fork's group (its first TE; -1: no fork); fork_receivers: the group's new TEs
    with this one (its TE-Load priced for them)."""

    steps: tuple[tuple[str, float], ...]
    path: str = ""
    source_te: int = -1
    fallback_from: str = ""
    fallback_s: float = 0.0
    fork_group: int = -1
    fork_receivers: int = 0

    @property
    def total_s(self) -> float:
        return sum(seconds for _, seconds in self.steps)


@dataclass(frozen=True, kw_only=True)
class Repriced:
    """An earlier fork group member TE `te`, still in TE-Load at a join, priced again: its
    steps from its decision now `steps` (its serves_s moves with them)."""

    te: int
    steps: tuple[tuple[str, float], ...]


class FixedSteps:
    """The same steps for every scale-out of a TE (no path, no source): te -> steps."""

    def __init__(self, steps: list[tuple]) -> None:
        self.steps = steps

    def plan(self, te: int, now_s: float, serving: list[int], unfinished: list[int]):
        return ScaleOutPlan(steps=tuple(self.steps[te]))

    def taken(self, te: int, now_s: float, plan: ScaleOutPlan) -> list[Repriced]:
        return []


@dataclass(frozen=True, kw_only=True)
class TeScaling:
    """What a TE's scale-outs need to know of it: path (its scaling.path); steps: its path's
    steps as priced; fallback_steps: the steps of `autoscaler.fork_fallback`'s path (a fork TE);
    shape: TEs with the same shape (a fork source must be one); fanout_steps: a fork TE's steps
    when it is the k-th receiver of one source (index k - 1; empty: `steps` for any k)."""

    path: str
    steps: tuple[tuple[str, float], ...]
    fallback_path: str = ""
    fallback_steps: tuple[tuple[str, float], ...] = ()
    same_shape: frozenset[int] = frozenset()
    fanout_steps: tuple[tuple[tuple[str, float], ...], ...] = ()
    fanout: int = 1  # its scaling.fork_fanout: the receivers a source feeds at once

    def steps_for(self, num_receivers: int) -> tuple[tuple[str, float], ...]:
        """The steps of the `num_receivers`-th new TE a fork source feeds at once."""
        if not self.fanout_steps:
            return self.steps
        return self.fanout_steps[min(num_receivers, len(self.fanout_steps)) - 1]


class PricedPaths:
    """The planner of a run: each TE's path and steps, its fork sources and their losses."""

    def __init__(self, tes: list[TeScaling], lost_at: dict[int, float]) -> None:
        self.tes, self.lost_at = tes, lost_at
        self.forks = ForkGroups()

    def plan(self, te: int, now_s: float, serving: list[int], unfinished: list[int]):
        """TE `te`'s scale-out decided at `now_s`, with the TEs serving then and each TE's
        unfinished requests (`taken` records it once decided)."""
        info = self.tes[te]
        if info.path != "fork":
            return ScaleOutPlan(steps=info.steps, path=info.path)
        alive = [t for t in serving if t in info.same_shape and self.lost_at.get(t, INF) > now_s]
        if not alive:  # every source of its shape lost by now: the fallback at once
            return self._fall_back(info, -1, now_s, now_s)
        shape = info.same_shape | {te}
        group = self.forks.open_for(shape, alive, load_window(info.steps, now_s)[0])
        if group is None:
            source, steps = min(alive, key=lambda t: (unfinished[t], -t)), info.steps
        else:  # a fork of its shape still loading: its source feeds this TE too
            source, steps = group.source_te, info.steps_for(group.num_receivers + 1)
        if self.lost_at.get(source, INF) < load_window(steps, now_s)[1]:
            return self._fall_back(info, source, now_s, self.lost_at[source])
        return ScaleOutPlan(
            steps=steps,
            path="fork",
            source_te=source,
            fork_group=te if group is None else group.first_te,
            fork_receivers=1 if group is None else group.num_receivers + 1,
        )

    def taken(self, te: int, now_s: float, plan: ScaleOutPlan) -> list[Repriced]:
        """TE `te`'s scale-out decided at `now_s` by `plan`: a fork joins its group; the
        earlier members still in TE-Load whose price the join changes, priced again."""
        if plan.fork_group < 0:
            return []
        group = next((g for g in self.forks.groups if g.first_te == plan.fork_group), None)
        group = self.forks.add(
            te,
            source_te=plan.source_te,
            shape=self.tes[te].same_shape | {te},
            decided_s=now_s,
            load_end_s=load_window(plan.steps, now_s)[1],
            group=group,
        )
        repriced = []
        for position, member in group.still_loading(now_s):
            info = self.tes[member.te]
            as_k = receiver_position(position, group.num_receivers, info.fanout)
            steps = info.steps_for(as_k)
            load_end_s = load_window(steps, member.decided_s)[1]
            if member.te != te and load_end_s != member.load_end_s:
                group.repriced(member.te, load_end_s)
                repriced.append(Repriced(te=member.te, steps=steps))
        return repriced

    def _fall_back(self, info: TeScaling, source: int, now_s: float, lost_s: float):
        load_start, load_end = load_window(info.steps, now_s)
        forked_s = max(0.0, lost_s - load_start)  # the fork's time until its source died
        if len(info.steps) == 1:  # a fixed scale_out_s: the one step again from the loss
            steps = ((info.steps[0][0], forked_s + info.steps[0][1]),)
        else:
            fallback_load = dict(info.fallback_steps)[TE_LOAD]
            steps = tuple(
                (name, forked_s + fallback_load if name == TE_LOAD else s) for name, s in info.steps
            )
        fork_s = sum(s for _, s in info.steps)
        return ScaleOutPlan(
            steps=steps,
            path=info.fallback_path,
            source_te=source,
            fallback_from="fork",
            fallback_s=sum(s for _, s in steps) - fork_s,
        )


INF = float("inf")


def load_window(steps: tuple[tuple[str, float], ...], now_s: float) -> tuple[float, float]:
    """[start, end) of TE-Load for steps from `now_s` (a fixed step: the whole of it)."""
    start = now_s
    for name, seconds in steps:
        if name == TE_LOAD or len(steps) == 1:
            return start, start + seconds
        start += seconds
    raise ValueError(f"no {TE_LOAD} step among {[name for name, _ in steps]}")
