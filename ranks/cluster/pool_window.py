"""A pool rank's side of the weights window (docs/cluster.md "A pool of ranks";
ranks/core/weights_window.py): the window is made over the world at start-up, so a pool rank
joins it then with the bytes of the largest die any pool TE may make of it (its HBM for
weights, reserved), its fork table last as every die's. At each activation the rank lays out
its new die's tensors at the front (zeroed, their checksums from the file: a standby die's, to
be filled by the TE's load); at the drain it clears its `is_loaded` word for the next shape.
"""

from __future__ import annotations

from dataclasses import replace

from mpi4py import MPI

from ranks.core.weights_window import (
    FORK_SLOT,
    LOADED_WORD_BYTES,
    WeightsWindow,
    hosted_experts,
    model_layout,
)
from xccl.gmem import DieMemory
from xds_mpi.model.packed import PackedLayout, checksum, die_tensor_names
from xds_mpi.model.weights import stored_weights
from xds_mpi.plan.deployment import DeploymentPlan


def _table_bytes(num_slots: int) -> int:
    nbytes = num_slots * 2 * FORK_SLOT.itemsize
    return -(-nbytes // LOADED_WORD_BYTES) * LOADED_WORD_BYTES


def die_layout(cfg, plan: DeploymentPlan, local: int) -> tuple[PackedLayout, dict]:
    """Die `local` of the TE `plan` describes: its tensors' layout and their stored values."""
    stored, shapes, _ = stored_weights(cfg.model, unpacked_under=cfg.run.output_dir)
    names = die_tensor_names(shapes, hosted_experts(plan, local))
    values = {name: stored.value(name) for name in names}
    return PackedLayout.of_arrays(values), values


def open_pool_window(world: MPI.Comm, plan: DeploymentPlan, base) -> WeightsWindow:
    """Collective over `world`, in the order open_weights_window keeps on every other rank: the
    window's bytes for the largest die of every pool TE's shape (base: the config before any
    group's values), then the all-gather of sizes."""
    cluster, world_size = plan.cluster, world.size
    largest = 0
    for t in (t for t in cluster.tes if t.is_pool):
        te_plan = DeploymentPlan.build(base, world_size, launcher_checks=False, te=t.te)
        for local in range(t.num_launched, t.size):  # its dies, after its host ranks
            largest = max(largest, die_layout(te_plan.cfg, te_plan, local)[0].nbytes)
    nbytes = largest + LOADED_WORD_BYTES + _table_bytes(cluster.num_tes)
    mem = DieMemory(world, nbytes, wakes=False)
    every = world.allgather((nbytes, True))
    return WeightsWindow(
        mem=mem,
        layout=None,
        model_layout=None,
        te=-1,
        world_rank=world.rank,
        sizes=tuple(n for n, _ in every),
        is_die_of=tuple(d for _, d in every),
        num_fork_slots=cluster.num_tes,
    )


def activate(window: WeightsWindow, plan: DeploymentPlan, te: int, local: int) -> WeightsWindow:
    """The window as die `local` of pool TE `te` (plan: its TE's) sees it: zeroed, its tensors'
    layout and checksums, standby until the TE's load fills it."""
    cfg = plan.cfg
    layout, values = die_layout(cfg, plan, local)
    room = window.sizes[window.world_rank] - LOADED_WORD_BYTES - window.fork_table_bytes
    if layout.nbytes > room:
        raise RuntimeError(
            f"pool rank {window.world_rank}: die {local} of TE {te} needs {layout.nbytes} bytes "
            f"of weights, its window holds {room}"
        )
    window.mem.local[:] = 0  # the previous shape's tensors, its is_loaded word, no fork read it
    window.mem.sync()
    stored, shapes, _ = stored_weights(cfg.model, unpacked_under=cfg.run.output_dir)
    return replace(
        window,
        layout=layout,
        model_layout=model_layout(stored, shapes),
        te=te,
        is_standby=True,
        sums={name: checksum(value) for name, value in values.items()},
        fork_link_share=cfg.scaling.fork_link_share,
    )


def deactivate(window: WeightsWindow) -> WeightsWindow:
    """After the drain: no die's tensors here (its `is_loaded` word cleared for the next)."""
    window.mem.store_word(window.world_rank, window.loaded_offset, 0)
    window.mem.sync()
    return replace(window, layout=None, model_layout=None, te=-1, is_standby=False, sums={})
