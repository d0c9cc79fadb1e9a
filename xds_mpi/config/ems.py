"""The `ems` section: the EMS context cache (CloudMatrix-Infer §4.4.1-4.4.2, docs/ems.md).

Part of the config schema (`xds_mpi.config.schema` re-exports it). With `enabled` the run adds
`servers` pool ranks (no die: their windows stand for the CPU DRAM of a server's EMS pool, reached
over UB) that keep the prompts' full KV blocks; prefill dies pull the longest cached prefix
instead of computing it. What the rest of the config must hold for that is `xds_mpi.plan.ems`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.loader import positive


@dataclass(frozen=True, kw_only=True)
class EmsConfig:
    """enabled: add the pool ranks and serve prefix hits from them (PD only).
    servers: pool ranks (one per server in §4.4: each server's CPU DRAM is one pool member).
    capacity_blocks: KV blocks (scheduler.kv_block_tokens tokens each) one pool rank holds;
    past it the least recently used block is evicted."""

    enabled: bool = False
    servers: int = 1
    capacity_blocks: int = 256

    def __post_init__(self) -> None:
        positive("ems", servers=self.servers, capacity_blocks=self.capacity_blocks)
