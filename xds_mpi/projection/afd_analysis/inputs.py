"""The AFD analysis's model and platform from their names: a cost shape (configs/model/) or a
hardware profile (configs/hardware/), or seed 003's Appendix B tables as `003:<name>`.

A hardware profile maps onto 003's platform as follows (configs/hardware/*.yaml cite each value):
the GEMM peak is `die.int8_tops` (INT8 or FP8 weights, as the projection prices GEMMs), memory is
`die.hbm_tb_per_s` and `die.hbm_gb`; the scale-up link is `ub.read_gb_per_s_intra` (the
dispatch pulls its tokens); `ub.node_dies` > 0 means two tiers, with `ub.read_gb_per_s_inter` the
scale-out link and a node of `node_dies` ranks; `node_dies` 0 means one fabric across the pod
(a Superpod), where 003 fixes a deployment unit of 8 ranks (Figure 4's caption)."""

from __future__ import annotations

from dataclasses import replace

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import ConfigError
from xds_mpi.model.shapes import load_model_preset
from xds_mpi.projection.afd_analysis.budget import MoeShape, Platform
from xds_mpi.projection.afd_analysis.paper import GPUS_PER_NODE, MODELS, PLATFORMS

PAPER_PREFIX = "003:"


def moe_shape(name: str) -> MoeShape:
    """`003:<model>` (Table 4) or a cost shape preset / YAML file (configs/model/)."""
    if name.startswith(PAPER_PREFIX):
        key = name.removeprefix(PAPER_PREFIX)
        if key not in MODELS:
            raise ConfigError(f"model {name!r}: 003's Table 4 has {_names(MODELS)}")
        return MODELS[key]

    m = load_model_preset(name)
    shape = MoeShape(
        name=name,
        hidden=m.hidden,
        num_layers=m.num_layers,
        num_moe_layers=m.num_layers - m.num_dense_layers,
        num_experts=m.num_routed_experts,
        top_k=m.top_k,
        moe_intermediate=m.moe_intermediate,
    )
    _positive(f"model {name!r}", vars(shape))
    if shape.num_moe_layers < 1 or shape.top_k > shape.num_experts:
        raise ConfigError(
            f"model {name!r}: need MoE layers (num_layers {m.num_layers} - num_dense_layers "
            f"{m.num_dense_layers} >= 1) and top_k {m.top_k} <= num_routed_experts "
            f"{m.num_routed_experts}"
        )
    return shape


def platform(name: str, *, ranks_per_node: int = 0) -> Platform:
    """`003:<system>` (Table 5) or a hardware profile (configs/hardware/); ranks_per_node > 0
    overrides g (the FFN side's unit)."""
    if ranks_per_node < 0:
        raise ConfigError(f"--afd-node-ranks must be >= 0 (0: the profile's), got {ranks_per_node}")
    if name.startswith(PAPER_PREFIX):
        key = name.removeprefix(PAPER_PREFIX)
        if key not in PLATFORMS:
            raise ConfigError(f"hardware {name!r}: 003's Table 5 has {_names(PLATFORMS)}")
        hw = PLATFORMS[key]
    else:
        hw = _from_profile(name)
    if ranks_per_node:
        hw = replace(hw, ranks_per_node=ranks_per_node)
    return hw


def _from_profile(name: str) -> Platform:
    p = load_profile(name)
    die, ub = p["die"], p["ub"]
    for section, key in (("ub", "read_gb_per_s_intra"), ("ub", "read_gb_per_s_inter")):
        if key not in p[section]:
            raise ConfigError(f"hardware profile {name!r}: section {section!r} lacks {key!r}")
    values = {
        "die.int8_tops": die["int8_tops"],
        "die.hbm_tb_per_s": die["hbm_tb_per_s"],
        "die.hbm_gb": die["hbm_gb"],
        "ub.read_gb_per_s_intra": ub["read_gb_per_s_intra"],
    }
    node_dies = ub["node_dies"]
    if not isinstance(node_dies, int) or node_dies < 0:
        raise ConfigError(f"hardware profile {name!r}: ub.node_dies must be an integer >= 0, "
                          f"got {node_dies!r}")  # fmt: skip
    if node_dies:
        values["ub.read_gb_per_s_inter"] = ub["read_gb_per_s_inter"]
    _positive(f"hardware profile {name!r}", values)
    return Platform(
        name=p.get("name", name),
        flops=die["int8_tops"] * 1e12,
        mem_bytes_per_s=die["hbm_tb_per_s"] * 1e12,
        mem_bytes=die["hbm_gb"] * 1e9,
        scale_up_bytes_per_s=ub["read_gb_per_s_intra"] * 1e9,
        scale_out_bytes_per_s=ub["read_gb_per_s_inter"] * 1e9 if node_dies else None,
        ranks_per_node=node_dies or GPUS_PER_NODE,
    )


def _positive(what: str, values: dict) -> None:
    bad = {k: v for k, v in values.items() if k != "name" and not _is_positive(v)}
    if bad:
        listed = ", ".join(f"{k} = {v!r}" for k, v in bad.items())
        raise ConfigError(f"{what}: need positive numbers, got {listed}")


def _is_positive(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def _names(table: dict) -> str:
    return ", ".join(PAPER_PREFIX + k for k in table)
