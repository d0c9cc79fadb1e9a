"""The deployment's XCCL memory: which die pairs talk p2p, and how big each die's window is."""
from __future__ import annotations

from xccl.errors import XcclError
from xccl.layout import P2PLayout, all_pairs
from xds_mpi.config import Config, ConfigError
from xds_mpi.topology import Topology


def p2p_pairs(cfg: Config, topo: Topology) -> frozenset[tuple[int, int]]:
    """Ordered (src rank, dst rank) pairs that get a ring, as xccl.p2p_pairs declares:
    none; all (every die with every die, itself included); prefill_to_decode (KV transfer from
    each prefill die to each attention / colocated die)."""
    kind = cfg.xccl.p2p_pairs
    if kind == "none":
        return frozenset()
    if kind == "all":
        return all_pairs(topo.die_ranks)
    decode = topo.ranks_with_role("attention") + topo.ranks_with_role("colocated")
    return frozenset((p, d) for p in topo.ranks_with_role("prefill") for d in decode)


def p2p_layout(cfg: Config, topo: Topology) -> P2PLayout:
    x = cfg.xccl
    return P2PLayout.build(topo.world_size, x.ring_slots, x.slot_bytes, p2p_pairs(cfg, topo))


def window_bytes(cfg: Config, topo: Topology) -> list[int]:
    """Size hint: bytes of every rank's window (host ranks: 0), refused over the per-die cap."""
    layout = p2p_layout(cfg, topo)
    try:
        layout.check_cap(cfg.xccl.max_window_bytes)
    except XcclError as exc:
        raise ConfigError(str(exc)) from None
    return [layout.window_bytes(rank) for rank in range(topo.world_size)]


def format_bytes(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"
