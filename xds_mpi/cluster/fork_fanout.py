"""NPU-fork to many new TEs at once (DeepServe §6.2, Figure 11a: one source broadcasts to up to
32 TEs; docs/scaling.md "Fork to many"): scale-outs by fork that the autoscaler decides while an
earlier fork's TE-Load is still running share that fork's source, a *fork group*; each new TE's
dies read the source dies' windows at once.

- A fork scale-out joins the open group of its shape when the group's source is still a
  candidate (serving, not lost) and the new TE's TE-Load starts before the group's last TE-Load
  ends; otherwise it opens a group with the source the planner chose.
- The joiner's TE-Load is priced for the group's receivers so far (its `num_receivers`, the
  fan-out model of xds_mpi/scaling/load.py `broadcast_s`); an earlier member keeps the serves_s
  it was promised at its decision (with the default chain, fan-out 1, a receiver added at the
  tail delays none before it).

Pure: the same decisions give the same groups on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ForkGroup:
    """Fork scale-outs sharing one source: first_te (the group's name in the run file),
    source_te, shape (the TEs a member's shape allows as sources), members (TEs, in decision
    order), load_end_s (the latest member's TE-Load end, virtual s)."""

    first_te: int
    source_te: int
    shape: frozenset[int]
    members: list[int] = field(default_factory=list)
    load_end_s: float = 0.0

    @property
    def num_receivers(self) -> int:
        return len(self.members)


class ForkGroups:
    """The fork groups of a run, in the order they opened."""

    def __init__(self) -> None:
        self.groups: list[ForkGroup] = []

    def open_for(self, shape: frozenset[int], candidates: list[int], load_start_s: float):
        """The group a fork whose TE-Load starts at `load_start_s` joins (its source among
        `candidates`, of `shape`, its TE-Load still running then), or None."""
        for group in reversed(self.groups):
            if (
                group.shape == shape
                and group.source_te in candidates
                and load_start_s < group.load_end_s
            ):
                return group
        return None

    def add(self, te: int, *, source_te: int, shape: frozenset[int], load_end_s: float, group):
        """TE `te` forks from `source_te` until `load_end_s`: into `group`, or a new one."""
        if group is None:
            group = ForkGroup(first_te=te, source_te=source_te, shape=shape)
            self.groups.append(group)
        group.members.append(te)
        group.load_end_s = max(group.load_end_s, load_end_s)
        return group
