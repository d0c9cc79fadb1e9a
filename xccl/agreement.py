"""The dies' agreement between iterations, one-sided over the EP area of their windows.

xDeepServe §4.2 keeps communication between DP groups inside dispatch and combine; the dies still
have to agree, once per iteration, on whether any of them has work (and, with EPLB, on which
placement all of them hold). Instead of an MPI collective, each member die owns in its window two
banks of one slot per member; a slot is AGREE_WORDS payload words and a round word. To agree on
round r a die writes its payload into its slot of bank r % 2 of every member's window, flushes,
then writes the round word (the doorbell, last), and polls its own bank until every member's
round word says r. Two banks suffice: a die writes round r + 1 only after it saw every member's
round r, so no member still reads the bank r + 1 overwrites (it holds round r - 1, read before
that member wrote round r).

Every member calls `agree` the same number of times (the die loop's lockstep); a new window (a
failover's rebuild) starts again at round 1 on every survivor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from xccl.gmem import WORD, DieMemory
from xccl.moe_layout import AGREE_WORDS, EpLayout
from xccl.records import FanOut, RecordAt, WordPoll
from xccl.recovery.faults import Interrupt
from xccl.wake import poll_until

ROUND_BITS = 32  # a round word is compared for equality; two banks make wrap-around harmless


class WindowAgreement:
    """One die's side of the agreement among the members of an EP layout."""

    def __init__(self, mem: DieMemory, layout: EpLayout, *, timeout_s: float) -> None:
        self.mem, self.layout, self.timeout_s = mem, layout, timeout_s
        self.members = layout.members
        self.me_idx = self.members.index(mem.rank)
        self.round = 0
        self._payload = np.zeros(AGREE_WORDS, WORD)
        self._polls: dict[int, WordPoll] = {}  # bank -> the round words of that bank, settled
        self._fans: dict[int, FanOut] = {}  # bank -> our slot of that bank in every member
        self._meeting = mem.wake_words.meeting(self.members)  # every member waits for every one

    def agree(
        self,
        values: Sequence[int],
        *,
        interrupt: Interrupt | None = None,
        timeout_s: float | None = None,
    ) -> np.ndarray:
        """Every member's `values` (at most AGREE_WORDS non-negative ints) of this round:
        [num_members, AGREE_WORDS] int64, rows in member order, unused columns 0. timeout_s:
        this round's bound on the wait (default: the one given at construction)."""
        self.round += 1
        word = self.round % (1 << ROUND_BITS)
        self._payload[:] = 0
        self._payload[: len(values)] = values
        bank = self.round % 2
        # The payloads first, then every doorbell (docs/mpi.md §2), to the slots bound once.
        self._fan_out(bank).publish(self._payload.view(np.uint8), word)
        self._wait(bank, word, interrupt, self.timeout_s if timeout_s is None else timeout_s)
        start = self._slot(self.mem.rank, bank, 0) // WORD.itemsize
        slots = self.mem.words[start : start + len(self.members) * _SLOT_WORDS]
        return slots.reshape(len(self.members), _SLOT_WORDS)[:, :AGREE_WORDS].astype(np.int64)

    def _fan_out(self, bank: int) -> FanOut:
        fan = self._fans.get(bank)
        if fan is None:
            targets = [RecordAt(r, self._slot(r, bank, self.me_idx)) for r in self.members]
            fan = self._fans[bank] = FanOut(
                self.mem,
                targets,
                slot_bytes=_SLOT_WORDS * WORD.itemsize,
                body_at=0,
                body_bytes=AGREE_WORDS * WORD.itemsize,
                bell_at=_ROUND_AT,
                wakes=self._meeting is None,
            )
        return fan

    def _wait(self, bank: int, word: int, interrupt: Interrupt | None, timeout_s: float) -> None:
        poll = self._polls.get(bank)
        if poll is None:
            offsets = [
                self._slot(self.mem.rank, bank, i) + _ROUND_AT for i in range(len(self.members))
            ]
            poll = self._polls[bank] = WordPoll(self.mem, offsets, self.members)
        pending = list(range(len(self.members)))

        def all_arrived() -> bool:
            pending[:] = poll.missing(word, pending)
            return not pending

        poll_until(
            all_arrived,
            deadline=time.monotonic() + timeout_s,
            interrupt=interrupt,
            serve=self.mem.far_server,
            park=self.mem.wake_words.sleeper(
                self.members,
                all_arrived,
                lambda: [self.members[i] for i in pending],
                self._meeting,
            ),
            describe=lambda: (
                f"die rank {self.mem.rank}: agreement round {self.round}: no word from "
                f"rank(s) {[self.members[i] for i in pending]} after {timeout_s:g} s"
            ),
        )
        if self._meeting is not None:
            self._meeting.arrived()
        self.mem.sync()  # the payloads, flushed before their doorbells, become visible

    def _slot(self, rank: int, bank: int, member_idx: int) -> int:
        """Byte offset of member `member_idx`'s slot of `bank` in `rank`'s window."""
        at = bank * len(self.members) + member_idx
        return self.layout.offset(rank, "agreement") + at * _SLOT_WORDS * WORD.itemsize


class IdleBackoff:
    """The sleep between agreement rounds in which no die has work: doubling from `first_s` to
    `last_s` while the rounds stay idle, none after a busy one."""

    def __init__(self, first_s: float = 0.001, last_s: float = 0.008) -> None:
        self.first_s, self.last_s = first_s, last_s
        self.sleep_s = 0.0

    def idle(self) -> None:
        self.sleep_s = min(2 * self.sleep_s, self.last_s) if self.sleep_s else self.first_s
        time.sleep(self.sleep_s)

    def busy(self) -> None:
        self.sleep_s = 0.0


_SLOT_WORDS = AGREE_WORDS + 1
_ROUND_AT = AGREE_WORDS * WORD.itemsize  # the round word follows the payload
