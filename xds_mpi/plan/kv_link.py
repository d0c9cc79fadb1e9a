"""Which fabric a prefill->decode KV transfer crosses, pair by pair, and its link model
(xDeepServe §5.1, Figure 2: prefill on 910B or 910C, decode on CloudMatrix384's 910C; "when
prefill runs on 910B and decode on 910C, we transfer KV cache over RoCE or VPC interconnects").

A die's hardware is `pd.prefill_profile` for a prefill die (or `hardware.profile` when unset),
`hardware.profile` for every other die. Two dies of the same hardware share its fabric (class
"ub": the profile's own `ub` section, intra- or inter-node as their servers say); dies of two
hardware types share no UB domain, so their pair crosses `pd.kv_fabric` ("roce" or "vpc"), priced
from both profiles' `scale_out` sections: the slower end's bandwidth, the larger latency.
The p2p protocol itself is the same on every class (the emulator's memory semantics); only the
virtual time of the transfer follows the class (ranks/pd/receive.py).
"""

from __future__ import annotations

from typing import Literal

from xccl.vclock import LinkModel
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.plan.topology import Topology

LinkClass = Literal["ub", "roce", "vpc"]


def die_profile(cfg: Config, topo: Topology, rank: int) -> str:
    """The hardware profile of die `rank`."""
    if rank in topo.ranks_with_role("prefill") and cfg.pd.prefill_profile:
        return cfg.pd.prefill_profile
    return cfg.hardware.profile


def kv_link_class(cfg: Config, topo: Topology, prefill_rank: int, decode_rank: int) -> LinkClass:
    """The fabric the pair's KV crosses."""
    same = die_profile(cfg, topo, prefill_rank) == die_profile(cfg, topo, decode_rank)
    return "ub" if same else cfg.pd.kv_fabric


def kv_link_model(
    cfg: Config, topo: Topology, prefill_rank: int, decode_rank: int, profiles=None
) -> LinkModel:
    """The link model of the pair's class; `profiles`: name -> loaded profile (loads if None)."""
    names = (die_profile(cfg, topo, prefill_rank), die_profile(cfg, topo, decode_rank))
    loaded = [profiles[n] if profiles else load_profile(n) for n in names]
    link = kv_link_class(cfg, topo, prefill_rank, decode_rank)
    if link == "ub":
        return LinkModel.from_profile(loaded[1])
    rates, latencies = [], []
    for name, profile in zip(names, loaded, strict=True):
        section = profile.get("scale_out", {})
        missing = [k for k in (f"{link}_gb_per_s", f"{link}_latency_us") if k not in section]
        if missing:
            raise ConfigError(
                f"pd.kv_fabric({link}) between prefill profile {names[0]!r} and decode profile "
                f"{names[1]!r}: hardware profile {name!r} section 'scale_out' lacks {missing}"
            )
        rates.append(section[f"{link}_gb_per_s"])
        latencies.append(section[f"{link}_latency_us"])
    rate, latency = min(rates), max(latencies)
    return LinkModel(
        write_gb_per_s_intra=rate,
        write_gb_per_s_inter=rate,
        write_latency_us_intra=latency,
        write_latency_us_inter=latency,
        mte_gb_per_s_per_core=rate,  # a NIC moves the bytes, not the AIV cores
        dma_startup_us=0.0,
        max_cores=1,
    )


def check_kv_links(cfg: Config, topo: Topology, prefill, decode) -> None:
    """Before launch: every pair's link model can be built (profiles exist and, across hardware
    types, carry the fabric's figures)."""
    profiles = {cfg.hardware.profile: load_profile(cfg.hardware.profile)}
    name = cfg.pd.prefill_profile
    if name and name not in profiles:
        try:
            profiles[name] = load_profile(name)
        except ConfigError as exc:
            raise ConfigError(f"pd.prefill_profile: {exc}") from None
    for p in prefill[:1]:
        for d in decode[:1]:  # every pair of a deployment is one of these classes
            kv_link_model(cfg, topo, p, d, profiles)


class KvTransferTimes:
    """The virtual seconds a prompt's latent KV takes from a prefill die to a decode die: the
    pair's link model (UB, or RoCE/VPC across hardware types) for the prompt's cache at the cost
    shape (61 layers + MTP; BF16, the latent in INT8 with scheduler.kv_int8). The decode die
    prices its transfers with it (ranks/pd/receive.py), and on the virtual clock the decode
    TE-shell dates a request's KV arrival with it (ranks/shell/pd_pacers.py)."""

    def __init__(self, cfg: Config, topo: Topology, decode_ranks) -> None:
        # Lazy import: model shapes, PD only.
        from xds_mpi.model.shapes import cost_shape

        self.cfg, self.big = cfg, cost_shape()
        self.server_of = {i.rank: i.server for i in topo.ranks}
        prefill = topo.ranks_with_role("prefill")
        self.links = {(p, d): kv_link_model(cfg, topo, p, d) for p in prefill for d in decode_ranks}

    def seconds(self, prefill_rank: int, decode_rank: int, prompt_tokens: int) -> float:
        from xds_mpi.plan.kv_memory import projected_kv_bytes

        same = self.server_of[prefill_rank] == self.server_of[decode_rank]
        nbytes = projected_kv_bytes(prompt_tokens, self.big, kv_int8=self.cfg.scheduler.kv_int8)
        link = self.links[prefill_rank, decode_rank]
        return link.transfer_ns(nbytes, num_cores=self.cfg.xccl.num_cores, same_server=same) / 1e9
