"""The `ems` section: the EMS context cache (CloudMatrix-Infer §4.4.1-4.4.2, docs/ems.md).

Part of the config schema (`xds_mpi.config.schema` re-exports it). With `enabled` the run adds
`servers` pool ranks (no die: their windows stand for the CPU DRAM of a server's EMS pool, reached
over UB) that keep the prompts' full KV blocks; prefill dies pull the longest cached prefix
instead of computing it. What the rest of the config must hold for that is `xds_mpi.plan.ems`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xds_mpi.config.loader import build_record, non_negative, positive, require

POOL_FAULT_KINDS = ("dead", "evict")


@dataclass(frozen=True, kw_only=True)
class PoolFault:
    """One row of `ems.faults` (docs/ems.md#pool-faults).

    kind "dead": pool rank `server` dies once it has taken `after_puts` put messages (0: before
    any): its DRAM is gone, it takes no message; a die that reads it declares it lost and
    recomputes what it would have pulled. kind "evict": prefill die `die`, at its `lookup`-th
    lookup that finds a block (from 0), has that block's pool rank evict it between the record
    read and the pull (the slot's bytes overwritten, as by the next put)."""

    kind: str
    server: int = -1
    die: int = -1
    after_puts: int = 0
    lookup: int = 0


@dataclass(frozen=True, kw_only=True)
class EmsConfig:
    """enabled: add the pool ranks and serve prefix hits from them (PD only).
    servers: pool ranks (one per server in §4.4: each server's CPU DRAM is one pool member).
    capacity_blocks: KV blocks (scheduler.kv_block_tokens tokens each) one pool rank holds;
    past it the least recently used block is evicted.
    faults: `PoolFault` rows, a pool rank lost or a block evicted mid-lookup."""

    enabled: bool = False
    servers: int = 1
    capacity_blocks: int = 256
    faults: list = field(default_factory=list)

    def __post_init__(self) -> None:
        positive("ems", servers=self.servers, capacity_blocks=self.capacity_blocks)
        object.__setattr__(self, "faults", [_fault_row(i, r) for i, r in enumerate(self.faults)])


def _fault_row(index: int, row) -> PoolFault:
    """A row checked alone (against the pool ranks and prefill dies: xds_mpi/plan/ems.py)."""
    where = f"ems.faults[{index}]"
    spec = row if isinstance(row, PoolFault) else build_record(PoolFault, row, where)
    require(
        spec.kind in POOL_FAULT_KINDS,
        f"{where}.kind: unknown kind {spec.kind!r} (known: {', '.join(POOL_FAULT_KINDS)})",
    )
    non_negative(where, after_puts=spec.after_puts, lookup=spec.lookup)
    # Each kind takes its own fields and no other's, so a typo is not silently ignored.
    takes = {"dead": ("server", "after_puts"), "evict": ("die", "lookup")}[spec.kind]
    given = {"server": spec.server != -1, "die": spec.die != -1,
             "after_puts": spec.after_puts != 0, "lookup": spec.lookup != 0}  # fmt: skip
    stray = [k for k, is_given in given.items() if is_given and k not in takes]
    require(not stray, f"{where}: a {spec.kind} row takes {' and '.join(takes)}, not {stray}")
    rank = getattr(spec, takes[0])
    require(rank >= 0, f"{where}: a {spec.kind} row needs {takes[0]} (a rank), got {rank}")
    return spec
