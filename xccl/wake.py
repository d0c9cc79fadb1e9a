"""How a die waits for its peers: a bounded poll that yields the CPU or sleeps until woken.

Every wait in XCCL (records, the agreement, p2p handles) is `poll_until`: try `ready()`, then
between tries check `interrupt` (a rollback signal, so no wait is deaf) and the deadline, and
either yield the CPU (`os.sched_yield()`, the best spin on oversubscribed cores:
docs/mpi.md §4) or, given `park`, sleep on a futex until a writer wakes this die.

Sleeping on one node: a die whose peers have not rung yet sleeps instead of spinning.

With more ranks than cores, a die that spins (even yielding at every try) keeps its share of a
core while the die everyone waits for runs on what is left. Here a waiting die sleeps in the
kernel on a Linux futex: a 32-bit wake word of its own in a small shared window beside its data
window. A writer on the same node wakes it after ringing its doorbell:

  waiter: name one writer it still waits for (`target`); read its wake word v; if the doorbells
          have not all rung, futex-wait while the word still holds v (at most PARK_S, then it
          looks again: the wait stays bounded, interruptible and fenced); clear `target`.
  writer: store the doorbell (and flush, as every doorbell does); store a value into the
          peer's wake word that no other store makes (its rank and a count of its own); if
          the peer's target is this writer, futex-wake it.

Only the named writer wakes the waiter, which then names another writer still missing, drawn at
random: a waiter for 63 peers is then woken about ln 63 ~ 4 times on average whatever order they
ring in (naming the lowest missing rank, as before, wakes it once per writer when writers ring in
rank order). Waking on every doorbell made 64 dies slower than spinning. A wake reaches a
waiter that is asleep: the futex compares
the word under the kernel's lock, so a word changed before the waiter sleeps makes it return at
once, and a wake after it sleeps finds it queued. The value is unique per store, so two writers
never leave the word at the v a waiter read. One wake can still be missed: x86 may let a
writer read the peer's target before its own stores are visible, and so read a target the
waiter has just replaced; that waiter then sleeps out PARK_S and looks again. Writers on
another node (RMA) cannot reach the futex, so a wait that includes one keeps spinning.

Meetings sleep on one word. In dispatch, combine and the agreement every member writes a record
to every member and waits for every member's (`Meeting`), so the die whose wait holds at its
first look is the last to arrive, and nobody needs to be named:

  waiter:  read the group's meeting word v (a word of the first member's wake window); if the
           doorbells have not all rung, futex-wait while the word still holds v (at most
           MEETING_PARK_S); look again.
  arrival: when its wait holds without the word having changed under its sleep (the last to
           arrive, or a wake missed), count the word up and wake every sleeper on it: one
           syscall for the whole meeting, no stores after the doorbells.

A waiter reads v before it looks at the doorbells, and every die rings its own doorbells (and
`Win.Sync`s) before it looks, so of any two dies the later one sees the other's doorbell: no
meeting ends with everyone asleep (a wake missed all the same costs one MEETING_PARK_S).
Two meetings on one word (two lanes of one group) only wake each other early. At 64 dies on 2
cores a bare meeting took 3.7 ms against 13 ms yielding.

`xccl.wait` (config; XDS_WAIT for the test bodies): "auto" (the default) sleeps only when the
node runs more ranks than this process may use cores, "sleep" sleeps whenever every awaited
writer can wake it, "spin" never sleeps (and makes no wake words: no window, no stores after
each doorbell). docs/mpi.md §4 has the measurements.

Where the time goes: every window call is timed when XDS_TIME_MPI=1 (`xds-mpi bench serve` reads
it; off by default, so default runs pay nothing), split by whether `poll_until` was waiting:
DieMemory makes its calls through `timed(win)`, the window itself when timing is off, else a
proxy that adds each call's duration to MPI_TIME.work_s, or to MPI_TIME.wait_s while a wait is
in progress. A buffer's waits reach the caller's trace through the `WaitLog` it was built with
(xccl/wait_log.py: a list the waits append to, no call back into the caller).
"""

from __future__ import annotations

import ctypes
import os
import platform
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, get_args

import numpy as np
from mpi4py import MPI

from xccl.errors import XcclTimeout

WaitMode = Literal["auto", "sleep", "spin"]
WAIT_MODES: tuple[str, ...] = get_args(WaitMode)
WAIT_ENV = "XDS_WAIT"
PARK_S = 0.002  # longest sleep before a parked waiter looks again
# One rank's words, as uint32: [0] wake word (a futex), [1] target, [2] meeting, [3] the last
# `WakeWords.gather` it arrived at, [4] (the first rank's) the last gather it released.
_WORD_BYTES = 20
_WAKE, _TARGET, _MEETING, _ARRIVED, _RELEASED = 0, 1, 2, 3, 4
GATHER_PARK_S = 0.1  # longest sleep in a gather before the deadline is looked at again
MEETING_PARK_S = 0.1  # longest sleep of a meeting's waiter (woken by the last to arrive)
_NOBODY = np.uint32(0xFFFFFFFF)  # target while the rank is not asleep

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the word is in another process's map
_WAKE_ALL = 0x7FFFFFFF


TIME_MPI_ENV = "XDS_TIME_MPI"


def poll_until(
    ready: Callable[[], bool],
    *,
    deadline: float,
    describe: Callable[[], str],
    interrupt: Callable[[], None] | None = None,
    park: Callable[[], None] | None = None,
    serve: Callable[[], None] | None = None,
) -> None:
    """Spin on `ready()` yielding the CPU between tries, or with `park` sleeping in it
    (`WakeWords.sleeper`, a bounded sleep until a writer wakes us); raise XcclTimeout after
    `deadline`.

    `interrupt` is called between tries (e.g. to raise a rollback signal) so no wait is deaf;
    `serve` too (`DieMemory.serve_far_peers`: a die waiting on its own node still lets dies on
    other nodes finish their RMA on its window).
    A condition that holds at the first try is no wait: it returns before any of the set-up.
    """
    if ready():
        return
    with InWait():
        while not ready():
            if interrupt is not None:
                interrupt()
            if serve is not None:
                serve()
            if time.monotonic() > deadline:
                raise XcclTimeout(describe())
            if park is None:
                os.sched_yield()
            else:
                park()


class Doze:
    """The pause between two polls of a wait that is not on a die's critical path (the control
    plane, the ranks meeting at start and end): yield for the first YIELD_S, then sleep, from
    0.5 ms doubling to `doze_cap_s` (1-20 ms, by how many ranks share a core), until `reset`
    (progress was made). With 289 ranks on 2 cores, ranks
    that yield-spin while they wait for the TE-shell (or sit in one of MPICH's blocking
    collectives, which poll at full speed) take most of the CPU the others need: ep288 spent over
    5 minutes between its last token and its summary."""

    YIELD_S = 0.001
    FIRST_S, LAST_S = 0.0005, 0.02
    PER_RANK_S = 0.0005  # the longest sleep per rank a core runs (between 1 ms and LAST_S)

    def __init__(self) -> None:
        self.last_s = _doze_cap if _doze_cap is not None else doze_cap_s()
        self.reset()

    def reset(self) -> None:
        self.since, self.sleep_s = time.monotonic(), 0.0

    def pause(self) -> None:
        if time.monotonic() - self.since < self.YIELD_S:
            os.sched_yield()
            return
        self.sleep_s = min(2 * self.sleep_s, self.last_s) if self.sleep_s else self.FIRST_S
        time.sleep(self.sleep_s)


def doze_cap_s(local_ranks: int | None = None) -> float:
    """A doze's longest sleep: 0.5 ms per rank a core of this node runs, from 1 ms to 20 ms.
    A rank wakes up to one sleep late, and a meeting (an Ibarrier) takes a few rounds of
    messages that each wait for a rank to wake and test: at 20 ms the main job's 5 ranks on 2
    cores took about 45 ms to free a window they had all reached within 11 ms. At 289 ranks
    on 2 cores the sleeps stay long, where they keep the waiters off the cores."""
    if local_ranks is None:
        local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
        local_ranks = int(local or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_core = local_ranks / max(1, cores or 1)
    return min(Doze.LAST_S, max(0.001, Doze.PER_RANK_S * per_core))


def quiet_barrier(comm: MPI.Comm, *, what: str, timeout_s: float = 600.0) -> None:
    """Meet every rank of `comm` dozing, before a blocking collective that the ranks reach at
    different times (a window's allocation and free): the early ones sleep instead of polling
    in MPICH's collective, and the collective itself then finds everyone there."""
    request = comm.Ibarrier()
    deadline, doze = time.monotonic() + timeout_s, Doze()
    while not request.Test():
        if time.monotonic() > deadline:
            raise XcclTimeout(
                f"rank {comm.rank} of {comm.size}: {what}: not every rank arrived after "
                f"{timeout_s:g} s"
            )
        doze.pause()


# -- sleeping on a futex


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc():
    if _SYS_FUTEX is None or not hasattr(os, "sched_getaffinity"):
        return None  # not Linux on x86-64 / arm64: waits spin
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


_LIBC = _libc()
_sleeps: bool | None = None  # set_wait_mode's decision for this process
_mode: WaitMode | None = None  # set_wait_mode's mode: the config's, alike on every rank
_doze_cap: float | None = None  # set_wait_mode's longest doze (doze_cap_s) for this process


def futex_available() -> bool:
    """Can waits sleep on this platform at all (Linux on x86-64 or arm64)?"""
    return _LIBC is not None


def set_wait_mode(mode: str, *, local_ranks: int) -> bool:
    """Decide once per process (launch/job/rank.py, before any window) whether waits may sleep;
    local_ranks: ranks on this node. Returns the decision."""
    global _sleeps, _doze_cap, _mode
    _mode = check_wait_mode(mode)
    _sleeps = _resolve(_mode, local_ranks)
    _doze_cap = doze_cap_s(local_ranks)  # before pinning narrows the cores, as the decision
    return _sleeps


def wait_mode() -> WaitMode:
    """set_wait_mode's mode; in a test body (no decision made), the environment's."""
    return _mode if _mode is not None else check_wait_mode(os.environ.get(WAIT_ENV, "auto"))


def sleeps() -> bool:
    if _sleeps is None:  # a test body: the environment, "auto" against MPI's local rank count
        local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
        return _resolve(wait_mode(), int(local or 1))
    return _sleeps


def nobody_sleeps() -> bool:
    """Can no rank's wait sleep, so that no rank needs the others' wake words? xccl.wait "spin"
    (one config for all ranks, or the test bodies' environment), or no futex here."""
    return _LIBC is None or wait_mode() == "spin"


def check_wait_mode(mode: str) -> WaitMode:
    if mode not in WAIT_MODES:
        raise ValueError(f"xccl.wait must be one of {list(WAIT_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _resolve(mode: WaitMode, local_ranks: int) -> bool:
    if _LIBC is None or mode == "spin":
        return False
    return mode == "sleep" or local_ranks > len(os.sched_getaffinity(0))


class WakeWords:
    """Every rank's wake word, in a window of their own (collective, like the data window's).
    Where no rank sleeps (`nobody_sleeps`: xccl.wait "spin") or no wait needs them (`needed`
    False on every rank) there is no window: a wake stores nothing and every wait spins."""

    def __init__(
        self,
        comm: MPI.Comm,
        peer_views: Callable[[MPI.Win, tuple], tuple],
        *,
        needed: bool = True,
    ) -> None:
        self.rank = comm.rank
        self.sleeps = sleeps()
        self._stores = 0  # this rank's wake count: with its rank, the unique value it stores
        self._gathers = 0  # `gather`s so far, alike on every rank
        self._draw = random.Random(comm.rank)  # which missing writer a sleep names
        self.win: MPI.Win | None = None
        self.local = np.zeros(2, np.uint32)
        self.words: tuple = (None,) * comm.size
        if not needed or nobody_sleeps():  # every rank decides alike: none makes the window
            return
        self.win = MPI.Win.Allocate(_WORD_BYTES, 1, comm=comm)
        self.win.Lock_all()
        self.local = np.frombuffer(self.win.tomemory(), np.uint32)
        self.local[:] = 0
        self.local[_TARGET] = _NOBODY
        views = peer_views(self.win, (_WORD_BYTES,) * comm.size)
        # Per rank: its words when this process can store into them (same node), else None.
        self.words = tuple(None if v is None else v.view(np.uint32) for v in views)
        comm.Barrier()  # every word zeroed before anyone wakes

    def sleeper(
        self,
        writers: Iterable[int],
        is_ready: Callable[[], bool],
        missing: Callable[[], Sequence[int]],
        meeting: Meeting | None = None,
    ) -> Callable[[], None] | None:
        """For `poll_until(park=...)`: a sleep until one of `missing()` (the writers the wait
        still misses; one drawn at random) wakes this rank, or None when the wait must spin
        (xccl.wait, or one of `writers` cannot reach this rank's word). With `meeting` (the
        wait is one, `meeting(writers)`): its sleep instead; `meeting.arrived()` after the wait."""
        if meeting is not None:
            return meeting.sleeper(is_ready)
        if not self.sleeps or any(self.words[w] is None for w in writers):
            return None
        return lambda: self.park(is_ready, self._draw.choice(missing()))

    def meeting(self, members: Sequence[int]) -> Meeting | None:
        """The sleeps of a meeting of `members` (every one waits for every one: dispatch,
        combine, the agreement): on the meeting word of the first member, or None when the
        meeting's waits must spin (xccl.wait, or a member that cannot reach the word)."""
        if not self.sleeps or any(self.words[m] is None for m in members):
            return None
        return Meeting(self.words[members[0]][_MEETING : _MEETING + 1])

    def park(self, is_ready: Callable[[], bool], writer: int) -> None:
        """Sleep until `writer` (one the wait still misses) wakes this rank, at most PARK_S,
        unless is_ready() already."""
        own = self.local
        own[_TARGET] = writer
        value = int(own[_WAKE])
        try:
            if not is_ready():
                timeout = _Timespec(int(PARK_S), int(PARK_S % 1 * 1e9))
                _futex(own, _FUTEX_WAIT, ctypes.c_uint32(value), ctypes.byref(timeout))
        finally:
            own[_TARGET] = _NOBODY

    def wake(self, peers: Sequence[int]) -> None:
        """After doorbells rang in `peers`' windows (and the flush that follows them): change
        each one's word and wake it if it sleeps."""
        if self.win is None:
            return
        self._stores = (self._stores + 1) & 0xFFFF
        value = np.uint32(((self.rank & 0xFFFF) << 16) | self._stores)
        for peer in peers:
            words = self.words[peer]
            if words is not None and peer != self.rank:
                words[_WAKE] = value
                if words[_TARGET] == self.rank:
                    _futex(words, _FUTEX_WAKE, 1, None)

    @property
    def reach_every_rank(self) -> bool:
        """Is there a window, and can this process store into every rank's words (one node)?"""
        return self.win is not None and all(w is not None for w in self.words)

    def gather(self, *, what: str, timeout_s: float) -> bool:
        """A barrier of every rank of the communicator that sleeps on the words: each rank
        marks its arrival word and wakes the first rank, which sleeps on its wake word until
        every rank has arrived, then marks its release word and wakes every sleeper at once.
        For the ranks' way out together (a window's free): a dozing Ibarrier (quiet_barrier)
        lets each rank notice the end only at its next look, hop after hop (64 dies: 0.2-1.2 s).
        False, having done nothing, when a rank's words are out of reach (another node, or no
        window: the caller meets otherwise); the same answer on every rank (set at start)."""
        if not self.reach_every_rank:
            return False
        self._gathers = (self._gathers + 1) & 0xFFFFFFFF
        count, own, first = np.uint32(self._gathers), self.local, self.words[0]
        deadline = time.monotonic() + timeout_s
        own[_ARRIVED] = count
        if self.rank != 0:  # arrived; wake the first rank, then sleep until it releases
            self._stores = (self._stores + 1) & 0xFFFF
            first[_WAKE] = np.uint32(((self.rank & 0xFFFF) << 16) | self._stores)
            _futex(first[_WAKE:], _FUTEX_WAKE, 1, None)
            released = first[_RELEASED:]
            while (seen := int(released[0])) != count:
                if time.monotonic() > deadline:
                    raise XcclTimeout(
                        f"rank {self.rank} of {len(self.words)}: {what}: rank 0 has not seen "
                        f"every rank arrive after {timeout_s:g} s"
                    )
                _futex(released, _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(_GATHER_PARK))
            return True
        pending = list(range(1, len(self.words)))
        while True:  # the wake word read before looking: an arrival after the look changes it
            seen = int(own[_WAKE])
            pending = [r for r in pending if self.words[r][_ARRIVED] != count]
            if not pending:
                break
            if time.monotonic() > deadline:
                raise XcclTimeout(
                    f"rank 0 of {len(self.words)}: {what}: ranks {pending[:16]} did not arrive "
                    f"after {timeout_s:g} s"
                )
            _futex(own[_WAKE:], _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(_GATHER_PARK))
        own[_RELEASED] = count
        _futex(own[_RELEASED:], _FUTEX_WAKE, _WAKE_ALL, None)
        return True

    def free(self) -> None:
        self.words = (None,) * len(self.words)
        self.local = np.zeros(2, np.uint32)
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


class Meeting:
    """One die's sleeps in the meetings of a group (the module's docstring): a waiter sleeps on
    the group's word while it holds what it read before looking; the die whose wait holds
    without the word having changed under its sleep counts it up and wakes every sleeper."""

    def __init__(self, word: np.ndarray) -> None:
        self.word = word  # [1] uint32, in the first member's wake window
        self._timeout = _Timespec(int(MEETING_PARK_S), int(MEETING_PARK_S % 1 * 1e9))
        self._woken = False

    def sleeper(self, is_ready: Callable[[], bool]) -> Callable[[], None]:
        """For `poll_until(park=...)` in one wait; `arrived` after it."""
        self._woken = False
        return partial(self._park, is_ready)  # not a lambda: one frame fewer in every wait

    def _park(self, is_ready: Callable[[], bool]) -> None:
        word = self.word
        seen = int(word[0])
        if not is_ready():
            _futex(word, _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(self._timeout))
        self._woken = int(word[0]) != seen

    def arrived(self) -> None:
        """After the wait held: wake the sleepers, unless another die's count woke this one."""
        if not self._woken:
            self.word[0] = (int(self.word[0]) + 1) & 0xFFFFFFFF
            _futex(self.word, _FUTEX_WAKE, _WAKE_ALL, None)
        self._woken = False


_GATHER_PARK = _Timespec(int(GATHER_PARK_S), int(GATHER_PARK_S % 1 * 1e9))


def _futex(word: np.ndarray, op: int, value, timeout) -> None:
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(word.ctypes.data), op, value, timeout, None, 0)


# -- MPI time, split by waiting or not


@dataclass
class MpiTime:
    work_s: float = 0.0  # MPI window calls outside any wait for a peer
    wait_s: float = 0.0  # MPI window calls made while polling for a peer
    calls: int = 0
    in_wait: bool = False


MPI_TIME = MpiTime()


def is_timing_mpi() -> bool:
    return os.environ.get(TIME_MPI_ENV) == "1"


class _TimedWin:
    """Forwards every attribute of an MPI.Win; its methods are timed."""

    def __init__(self, win) -> None:
        self._win = win

    def __getattr__(self, name: str):
        method = getattr(self._win, name)

        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                MPI_TIME.calls += 1
                if MPI_TIME.in_wait:
                    MPI_TIME.wait_s += spent
                else:
                    MPI_TIME.work_s += spent

        return call


def timed(win):
    """The object DieMemory calls the window through."""
    return _TimedWin(win) if is_timing_mpi() else win


class InWait:
    """`with InWait():` marks a wait for a peer (nested waits keep the outer mark). A class, not
    @contextmanager: every wait that does not hold at once enters one."""

    __slots__ = ("outer",)

    def __enter__(self) -> None:
        self.outer, MPI_TIME.in_wait = MPI_TIME.in_wait, True

    def __exit__(self, *exc) -> None:
        MPI_TIME.in_wait = self.outer
