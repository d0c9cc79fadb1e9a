"""The pool of ranks (`cluster.pool`, docs/cluster.md "A pool of ranks"): world ranks that belong
to no TE at launch, from which the JE's autoscaler forms a pool TE's dies at its scale-out and to
which they return at its drain, so that pool TEs of different shapes share fewer ranks than
their total. Pure bookkeeping on the virtual clock: which ranks are free, which TE holds which,
and from when until when (`PoolTurn` rows, the run file's `/cluster/pool`). A pool TE lost
(`cluster.te_losses`) takes its ranks out of the pool for good: the loss stands for its dies'
server, so they serve no TE after it (`RankPool.lose`).

The ranks are handed out lowest first, so the same decisions give the same ranks on any machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = float("inf")


@dataclass(frozen=True, kw_only=True)
class PoolTurn:
    """Pool ranks `ranks` (world ranks, the TE's dies in order, after its host ranks) served TE
    `te` from the scale-out decided at `taken_s` until the decision after its drain's last
    finish, `given_back_s` (inf: to the run's end, or lost), virtual seconds; `lost_s`: the
    TE's loss (`cluster.te_losses`) that took the ranks out of the pool for good (nan: none)."""

    te: int
    ranks: tuple[int, ...]
    taken_s: float
    given_back_s: float = INF
    lost_s: float = math.nan


@dataclass(frozen=True, kw_only=True)
class PoolRow:
    """One pool rank's one turn (a row of the run file's `/cluster/pool`, a span of the trace's
    pool track): world rank `rank` served as rank `die` inside TE `te` (after its host ranks)
    from `taken_s` until `given_back_s` (inf: the run's end, or lost), virtual seconds;
    `lost_s`: its TE's loss, after which the rank serves no TE (nan: none)."""

    te: int
    rank: int
    die: int
    taken_s: float
    given_back_s: float
    lost_s: float = math.nan


def pool_rows(turns: list[PoolTurn], first_die: dict[int, int]) -> list[PoolRow]:
    """Each turn's ranks as rows, in the order taken; first_die: pool TE -> the rank inside it
    of its first pool die (its launched host ranks come before)."""
    return [
        PoolRow(
            te=t.te,
            rank=rank,
            die=die,
            taken_s=t.taken_s,
            given_back_s=t.given_back_s,
            lost_s=t.lost_s,
        )
        for t in turns
        for die, rank in enumerate(t.ranks, start=first_die[t.te])
    ]


class RankPool:
    """ranks: the pool's world ranks; num_dies: pool TE -> its dies (what it takes)."""

    def __init__(self, ranks: tuple[int, ...], num_dies: dict[int, int]) -> None:
        self.ranks, self.num_dies = tuple(ranks), dict(num_dies)
        self.free = sorted(ranks)
        self.turns: list[PoolTurn] = []  # every turn, in the order taken
        self.held: dict[int, int] = {}  # TE -> its current turn's index in `turns`
        self.released: list[PoolTurn] = []  # turns ended, not yet told to their TE-shell
        self.num_skips = 0  # scale-outs that took another standby TE: too few ranks free
        self.num_waits = 0  # scale-outs put off: no standby TE fitted the free ranks
        self.lost: list[int] = []  # ranks of pool TEs lost (`lose`): out of the pool for good

    def is_pool_te(self, te: int) -> bool:
        return te in self.num_dies

    def can_take(self, te: int) -> bool:
        """A TE not of the pool always can; a pool TE when its dies' ranks are free."""
        return te not in self.num_dies or len(self.free) >= self.num_dies[te]

    def take(self, te: int, at_s: float) -> tuple[int, ...]:
        """The lowest free ranks for pool TE `te`'s dies, held from `at_s`."""
        need = self.num_dies[te]
        if te in self.held or len(self.free) < need:
            raise ValueError(
                f"pool: TE {te} takes {need} ranks at {at_s:g} s but {len(self.free)} are free "
                f"(held already: {te in self.held})"
            )
        ranks, self.free = tuple(self.free[:need]), self.free[need:]
        self.held[te] = len(self.turns)
        self.turns.append(PoolTurn(te=te, ranks=ranks, taken_s=at_s))
        return ranks

    def give_back(self, te: int, at_s: float) -> None:
        """Pool TE `te` drained at `at_s`: its ranks free again (nothing for another TE)."""
        if te not in self.held:
            return
        index = self.held.pop(te)
        turn = self.turns[index]
        self.turns[index] = ended = PoolTurn(
            te=te, ranks=turn.ranks, taken_s=turn.taken_s, given_back_s=at_s
        )
        self.free = sorted(self.free + list(turn.ranks))
        self.released.append(ended)

    def lose(self, te: int, lost_s: float) -> None:
        """Pool TE `te` lost at `lost_s` (`cluster.te_losses`: every die of it at once, its
        server): the ranks it holds stand for those dies, so they leave the pool for good
        (never given back, never taken again). A pool TE holding no ranks loses none."""
        if te not in self.held:
            return
        index = self.held.pop(te)
        turn = self.turns[index]
        self.turns[index] = PoolTurn(te=te, ranks=turn.ranks, taken_s=turn.taken_s, lost_s=lost_s)
        self.lost += turn.ranks

    def ranks_of(self, te: int) -> tuple[int, ...]:
        """The world ranks pool TE `te` holds now, its dies in order."""
        if te not in self.held:
            raise ValueError(f"pool: TE {te} holds no ranks (held: {sorted(self.held)})")
        return self.turns[self.held[te]].ranks

    def take_released(self) -> list[PoolTurn]:
        """The turns ended since the last call (the JE tells each TE-shell to let go)."""
        released, self.released = self.released, []
        return released


class ReleaseGate:
    """When the JE may tell a drained pool TE's TE-shell to let its dies go: a pool TE read by
    NPU-forks (its dies' weights in their world slots, zeroed at the release) only once every
    fork that read it during its turn has its weights (each fork's scale event's load reported).
    Pure bookkeeping, by scale event index."""

    def __init__(self) -> None:
        self.readers: dict[int, set[int]] = {}  # pool source TE -> its forks' scale events
        self.loaded: set[int] = set()  # scale events whose loads were reported
        self.held: list[PoolTurn] = []  # ended turns not released yet, in the order ended

    def read_by(self, source_te: int, event: int) -> None:
        """The fork of scale event `event` reads pool TE `source_te`'s dies."""
        self.readers.setdefault(source_te, set()).add(event)

    def load_reported(self, event: int) -> None:
        self.loaded.add(event)

    def hold(self, turns: list[PoolTurn]) -> None:
        """Turns ended (RankPool.take_released), to release once `due`."""
        self.held += turns

    def is_held(self, te: int) -> bool:
        return any(turn.te == te for turn in self.held)

    def waiting_for(self, te: int) -> list[int]:
        """The scale events whose loads pool TE `te`'s release still waits for."""
        return sorted(self.readers.get(te, set()) - self.loaded)

    def due(self) -> list[PoolTurn]:
        """The held turns whose readers all loaded, taken out (with their readers: the TE's
        next turn starts with none)."""
        due = [turn for turn in self.held if not self.waiting_for(turn.te)]
        for turn in due:
            self.held.remove(turn)
            self.readers.pop(turn.te, None)
        return due
