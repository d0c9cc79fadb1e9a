"""A pool die's weights (docs/cluster.md "A pool of ranks"; ranks/core/weights_window.py): the
world's weights window is made once at start-up, where a pool rank is in no TE. At each
activation the rank lays its die's weights memory out (its tensors, its `is_loaded` word, its
fork table, as a die's window lays them out), zeroed, with their checksums from the file: a
standby die's, to be filled by the TE's load, which reads its sources through the world's
window. Where it lives:

- in the rank's own slot of the world's window, reserved at start-up for the pool TEs an
  NPU-fork may read (those of another fork TE's shape): its tensors from the slot's start, its
  fork table at the slot's end, where the JE notes a fork that reads it. A later fork reads it as it
  reads any die (no collective: the window is the world's, made once). At the drain the slot is
  zeroed for the rank's next turn; the JE gives the ranks back only once every fork that read
  them has its weights (ranks/cluster/weights_load.py), so no read sees it zeroed;
- else (no fork may read this TE, and its die does not fit the slot) in memory of its own,
  allocated here and freed at the drain.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ranks.core.weights_window import (
    LOADED_WORD_BYTES,
    WeightsWindow,
    hosted_experts,
    model_layout,
)
from xccl.gmem import WORD, DieMemory
from xds_mpi.model.packed import PackedLayout, checksum, die_tensor_names
from xds_mpi.model.weights import stored_weights
from xds_mpi.plan.deployment import DeploymentPlan


class PoolDieMemory:
    """A pool die's weights memory beside the world's window: `local` allocated here (bytes),
    this die's own words stored in it; reads from peers (a fork's source, a DRAM host) through
    `world`, the world's weights window. `free` releases it; safe twice."""

    def __init__(self, world: DieMemory, nbytes: int, world_rank: int) -> None:
        self.world, self.world_rank = world, world_rank
        self.local = np.zeros(nbytes, np.uint8)

    def get(self, peer: int, offset: int, out: np.ndarray) -> None:
        self.world.get(peer, offset, out)

    def flush(self, peer: int) -> None:
        self.world.flush(peer)

    def fetch_word(self, peer: int, offset: int) -> int:
        return self.world.fetch_word(peer, offset)

    def serve_far_peers(self) -> None:
        self.world.serve_far_peers()

    def sync(self) -> None:
        self.world.sync()

    def store_word(self, peer: int, offset: int, value: int) -> None:
        if peer != self.world_rank:
            raise ValueError(
                f"pool die (world rank {self.world_rank}): store_word to world rank {peer}: a "
                "pool die's weights memory is its own"
            )
        self.local[offset : offset + WORD.itemsize].view(WORD)[0] = value

    def free(self) -> None:
        self.local = np.zeros(0, np.uint8)


def activate(window: WeightsWindow, plan: DeploymentPlan, te: int, local: int) -> WeightsWindow:
    """This rank's weights as die `local` of pool TE `te` (plan: its TE's) sees them: memory
    for its tensors, its `is_loaded` word and its fork table, zeroed (its world slot when it
    holds them: see the module's docstring); their checksums; standby until the TE's load
    fills it."""
    cfg = plan.cfg
    stored, shapes, _ = stored_weights(cfg.model, unpacked_under=cfg.run.output_dir)
    names = die_tensor_names(shapes, hosted_experts(plan, local))
    values = {name: stored.value(name) for name in names}
    layout = PackedLayout.of_arrays(values)
    nbytes = layout.nbytes + LOADED_WORD_BYTES + window.fork_table_bytes
    sums = {name: checksum(value) for name, value in values.items()}
    if nbytes <= window.sizes[window.world_rank]:  # its slot, reserved for the TEs forks read
        return replace(
            window,
            layout=layout,
            model_layout=model_layout(stored, shapes),
            te=te,
            is_standby=True,
            sums=sums,
            fork_link_share=cfg.scaling.fork_link_share,
        )
    sizes = list(window.sizes)
    sizes[window.world_rank] = nbytes  # where this die finds its own fork table
    return replace(
        window,
        mem=PoolDieMemory(window.mem, nbytes, window.world_rank),
        layout=layout,
        model_layout=model_layout(stored, shapes),
        te=te,
        is_standby=True,
        sums=sums,
        sizes=tuple(sizes),
        fork_link_share=cfg.scaling.fork_link_share,
    )


def deactivate(window: WeightsWindow, world: DieMemory, size: int) -> WeightsWindow:
    """After the drain: the die's weights memory freed, or its world slot zeroed (its tensors,
    `is_loaded` word and fork table: no fork reads it any more); the rank's side of the world's
    window (`world`, `size` bytes) as at start-up."""
    if window.mem is world:
        world.local[:] = 0
        world.sync()
    else:
        window.mem.free()
    sizes = list(window.sizes)
    sizes[window.world_rank] = size
    return replace(
        window,
        mem=world,
        layout=None,
        model_layout=None,
        te=-1,
        is_standby=False,
        sums={},
        sizes=tuple(sizes),
    )
