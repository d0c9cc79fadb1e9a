"""TE-Load (DeepServe §6.2, Table 2 step 3) per path: the seconds until a new TE's dies hold
their weights, for `num_new_tes` TEs loading at once.

- fork: NPU-fork, each die's weights from the same die of a serving TE over the UB, relayed as
  a pipelined broadcast (`broadcast_s`);
- dram: DRAM-hit, each die from its host's page cache over its NPU's PCIe link (`pcie_s`);
- cold: DRAM-miss, the model fetched from the OBS bucket (one fetch per TE, the bucket shared:
  `obs_fetch_s`), then over PCIe;
- ems: model caching, each die from the EMS pool over the UB (`pool_s`); a model the pool does
  not hold is fetched from OBS once for all loaders first (CloudMatrix-Infer §4.4.3).

Every path ends with the model's tensor set-up (DeepServe §6.2: "about 0.3s"). A transfer
follows its fetch (store and forward); docs/scaling.md gives each figure's source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import Config
from xds_mpi.scaling.weights import ModelBytes

GB = 1e9
MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class UbFigures:
    """A hardware profile's figures a load reads: a die's UB write and read bandwidth (bytes/s)
    and write latency (s) to another node, and the weights' precision (bytes per GEMM weight)."""

    write_bytes_per_s: float
    read_bytes_per_s: float
    write_latency_s: float
    weight_bytes: int


@cache
def ub_figures(profile: str) -> UbFigures:
    ub, serving = load_profile(profile)["ub"], load_profile(profile).get("serving", {})
    return UbFigures(
        write_bytes_per_s=ub["write_gb_per_s_inter"] * GB,
        read_bytes_per_s=ub.get("read_gb_per_s_inter", ub["write_gb_per_s_inter"]) * GB,
        write_latency_s=ub["write_latency_us_inter"] * 1e-6,
        weight_bytes=int(serving.get("weight_bytes", 1)),
    )


@dataclass(frozen=True, kw_only=True)
class LoadPrice:
    """TE-Load of each of `num_new_tes` TEs of `num_dies` dies loading at once.

    bytes_per_die: what the slowest die loads; fetch_s: storage into DRAM or the pool (0 where
    nothing is fetched); transfer_s: into the dies (PCIe, the pool's UB, the fork's UB);
    setup_s: the model's tensors set up; die_bytes_per_s: one die's share of its link."""

    path: str
    num_dies: int
    num_new_tes: int
    bytes_per_die: float
    fetch_s: float
    transfer_s: float
    setup_s: float
    die_bytes_per_s: float

    @property
    def seconds(self) -> float:
        return self.fetch_s + self.transfer_s + self.setup_s


def tree_levels(num_receivers: int, fanout: int) -> int:
    """Levels of a broadcast tree whose every sender feeds `fanout` receivers: the fewest L with
    fanout + fanout^2 + ... + fanout^L >= num_receivers (fanout 1: a chain, L = receivers)."""
    if fanout == 1:
        return num_receivers
    levels, reached, width = 0, 0, 1
    while reached < num_receivers:
        width *= fanout
        reached += width
        levels += 1
    return levels


def broadcast_s(
    nbytes: float,
    *,
    num_receivers: int,
    fanout: int,
    link_bytes_per_s: float,
    chunk_bytes: float,
    hop_latency_s: float,
) -> float:
    """One sender's `nbytes` to `num_receivers`, pipelined in chunks down a tree of `fanout`:
    a sender's link is split over its `fanout` receivers, and each level after the first adds
    one chunk's time (the pipeline's fill) and a hop's latency. The source sends the bytes
    `fanout` times, not `num_receivers` times: a chain grows by a chunk per receiver."""
    fanout = min(fanout, num_receivers)
    levels = tree_levels(num_receivers, fanout)
    chunk = min(chunk_bytes, nbytes)
    return fanout * (nbytes + (levels - 1) * chunk) / link_bytes_per_s + levels * hop_latency_s


def pcie_s(nbytes: float, *, num_dies: int, dies_per_chip: int, pcie_bytes_per_s: float) -> float:
    """Each die's `nbytes` over its NPU's PCIe link, shared by the NPU's dies that load."""
    return nbytes * min(dies_per_chip, num_dies) / pcie_bytes_per_s


def obs_fetch_s(model_bytes: float, *, num_loaders: int, obs_bytes_per_s: float) -> float:
    """`num_loaders` fetches of the whole model from one bucket at once, its bandwidth shared:
    each ends when all do."""
    return num_loaders * model_bytes / obs_bytes_per_s


def pool_s(
    nbytes: float, *, num_loading_dies: int, pool_bytes_per_s: float, die_read_bytes_per_s: float
) -> float:
    """Each of `num_loading_dies` dies reads `nbytes` from the pool: the pool's UB bandwidth
    shared by all of them, capped by one die's UB read."""
    rate = min(die_read_bytes_per_s, pool_bytes_per_s / num_loading_dies)
    return nbytes / rate


def te_load(
    cfg: Config, *, num_dies: int, num_new_tes: int, model: ModelBytes, fanout: int
) -> LoadPrice:
    """TE-Load by cfg.scaling.path (module docstring) for `num_new_tes` TEs of `num_dies`."""
    sc, ub = cfg.scaling, ub_figures(cfg.hardware.profile)
    nbytes = model.per_die(num_dies, redundant_slots=cfg.deployment.redundant_slots_per_die)
    obs = sc.obs_gb_per_s * sc.obs_efficiency * GB
    fetch = 0.0
    if sc.path == "fork":
        transfer = broadcast_s(
            nbytes,
            num_receivers=num_new_tes,
            fanout=fanout,
            link_bytes_per_s=ub.write_bytes_per_s,
            chunk_bytes=sc.fork_chunk_mb * MB,
            hop_latency_s=ub.write_latency_s,
        )
    elif sc.path == "ems":
        if not sc.ems_cached:
            fetch = obs_fetch_s(model.total, num_loaders=1, obs_bytes_per_s=obs)
        transfer = pool_s(
            nbytes,
            num_loading_dies=num_new_tes * num_dies,
            pool_bytes_per_s=sc.pool_nodes * sc.pool_node_gb_per_s * GB,
            die_read_bytes_per_s=ub.read_bytes_per_s,
        )
    else:  # dram, cold: the host's DRAM over PCIe, after the fetch for cold
        if sc.path == "cold":
            fetch = obs_fetch_s(model.total, num_loaders=num_new_tes, obs_bytes_per_s=obs)
        transfer = pcie_s(
            nbytes,
            num_dies=num_dies,
            dies_per_chip=cfg.hardware.dies_per_chip,
            pcie_bytes_per_s=sc.pcie_gb_per_s * GB,
        )
    return LoadPrice(
        path=sc.path,
        num_dies=num_dies,
        num_new_tes=num_new_tes,
        bytes_per_die=nbytes,
        fetch_s=fetch,
        transfer_s=transfer,
        setup_s=sc.tensor_init_s,
        die_bytes_per_s=nbytes / transfer if transfer > 0 else math.inf,
    )
