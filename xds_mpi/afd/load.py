"""What an expert die of an afd run measured per A2E/E2A call, for the AFD analysis (seed 003's
budget method, docs/afd_analysis.md): the rows each of its expert slots took and the virtual time
its experts were active, against the virtual time between its calls (the stage budget t_B the
pipeline really gave it).

Virtual seconds are stored per layer of the cost shape: a tiny MoE layer's price stands for
`moe_scale` layers (xds_mpi/execution/pricing.py), an MTP block's for one. The expert die sends its
`ExpertLoad` to the TE-shell at the end (ranks/afd/expert.py), which writes /afd_load/<rank>.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import h5py
import numpy as np

# Per call, in the order calls ran: iteration, call number, layer, virtual start/end of its
# expert work (s), active expert seconds, the layer-price scale; plus rows per slot.
_COLUMNS = ("iteration", "call", "layer", "vstart_s", "vend_s", "active_s", "scale")


@dataclass
class ExpertLoad:
    """One expert die's calls. slots: the die's slot indices (routed first, then shared);
    is_routed: per slot; topk_scale and experts_per_slot: how a tiny row maps onto the cost shape
    (xds_mpi/execution/pricing.py): a row at a routed slot stands for topk_scale rows over
    experts_per_slot experts of the cost shape."""

    rank: int
    slots: tuple[int, ...]
    is_routed: tuple[bool, ...]
    topk_scale: float
    experts_per_slot: float
    calls: dict[tuple[int, int], dict] = field(default_factory=dict)  # (iteration, call) -> row

    def begin(self, iteration: int) -> None:
        """An attempt of `iteration` starts: a rolled-back attempt's calls are forgotten."""
        self.calls = {k: v for k, v in self.calls.items() if k[0] != iteration}

    def add(self, *, iteration: int, call: int, layer: int, slot: int, rows: int,
            vstart_s: float, vend_s: float, scale: float) -> None:  # fmt: skip
        """One slot's work in one call, between virtual times vstart_s and vend_s."""
        row = self.calls.setdefault(
            (iteration, call),
            dict(iteration=iteration, call=call, layer=layer, vstart_s=vstart_s, vend_s=vend_s,
                 active_s=0.0, scale=scale, rows=np.zeros(len(self.slots), np.int64)),
        )  # fmt: skip
        row["vstart_s"], row["vend_s"] = min(row["vstart_s"], vstart_s), max(row["vend_s"], vend_s)
        row["active_s"] += (vend_s - vstart_s) / scale
        row["rows"][self.slots.index(slot)] += rows

    def write(self, group: h5py.Group) -> None:
        ordered = [self.calls[k] for k in sorted(self.calls)]
        for name in _COLUMNS:
            dtype = np.float64 if name.endswith("_s") or name == "scale" else np.int64
            group[name] = np.array([r[name] for r in ordered], dtype)
        group["rows"] = np.array([r["rows"] for r in ordered], np.int64).reshape(
            len(ordered), len(self.slots)
        )
        group.attrs["slots"] = np.array(self.slots, np.int64)
        group.attrs["is_routed"] = np.array(self.is_routed, np.bool_)
        group.attrs["topk_scale"] = self.topk_scale
        group.attrs["experts_per_slot"] = self.experts_per_slot


def write_loads(f: h5py.File, loads: dict[int, ExpertLoad]) -> None:
    """/afd_load/<rank> for every expert die that reported."""
    top = f.create_group("afd_load")
    for rank, load in sorted(loads.items()):
        load.write(top.create_group(str(rank)))


@dataclass(frozen=True, kw_only=True)
class MeasuredLoad:
    """One expert die's calls as read back: columns [num_calls] each, rows [num_calls, slots]."""

    rank: int
    columns: dict[str, np.ndarray]
    rows: np.ndarray
    is_routed: np.ndarray
    topk_scale: float
    experts_per_slot: float


def read_loads(path: str) -> list[MeasuredLoad]:
    """Every expert die's /afd_load group of a run file (ValueError: none there)."""
    with h5py.File(path, "r") as f:
        if "afd_load" not in f:
            raise ValueError(
                f"{path}: no /afd_load group (the expert dies' calls): not an afd run, or "
                "written before expert dies reported their load"
            )
        return [
            MeasuredLoad(
                rank=int(rank),
                columns={name: g[name][()] for name in _COLUMNS},
                rows=g["rows"][()],
                is_routed=g.attrs["is_routed"][()],
                topk_scale=float(g.attrs["topk_scale"]),
                experts_per_slot=float(g.attrs["experts_per_slot"]),
            )
            for rank, g in sorted(f["afd_load"].items(), key=lambda kv: int(kv[0]))
        ]
