"""Sleeping waits on one node: a die whose peers have not rung yet sleeps instead of spinning.

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

`xccl.wait` (config; XDS_WAIT for the test bodies): "spin" (the config's default) never
sleeps, "sleep" sleeps whenever every awaited writer can wake it, "auto" (the test bodies'
default) sleeps only when the node runs more ranks than this process may use cores
(docs/mpi.md §4 has the measurements).
"""

from __future__ import annotations

import ctypes
import os
import platform
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, get_args

import numpy as np
from mpi4py import MPI

WaitMode = Literal["auto", "sleep", "spin"]
WAIT_MODES: tuple[str, ...] = get_args(WaitMode)
WAIT_ENV = "XDS_WAIT"
PARK_S = 0.002  # longest sleep before a parked waiter looks again
_WORD_BYTES = 8  # one rank's words, as uint32: [0] the wake word (the futex), [1] target
_WAKE, _TARGET = 0, 1
_NOBODY = np.uint32(0xFFFFFFFF)  # target while the rank is not asleep

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the word is in another process's map


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


def futex_available() -> bool:
    """Can waits sleep on this platform at all (Linux on x86-64 or arm64)?"""
    return _LIBC is not None


def set_wait_mode(mode: str, *, local_ranks: int) -> bool:
    """Decide once per process (launch/rank.py, before any window) whether waits may sleep;
    local_ranks: ranks on this node. Returns the decision."""
    global _sleeps
    _sleeps = _resolve(check_wait_mode(mode), local_ranks)
    return _sleeps


def sleeps() -> bool:
    if _sleeps is None:  # a test body: the environment, "auto" against MPI's local rank count
        local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
        return _resolve(check_wait_mode(os.environ.get(WAIT_ENV, "auto")), int(local or 1))
    return _sleeps


def check_wait_mode(mode: str) -> WaitMode:
    if mode not in WAIT_MODES:
        raise ValueError(f"xccl.wait must be one of {list(WAIT_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _resolve(mode: WaitMode, local_ranks: int) -> bool:
    if _LIBC is None or mode == "spin":
        return False
    return mode == "sleep" or local_ranks > len(os.sched_getaffinity(0))


class WakeWords:
    """Every rank's wake word, in a window of their own (collective, like the data window's)."""

    def __init__(self, comm: MPI.Comm, peer_views: Callable[[MPI.Win, tuple], tuple]) -> None:
        self.rank = comm.rank
        self.win = MPI.Win.Allocate(_WORD_BYTES, 1, comm=comm)
        self.win.Lock_all()
        self.local = np.frombuffer(self.win.tomemory(), np.uint32)
        self.local[_WAKE], self.local[_TARGET] = 0, _NOBODY
        views = peer_views(self.win, (_WORD_BYTES,) * comm.size)
        # Per rank: its words when this process can store into them (same node), else None.
        self.words = tuple(None if v is None else v.view(np.uint32) for v in views)
        self.sleeps = sleeps()
        self._stores = 0  # this rank's wake count: with its rank, the unique value it stores
        self._draw = random.Random(comm.rank)  # which missing writer a sleep names
        comm.Barrier()  # every word zeroed before anyone wakes

    def sleeper(
        self,
        writers: Iterable[int],
        is_ready: Callable[[], bool],
        missing: Callable[[], Sequence[int]],
    ) -> Callable[[], None] | None:
        """For `poll_until(park=...)`: a sleep until one of `missing()` (the writers the wait
        still misses; one drawn at random) wakes this rank, or None when the wait must spin
        (xccl.wait, or one of `writers` cannot reach this rank's word)."""
        if not self.sleeps or any(self.words[w] is None for w in writers):
            return None
        return lambda: self.park(is_ready, self._draw.choice(missing()))

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
        if _LIBC is None:
            return
        self._stores = (self._stores + 1) & 0xFFFF
        value = np.uint32(((self.rank & 0xFFFF) << 16) | self._stores)
        for peer in peers:
            words = self.words[peer]
            if words is not None and peer != self.rank:
                words[_WAKE] = value
                if words[_TARGET] == self.rank:
                    _futex(words, _FUTEX_WAKE, 1, None)

    def free(self) -> None:
        self.words = (None,) * len(self.words)
        self.local = np.zeros(2, np.uint32)
        self.win.Unlock_all()
        self.win.Free()


def _futex(word: np.ndarray, op: int, value, timeout) -> None:
    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(word.ctypes.data), op, value, timeout, None, 0)
