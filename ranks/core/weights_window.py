"""The weights window of a cluster with standby TEs (docs/scaling.md, "Weights at scale-out"):
one RMA window over the world, made collectively by every rank at start-up after the split
(launch/job/rank.py), in which

- every colocated die, and a PD pair's prefill and decode dies, exposes its weights (its
  tensors as stored, packed: xds_mpi/model/packed.py):
  a serving TE's die filled from the file at start-up, the NPU-fork source of the same die of a
  standby TE of its shape; a standby TE's die zeroed until its scale-out fills it;
- the TE-shell of a standby TE whose TE-Load path is `dram`, or `fork` with
  `autoscaler.fork_fallback: dram` (the path it falls back to when its fork source dies
  mid-fork), exposes the whole model, packed: the server's page cache with the model preloaded
  (DRAM-hit);
- a pool rank (docs/cluster.md "A pool of ranks") reserves a slot as large as the largest die
  of the pool TEs an NPU-fork may read (those of another fork TE's shape), zeroed: at each
  activation such a TE's die lays its weights out there (ranks/cluster/pool_window.py), so a
  later fork reads it through this window like any die's; 0 bytes when no pool TE can be a
  fork source;
- every other rank (the JE, afd ranks, a PD pair's decode TE-shell and its JE but as a dram
  host, EMS pool ranks) exposes 0 bytes.

A standby die computes each of its tensors' checksums from the file at start-up, to check what
arrives at scale-out. After its tensors, a die's window holds one word, `is_loaded` (1: the
tensors are there): a serving die's from start-up, a standby die's once its scale-out's weights
arrived and checked; a fork reads it before it reads a source that was standby itself (a chain).
Last in a die's window, its fork table: one (start, end) slot of virtual seconds per fork that
reads it, which the JE puts there (and flushes) at the fork's decision, before the grant that
lets the die start past it: the die charges its iterations that start inside one the fork's
share of its UB link (xds_mpi/scaling/contention.py). Each rank's window size and whether it is
a die are all-gathered at start-up, so the JE finds a die's table.
Nothing of this is made without a standby TE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ranks.core.tags import TAG_WEIGHTS_LOAD, TAG_WEIGHTS_LOADED  # noqa: F401
from xccl.gmem import DieMemory
from xds_mpi.cluster.autoscaler import fork_source_pool_tes
from xds_mpi.model.packed import PackedLayout, PackedWeights, checksum, die_tensor_names, pack_into
from xds_mpi.model.weights import stored_weights
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.scaling.contention import factor_at

# TE-shell -> die, TAG_WEIGHTS_LOAD: a `LoadOrder`; die -> TE-shell, TAG_WEIGHTS_LOADED:
# `DieLoaded`.


@dataclass(frozen=True, kw_only=True)
class LoadOrder:
    """Where a standby TE's dies take their weights at a scale-out (the JE's, passed on by the
    TE-shell). path: "fork", "dram", "cold" or "ems" (the TE's scaling.path); source_ranks: fork:
    the source TE's world ranks (its TE-shell first, so a die's source is source_ranks[its rank
    in the TE]); host_rank: dram: the world rank whose window holds the packed model; event: the
    scale event's index in the JE's log (named in errors)."""

    path: str
    event: int
    source_te: int = -1
    source_ranks: tuple[int, ...] = ()
    host_rank: int = -1
    fallback_from: str = ""  # "fork": its source TE (source_te) died mid-fork; path: the fallback


@dataclass(frozen=True, kw_only=True)
class DieLoaded:
    """A die's load: die_rank (in its TE); wall_s: moving its tensors into its window;
    check_s: their checksums and the model built over them; num_bytes, num_tensors moved;
    path as ordered; peer: the world rank read from (-1: the file); read_start, read_end: the
    move's wall-clock instants (time.time(), comparable across this host's processes: a fork
    group's concurrent reads)."""

    die_rank: int
    event: int
    path: str
    wall_s: float
    check_s: float
    num_bytes: int
    num_tensors: int
    peer: int
    read_start: float = 0.0
    read_end: float = 0.0


@dataclass(kw_only=True)
class WeightsWindow:
    """This rank's side of the weights window. mem: the window (DieMemory over the world, peers
    by world rank); layout: what this rank exposes (None: 0 bytes); model_layout: the whole
    model packed as a dram host exposes it (a standby die's and a host's: both compute it alike
    from the stored dtypes and shapes); te, world_rank: this
    rank's TE (-1: the JE) and world rank; is_standby: a standby TE's die, whose window is
    filled at scale-out; sums: such a die's checksums from the file, name -> CRC-32;
    sizes, is_die_of: every world rank's window bytes and whether it is a die (its fork table
    the last `fork_table_bytes`); fork_link_share: this die's TE's scaling.fork_link_share."""

    mem: DieMemory
    layout: PackedLayout | None
    model_layout: PackedLayout | None
    te: int
    world_rank: int
    is_standby: bool = False
    sums: dict[str, int] = field(default_factory=dict)
    sizes: tuple[int, ...] = ()
    is_die_of: tuple[bool, ...] = ()
    num_fork_slots: int = 0
    fork_link_share: float = 0.5

    @property
    def fork_table_bytes(self) -> int:
        return _padded(self.num_fork_slots * FORK_SLOT.itemsize * 2)

    def fork_table_offset(self, world_rank: int) -> int:
        """Die `world_rank`'s fork table in its window."""
        return self.sizes[world_rank] - self.fork_table_bytes

    def note_fork(self, world_rank: int, slot: int, start_s: float, end_s: float) -> None:
        """The JE: a fork reads die `world_rank` during [start_s, end_s) virtual (slot: its
        count of forks so far), complete there before this returns."""
        if not self.is_die_of[world_rank] or slot >= self.num_fork_slots:
            raise ValueError(
                f"fork table of world rank {world_rank}: slot {slot} of {self.num_fork_slots} "
                f"(a die: {self.is_die_of[world_rank]})"
            )
        offset = self.fork_table_offset(world_rank) + slot * 2 * FORK_SLOT.itemsize
        self.mem.put(world_rank, offset, np.array([start_s, end_s], FORK_SLOT))
        self.mem.flush(world_rank)

    def fork_windows(self) -> np.ndarray:
        """[num_fork_slots, 2] float64: this die's forks' TE-Load windows ((0, 0): unused)."""
        self.mem.sync()
        start = self.fork_table_offset(self.world_rank)
        table = self.mem.local[start : start + self.num_fork_slots * 2 * FORK_SLOT.itemsize]
        return table.view(FORK_SLOT).reshape(self.num_fork_slots, 2).copy()

    def link_factor_at(self, start_s: float) -> float:
        """The dispatch/combine factor of this die's iteration starting at `start_s`."""
        return factor_at(self.fork_windows(), start_s, self.fork_link_share)

    @property
    def loaded_offset(self) -> int:
        """The `is_loaded` word's offset in a die's window (after its tensors: the same for
        the dies of one shape)."""
        return self.layout.nbytes

    def mark_loaded(self) -> None:
        """This die's tensors are in its window, for a fork that reads it."""
        self.mem.store_word(self.world_rank, self.loaded_offset, 1)
        self.mem.sync()

    def weights(self, where: str) -> PackedWeights:
        """This rank's exposed tensors as a model's weight source (reads copy them out)."""
        return PackedWeights(self.mem.local, self.layout, where)

    def free(self) -> None:
        """Collective over the world; safe twice."""
        self.mem.free()


LOADED_WORD_BYTES = 64  # the `is_loaded` word, padded to the tensors' alignment
FORK_SLOT = np.dtype(np.float64)  # a fork table's (start, end), virtual seconds


def _padded(nbytes: int) -> int:
    return -(-nbytes // LOADED_WORD_BYTES) * LOADED_WORD_BYTES


_window: WeightsWindow | None = None


def set_weights_window(window: WeightsWindow | None) -> None:
    global _window
    _window = window


def weights_window() -> WeightsWindow | None:
    """This rank's side of the weights window; None without standby TEs."""
    return _window


def open_weights_window(world: MPI.Comm, plan: DeploymentPlan) -> WeightsWindow:
    """Collective over `world`: every rank's side of the window, a serving die's filled from the
    file, a dram host's with the packed model, a standby die's checksums taken from the file."""
    cluster, cfg = plan.cluster, plan.cfg
    te, local = cluster.te_of(world.rank)
    stored, shapes, _ = stored_weights(cfg.model, unpacked_under=cfg.run.output_dir)
    info = cluster.tes[te] if te >= 0 else None
    is_die = info is not None and info.kind in ("colocated", "pd") and is_loading_role(plan, local)
    is_standby = is_die and info.standby
    dram_copy = cfg.scaling.path == "dram" or (
        cfg.scaling.path == "fork" and cfg.autoscaler.fork_fallback == "dram"
    )
    is_host = info is not None and info.standby and local == 0 and dram_copy
    whole = model_layout(stored, shapes) if is_standby or is_host else None
    names: list[str] = []
    if is_die:
        names = die_tensor_names(shapes, hosted_experts(plan, local))
    elif is_host:  # the TE-shell of a dram TE: the page cache holding the model
        names = list(shapes)
    values = {name: stored.value(name) for name in names}
    layout = whole if is_host else PackedLayout.of_arrays(values) if names else None
    num_slots = cluster.num_tes  # a fork per standby TE at most: a TE scaled out again keeps
    table = _padded(num_slots * 2 * FORK_SLOT.itemsize)
    nbytes = layout.nbytes + (LOADED_WORD_BYTES + table if is_die else 0) if layout else 0
    if cluster.is_pool_rank(world.rank):  # its slot for a pool TE's die that forks may read
        nbytes = pool_slot_bytes(plan, world.size, LOADED_WORD_BYTES + table)
        is_die = nbytes > 0
    mem = DieMemory(world, nbytes, wakes=False)
    every = world.allgather((nbytes, is_die))  # the JE's map of the dies' fork tables
    window = WeightsWindow(
        mem=mem,
        layout=layout,
        model_layout=whole,
        te=te,
        world_rank=world.rank,
        is_standby=is_standby,
        sizes=tuple(n for n, _ in every),
        is_die_of=tuple(d for _, d in every),
        num_fork_slots=num_slots,
        fork_link_share=cfg.scaling.fork_link_share,
    )
    if window.is_standby:  # zeroed until its scale-out; what must arrive, from the file
        window.sums = {name: checksum(value) for name, value in values.items()}
    elif layout is not None:
        pack_into(mem.local, layout, values)
        mem.sync()  # before any peer reads it (after the JE's first scale-out)
        if is_die:
            window.mark_loaded()
    return window


def pool_slot_bytes(plan: DeploymentPlan, world_size: int, more: int) -> int:
    """A pool rank's slot: the largest die's tensors of the pool TEs a fork may read, plus
    `more` (its `is_loaded` word and fork table); 0 without such a TE. plan: the pool rank's
    (the config before any group's values)."""
    stored, shapes, _ = stored_weights(plan.cfg.model, unpacked_under=plan.cfg.run.output_dir)
    largest = 0
    for te in sorted(fork_source_pool_tes(plan.cfg, plan.cluster.tes)):
        te_plan = DeploymentPlan.build(plan.cfg, world_size, launcher_checks=False, te=te)
        info = plan.cluster.tes[te]
        for local in range(info.num_launched, info.size):
            if is_loading_role(te_plan, local):
                names = die_tensor_names(shapes, hosted_experts(te_plan, local))
                values = {name: stored.value(name) for name in names}
                largest = max(largest, PackedLayout.of_arrays(values).nbytes)
    return largest + more if largest else 0


def is_loading_role(plan: DeploymentPlan, local: int) -> bool:
    """Rank `local` of a colocated TE or PD pair holds weights a standby TE loads: a colocated
    die (a pair's decode dies are), or a PD pair's prefill die."""
    role = plan.topo.ranks[local].role
    return role == "colocated" or (role == "prefill" and plan.pd is not None)


def hosted_experts(plan: DeploymentPlan, local: int) -> set[int]:
    """The routed experts die `local` of its TE computes with: its routed slots' logical experts
    in the topology's static placement (no EPLB, no ring replicas in a cluster with standby TEs,
    xds_mpi/plan/cluster.py; xds_mpi/eplb/expert_map.py `ExpertMap.static`); a PD prefill die's:
    the experts its prefill TE's split gives it (xds_mpi/plan/pd.py `slot_owners`, phy = log)."""
    if plan.topo.ranks[local].role == "prefill":
        owners = plan.pd.slot_owners[plan.pd.te_of(local)]
        return {expert for expert, owner in enumerate(owners) if owner == local}
    topo = plan.topo
    slots = [s.phy_idx for s in topo.ranks[local].expert_slots if s.kind != "shared"]
    return {topo.phy2log[s] for s in slots if topo.phy2log[s] >= 0}


def model_layout(stored, shapes) -> PackedLayout:
    """The whole model packed (a dram host's window), from the stored dtypes: the unpacked copy's
    index when there is one (xds_mpi/model/unpacked.py), else each tensor read."""
    index = getattr(stored, "tensors", None)  # UnpackedWeights: name -> [offset, dtype, shape]
    if index is not None:
        return PackedLayout.of((name, np.dtype(index[name][1]), index[name][2]) for name in shapes)
    return PackedLayout.of_arrays({name: stored.value(name) for name in shapes})
