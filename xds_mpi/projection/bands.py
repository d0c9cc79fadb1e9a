"""Uncertainty bands on the 910C validation rows, from the inputs the papers do not publish
(the opt-in profile ascend910c_kernels: `xds-mpi project --paper --profile ascend910c_kernels`).

Each input below is an unpublished choice that moves rows; instead of picking it, each row is
projected at both ends of the input's range (the rest at the point values) and the swings
combine in quadrature (the inputs are independent): band = [point - sqrt(sum of the downward
swings squared), point + sqrt(sum of the upward ones squared)]. A row's published value is
inside its band or not; the band's half-width says how much the unpublished inputs leave open.

The inputs (`band_inputs`):
- the per-kernel fixed cost on the 910C (operators.kernel_fixed_band_us: [001] §4.2.2 names it,
  gives no figure);
- the GEMM efficiency at decode M carried from the H800 (kernels.py Step 2): the spread of the
  H800's DeepGEMM rows under M = 2,048 around their fit;
- the MLA core's compute efficiency (efficiency.mla_compute_band: [001] Table 8's 65.4 % or
  AMLA's 86.8 % on CM384, arXiv 2509.25224; [001] does not say which kernel its runs used);
- [000] §4.7's share of the layers running attention in INT8 ("some": none to all);
- [001]'s b24 and b8 runs on one stream or two (§5.4.1 evaluates the pipeline at 64-128 only);
- the straggler tail's probability and shape ([000]'s scenarios, waits.py: assumptions);
- the LM head's precision and sharding (point: BF16 weights on each die, xDeepServe §4.7 lists
  the MLA, MoE and MLP modules only; the other end: INT8 and split over the chip's dies, the
  logits' exchange unpriced, so an optimistic end);
- the XCCL kernel start of [000]'s scenarios, set on Figure 20's EP288 calls: one fixed time per
  call (the point) or a time per peer reached (A2E's first stage reaches one trampoline);
- the colocated two-stream die's core split, where the profile equalises the streams
  (die.stream_split: equal, the point): the whole-core split, [001] §4.2.3's stated 16/8 at b96
  and the best whole-core split elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from xds_mpi.config.hardware import load_profile, stream_split
from xds_mpi.projection.cost import Hardware
from xds_mpi.projection.kernels import LARGE_M, gemm_rows, spread
from xds_mpi.projection.paper_data import INT8_ATTENTION_BRACKET, SCENARIOS, VALIDATION
from xds_mpi.projection.paper_table import _inputs, metric_value, slowest_call_of, stated_split
from xds_mpi.projection.project import project
from xds_mpi.projection.waits import stragglers

# the profile the bands are drawn for: the 910C with issue 61's mechanisms (opt-in; their inputs
# are its `operators`, `stragglers` and efficiency.mla_compute_band)
BANDED = "ascend910c_kernels"
# the EP of Figure 20's calls, on which [000]'s XCCL starts are set (paper_table's
# xccl_starts_from_minima): a start per peer is theirs over this many peers
FIG20_EP = 288
# a variant: (scenario, hardware) -> (scenario, hardware)
Variant = Callable


@dataclass(frozen=True, kw_only=True)
class BandInput:
    name: str
    variants: tuple  # the input's two ends, each a Variant
    applies: Callable = lambda scenario: True


@dataclass(frozen=True, kw_only=True)
class Band:
    """point: the row's projection at the point inputs; swings: input -> (its lowest, its
    highest value of the row); low / high: the quadrature band."""

    point: float
    low: float
    high: float
    swings: dict

    @property
    def half_width(self) -> float:
        """Half the band's width over the point value."""
        return (self.high - self.low) / 2 / abs(self.point)

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high


def band_inputs(profile: str = BANDED) -> list[BandInput]:
    p = load_profile(profile)
    ops = p.get("operators", {})
    inputs = []
    if "kernel_fixed_band_us" in ops:
        lo, hi = (v * 1e-6 for v in ops["kernel_fixed_band_us"])
        inputs.append(BandInput(name="per-kernel fixed cost", variants=tuple(
            (lambda s, hw, f=f: (s, replace(hw, ops=hw.ops.with_fixed(f)))) for f in (lo, hi)
        )))  # fmt: skip
    if "carried_from" in ops:
        other = load_profile(ops["carried_from"])
        hw_other = _hardware(other)
        rows = [r for r in gemm_rows(other) if r.m < LARGE_M]
        peak = other["operators"]["gemm_peak_tops"] * 1e12
        lo, hi = spread(rows, hw_other.ops, peak=peak, hbm=hw_other.hbm_bytes_per_s)
        inputs.append(BandInput(name="GEMM efficiency at decode M (carried)", variants=tuple(
            (lambda s, hw, f=f: (s, replace(hw, ops=hw.ops.scaled(compute=f, memory=f))))
            for f in (1 / hi, 1 / lo)
        )))  # fmt: skip
    if "mla_compute_band" in p["efficiency"]:
        inputs.append(BandInput(name="MLA core efficiency", variants=tuple(
            (lambda s, hw, e=e: (s, replace(hw, mla_eff=e)))
            for e in p["efficiency"]["mla_compute_band"]
        )))  # fmt: skip
    tail = p.get("stragglers")
    if tail:
        for key, name in (("probability", "p"), ("alpha", "alpha")):
            inputs.append(BandInput(
                name=f"straggler tail {name}",
                variants=tuple(
                    (lambda s, hw, kw={name: v}: (s, replace(hw, tail=stragglers(p, **kw))))
                    for v in tail[f"{key}_band"]
                ),
                applies=lambda s: s.straggler_tail,
            ))  # fmt: skip
    inputs.append(BandInput(
        name="[000] §4.7 INT8 attention share",
        variants=tuple((lambda s, hw, x=x: (replace(s, int8_attention=x), hw))
                       for x in INT8_ATTENTION_BRACKET),
        applies=lambda s: s.int8_attention > 0,
    ))  # fmt: skip
    inputs.append(BandInput(
        name="LM head precision and sharding",
        variants=(lambda s, hw: (s, hw), lambda s, hw: (
            s, replace(hw, head_int8=True, head_shards=hw.dies_per_chip))),
    ))  # fmt: skip
    inputs.append(BandInput(
        name="[000] XCCL start fixed or per peer",
        variants=(lambda s, hw: (s, hw),
                  lambda s, hw: (s, replace(hw, start_per_peer_at=FIG20_EP))),
        applies=lambda s: s.xccl_starts == "fig20 min",
    ))  # fmt: skip
    if stream_split(p["die"]) == "equal":
        inputs.append(BandInput(
            name="two-stream split: equalised or whole cores",
            variants=(lambda s, hw: (s, hw), lambda s, hw: (s, replace(hw, equal_streams=False))),
            applies=lambda s: s.microbatches == 2,
        ))  # fmt: skip
    inputs.append(BandInput(
        name="[001] b24/b8 on one stream or two",
        variants=(lambda s, hw: (s, hw), lambda s, hw: (replace(s, microbatches=2), hw)),
        applies=lambda s: s.published_batch in (8, 24),
    ))  # fmt: skip
    return inputs


def _hardware(profile: dict) -> Hardware:
    return Hardware.from_profile(profile)


def row_value(pub, scenario, hw_map: Variant, profile: str = BANDED) -> float:
    """A validation row's projected value with the scenario and hardware a variant gives."""
    # the point's hardware (with [000]'s XCCL starts where the scenario takes them), varied
    s, hw = hw_map(scenario, _inputs(scenario, profile)[2])
    cfg, m, _, kwargs = _inputs(s, profile)
    kwargs["execution"] = replace(kwargs["execution"], stream0_aic=stated_split(s, hw))
    if pub.metric == "two-stream gain":
        one = replace(kwargs["execution"], microbatches=1, stream0_aic=None)
        two = project(cfg, m, hw, **kwargs).tokens_per_s_per_chip
        base = project(cfg, m, hw, **{**kwargs, "execution": one}).tokens_per_s_per_chip
        return 100 * (two / base - 1)
    projection = project(cfg, m, hw, **kwargs)
    if pub.metric.endswith(" max"):
        return slowest_call_of(projection, cfg, m, hw, kwargs, pub.metric.split()[0])
    return metric_value(projection, pub.metric, dies_per_chip=hw.dies_per_chip)


def row_band(pub, profile: str = BANDED) -> Band:
    s = SCENARIOS[pub.scenario]
    point = row_value(pub, s, lambda s, hw: (s, hw), profile)
    swings, down, up = {}, 0.0, 0.0
    for inp in band_inputs(profile):
        if not inp.applies(s):
            continue
        values = [row_value(pub, s, v, profile) for v in inp.variants]
        lo, hi = min(values), max(values)
        swings[inp.name] = (lo, hi)
        down += max(0.0, point - lo) ** 2
        up += max(0.0, hi - point) ** 2
    return Band(point=point, low=point - math.sqrt(down), high=point + math.sqrt(up),
                swings=swings)  # fmt: skip


def band_table(profile: str = BANDED) -> list[tuple]:
    """(the published row, its band) for every validation row."""
    return [(pub, row_band(pub, profile)) for pub in VALIDATION if pub.role == "validation"]
