"""How a die reaches each peer's window: plain loads and stores, or MPI RMA (docs/mpi.md §2).

UB is a load/store fabric: a die on the same supernode reads and writes a peer's memory with
ordinary instructions. The emulation's nearest thing is `Win.Shared_query(peer)` on an
`MPI.Win.Allocate` window: on one node MPICH returns a buffer over the peer's whole window, and
numpy loads and stores into it touch the peer's memory without an MPI call. Across nodes (or when
an MPI gives no buffer) the die falls back to Put / Get / word atomics.

The path is chosen per peer when the window is created:
  "auto" - load/store for every peer whose memory `Shared_query` exposes, RMA for the rest;
  "rma"  - RMA for every peer (the previous behaviour; the test suite runs both).
The default is "auto"; `set_memory_path` (from the config's `xccl.memory_path`, in
launch/job/rank.py) or the environment variable XDS_MEMORY_PATH (what the test bodies read) change
it.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

import numpy as np
from mpi4py import MPI

MemoryPath = Literal["auto", "rma"]
MEMORY_PATHS: tuple[str, ...] = get_args(MemoryPath)
MEMORY_PATH_ENV = "XDS_MEMORY_PATH"
LOAD_STORE, RMA = "load/store", "rma"

_default_path: MemoryPath | None = None
# The lowest world rank on this process's memory node, once the rank's entry has found it
# (set_node_leader). A window then learns its peers' nodes from the allgather it makes anyway
# instead of a node split of its own: three collectives fewer per window, each a few ms of CPU
# spent polling at start-up while the ranks share the cores.
_world_node_leader: int | None = None


def set_memory_path(path: MemoryPath) -> None:
    """The path every window this process creates later uses unless told otherwise."""
    global _default_path
    _default_path = check_memory_path(path)


def set_node_leader(world_rank: int) -> None:
    """This process's node, as the lowest world rank sharing it (MPI_COMM_TYPE_SHARED)."""
    global _world_node_leader
    _world_node_leader = world_rank


def known_node_leader() -> int | None:
    """What set_node_leader was told, None until then."""
    return _world_node_leader


def default_memory_path() -> MemoryPath:
    if _default_path is not None:
        return _default_path
    return check_memory_path(os.environ.get(MEMORY_PATH_ENV, "auto"))


def check_memory_path(path: str) -> MemoryPath:
    if path not in MEMORY_PATHS:
        raise ValueError(f"memory path must be one of {list(MEMORY_PATHS)}, got {path!r}")
    return path  # type: ignore[return-value]


def peer_views(
    win: MPI.Win, sizes: tuple[int, ...], is_same_node: tuple[bool, ...], path: MemoryPath
) -> tuple[np.ndarray | None, ...]:
    """For each rank: a uint8 array over its whole window when it is reachable by load/store
    (same node, `Shared_query` returned a buffer of its size), else None (use RMA)."""
    if path == "rma":
        return (None,) * len(sizes)
    views: list[np.ndarray | None] = []
    for peer, (size, same) in enumerate(zip(sizes, is_same_node)):
        view = None
        if same:
            try:
                buf, _ = win.Shared_query(peer)
            except MPI.Exception:
                buf = None  # an MPI that exposes no peer memory for Allocate windows
            if buf is not None and len(buf) == size:
                view = np.frombuffer(buf, np.uint8) if size else np.zeros(0, np.uint8)
        views.append(view)
    return tuple(views)


def node_leader(comm: MPI.Comm) -> int:
    """Collective: the lowest rank of `comm` that shares this rank's node (and so its memory)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leader = node.allreduce(comm.rank, op=MPI.MIN)
    node.Free()
    return leader


def same_node_table(comm: MPI.Comm, known: list[int | None]) -> tuple[bool, ...]:
    """Collective. For each rank of `comm`: does it share this rank's node (and so its memory)?
    known: every rank's known_node_leader(), as the caller allgathered them; where one is
    missing (a process that never called set_node_leader) the ranks find the nodes with a node
    split, all of them alike since they all see the same list."""
    if None in known:
        leader = node_leader(comm)
        known = comm.allgather(leader)
    else:
        leader = known[comm.rank]
    return tuple(other == leader for other in known)


def describe_paths(views: tuple[np.ndarray | None, ...]) -> str:
    """'load/store to ranks [0, 1], rma to ranks [2, 3]': what a window chose, for reports."""
    near = [r for r, v in enumerate(views) if v is not None]
    far = [r for r, v in enumerate(views) if v is None]
    parts = [f"{LOAD_STORE} to ranks {near}"] if near else []
    return ", ".join(parts + ([f"{RMA} to ranks {far}"] if far else []))
