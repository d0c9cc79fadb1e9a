"""NPU-fork to many new TEs at once (DeepServe §6.2, Figure 11a: one source broadcasts to up to
32 TEs; docs/scaling.md "Fork to many"): scale-outs by fork that the autoscaler decides while an
earlier fork's TE-Load is still running share that fork's source, a *fork group*; each new TE's
dies read the source dies' windows at once.

- A fork scale-out joins the open group of its shape when the group's source is still a
  candidate (serving, not lost) and the new TE's TE-Load starts before the group's last TE-Load
  ends; otherwise it opens a group with the source the planner chose.
- The joiner's TE-Load is priced for the group's receivers so far (its `num_receivers`, the
  fan-out model of xds_mpi/scaling/load.py `broadcast_s`).
- An earlier member still in TE-Load at the join is priced again (`ForkGroup.repriced`): the
  j-th of k receivers of a source feeding `fork_fanout` f at once loads as the
  max(j, min(k, f))-th receiver would, from its own decision. With the chain (f 1) that is the
  j-th, so a receiver added at the tail delays none before it; with f > 1 the first f share the
  source's link, so a joiner slows the members before it (as if their loads overlapped whole:
  an upper bound). A member whose TE-Load ended by the join keeps its times (it may serve).

Pure: the same decisions give the same groups on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ForkMember:
    """A member of a fork group: TE `te` decided at `decided_s`, its TE-Load ending at
    `load_end_s` (virtual s) as priced last."""

    te: int
    decided_s: float
    load_end_s: float


@dataclass(kw_only=True)
class ForkGroup:
    """Fork scale-outs sharing one source: first_te (the group's name in the run file),
    source_te, shape (the TEs a member's shape allows as sources), members (in decision order),
    load_end_s (the latest member's TE-Load end, virtual s)."""

    first_te: int
    source_te: int
    shape: frozenset[int]
    members: list[ForkMember] = field(default_factory=list)
    load_end_s: float = 0.0

    @property
    def num_receivers(self) -> int:
        return len(self.members)

    def still_loading(self, now_s: float) -> list[tuple[int, ForkMember]]:
        """(position, 1 first; member) of the members whose TE-Load has not ended at `now_s`."""
        return [(j, m) for j, m in enumerate(self.members, start=1) if m.load_end_s > now_s]

    def repriced(self, te: int, load_end_s: float) -> None:
        """Member `te`'s TE-Load priced again to end at `load_end_s`."""
        self.members = [
            ForkMember(te=m.te, decided_s=m.decided_s, load_end_s=load_end_s) if m.te == te else m
            for m in self.members
        ]
        self.load_end_s = max(m.load_end_s for m in self.members)


def receiver_position(position: int, num_receivers: int, fanout: int) -> int:
    """The receiver count the `position`-th of `num_receivers` loads as, a source feeding
    `fanout` at once: the first `fanout` share its link (all priced as min(k, fanout)-th), the
    later ones are deeper in the tree (their own position)."""
    return max(position, min(num_receivers, fanout))


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

    def add(
        self,
        te: int,
        *,
        source_te: int,
        shape: frozenset[int],
        decided_s: float,
        load_end_s: float,
        group,
    ):
        """TE `te` forks from `source_te` from `decided_s` until `load_end_s`: into `group`, or a
        new one."""
        if group is None:
            group = ForkGroup(first_te=te, source_te=source_te, shape=shape)
            self.groups.append(group)
        group.members.append(ForkMember(te=te, decided_s=decided_s, load_end_s=load_end_s))
        group.load_end_s = max(group.load_end_s, load_end_s)
        return group
