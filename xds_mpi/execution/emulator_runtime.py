"""The emulator's own §4.4: a rank pinned to a core and the GC kept out of dispatch / combine.

xDeepServe pins its CPU-side processes and keeps them free of stalls so that a die is never late
to a collective (§4.4). The emulator has the same problem in Python: a rank that the OS moves or
the garbage collector stops delays every die waiting in the next dispatch. `start` (called by
launch/job/rank.py before the role program) pins the rank and turns automatic collection off;
`between_iterations` (called by the executor before each forward pass, a point outside every
dispatch and combine) freezes what start-up built on its first call, with either GC; when
controlled, it then collects every `gc_every` iterations (only what was made since: frozen
objects are never walked again), and the youngest generation at every other iteration boundary.
The `emulator` config section (xds_mpi/config/emulator.py) chooses.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

from xds_mpi.config.emulator import EmulatorConfig


@dataclass
class _GcState:
    controlled: bool = False
    every: int = 256
    iterations: int = 0
    collections: int = 0


_state = _GcState()


def start(cfg: EmulatorConfig, *, local_rank: int, local_size: int) -> int | None:
    """Pin this rank (local_rank of local_size on its node) and take over the GC; returns the
    core pinned to, or None."""
    core = pin(cfg.pin_cores, local_rank, local_size)
    _state.controlled, _state.every = cfg.gc == "controlled", cfg.gc_every
    _state.iterations = _state.collections = 0
    if _state.controlled:
        gc.disable()
    return core


def pin(mode: str, local_rank: int, local_size: int) -> int | None:
    """The core `local_rank` is pinned to: "auto" when every rank of the node gets its own core,
    "always" round-robin; None when not pinned."""
    if mode == "never" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if mode == "auto" and len(cores) < local_size:
        return None
    core = cores[local_rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def between_iterations() -> None:
    """A collection point: no dispatch or combine is in progress."""
    _state.iterations += 1
    if _state.iterations == 1:
        # Start-up is over (model, windows, caches built): move every object to the permanent
        # generation so no later collection walks it, whichever GC runs. No collection first: a
        # full one over the model's objects would fall inside the first request's time to
        # first token. With Python's own GC, a collection of start-up's objects otherwise fell
        # into the first iteration (docs/scale.md).
        gc.freeze()
    elif not _state.controlled:
        return
    elif _state.iterations % _state.every == 0:
        gc.collect()
        _state.collections += 1
    else:
        # The iteration's young objects only (automatic collection is off, so they all wait
        # here): cycles holding numpy rows are freed before the next iteration allocates more.
        gc.collect(0)


def collections() -> int:
    """Collections run at controlled points so far."""
    return _state.collections
