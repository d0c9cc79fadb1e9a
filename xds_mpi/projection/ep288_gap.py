"""The ep288 TPOT against xDeepServe §7.1's ~50 ms, term by term (issue 61's last 910C row).

xDeepServe §7.1 (DP288 / EP288, 60 requests a die, 2K + 2K, ~3K at Figure 20, MTP at 90 %)
publishes an iteration of ~93 ms plus a ~2 ms scheduling gap, TPOT (93 + 2) / 1.9 ~ 50 ms, and
of Figure 20's kernel breakdown: attention 21.8 % of the iteration, dispatch + combine about
36 %, one call's minimum and mean (185 / 234 us dispatch, 165 / 312 us combine, through
seed 004's quotation of the figure). So the iteration splits into published terms:

    attention                     0.218 x 93 ms
    the calls' own time           (185 + 165) us x 59 calls (58 MoE layers and the MTP layer)
    the calls' waits              (234 - 185 + 312 - 165) us x 59
    the rest (MLAProlog, gate, experts, dense layers, head, sampling, launches)   93 - the above
    the scheduling gap            2 ms

Step 1 (`ladder`): from `xds-mpi project ep288` (the profile's Table 7 XCCL starts, no INT8
attention, no tail) add, one at a time, each mechanism public data can price, with its band:
[000]'s own XCCL starts (Figure 20's fastest calls; the other end Table 7's, CANN's kernels),
INT8 attention on half the layers ([000] §4.7 "some"; none to all), the straggler tail (the
profile's form 2, where it has one). The last step is the paper's scenario (`--paper`).
Step 2 (`terms`): each published term beside the same term of a step's projection.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xds_mpi.config.hardware import load_profile
from xds_mpi.projection.paper_data import FIG20_COMBINE_US, FIG20_DISPATCH_US, SCENARIOS
from xds_mpi.projection.paper_table import _inputs
from xds_mpi.projection.project import Projection, project

ITERATION_MS = 93.0  # [000] §7.1, without the scheduling gap
GAP_MS = 2.0  # [000] §7.1
ATTENTION_SHARE = 0.218  # [000] §7.1 / Figure 20
TOKENS_PER_STEP = 1.9  # [000] §7.1: MTP acceptance ~90 %
SCENARIO = "000 colocated"


@dataclass(frozen=True, kw_only=True)
class Step:
    """One rung of the ladder: what was added, the TPOT (ms) at its point and at the two ends
    of its own unpublished input (the earlier rungs at their points), and the projection."""

    added: str
    tpot_ms: float
    band_ms: tuple[float, float]
    projection: Projection


def _tpot(scenario, profile: str) -> tuple[float, Projection]:
    cfg, m, hw, kwargs = _inputs(scenario, profile)
    p = project(cfg, m, hw, **kwargs)
    return p.tpot_s * 1e3, p


def ladder(profile: str = "ascend910c") -> list[Step]:
    """Step 1 (module docstring): the command, then each priced mechanism added in turn."""
    paper = SCENARIOS[SCENARIO]
    command = replace(paper, xccl_starts="table7", overrides=(), int8_attention=0.0,
                      straggler_tail=False)  # fmt: skip
    starts = replace(command, xccl_starts=paper.xccl_starts)
    int8 = replace(starts, overrides=paper.overrides, int8_attention=paper.int8_attention)
    rungs = [
        ("xds-mpi project ep288 (Table 7's XCCL starts)", command, (command, command)),
        ("[000]'s XCCL starts (Figure 20's fastest calls)", starts, (command, starts)),
        ("INT8 attention on half the layers ([000] §4.7)", int8,
         (replace(int8, int8_attention=0.0), replace(int8, int8_attention=1.0))),
    ]  # fmt: skip
    if "stragglers" in load_profile(profile):
        rungs.append(("straggler tail, form 2 (the profile's)", paper, (int8, paper)))
    steps = []
    for added, scenario, (lo, hi) in rungs:
        tpot, p = _tpot(scenario, profile)
        ends = sorted((_tpot(lo, profile)[0], _tpot(hi, profile)[0]))
        steps.append(Step(added=added, tpot_ms=tpot, band_ms=(ends[0], ends[1]), projection=p))
    return steps


def published_terms() -> dict[str, float]:
    """The published iteration split into terms (module docstring; ms)."""
    calls = 59
    own = (FIG20_DISPATCH_US[0] + FIG20_COMBINE_US[0]) * calls / 1e3
    waits = (FIG20_DISPATCH_US[1] - FIG20_DISPATCH_US[0]) * calls / 1e3 + (
        FIG20_COMBINE_US[1] - FIG20_COMBINE_US[0]
    ) * calls / 1e3
    attention = ATTENTION_SHARE * ITERATION_MS
    return {
        "attention": attention,
        "calls' own time": own,
        "calls' waits": waits,
        "the rest": ITERATION_MS - attention - own - waits,
        "scheduling gap": GAP_MS,
    }


def projected_terms(p: Projection) -> dict[str, float]:
    """The same terms of a projection (ms): attention from the breakdown, the calls' own time
    and waits from one call's parts times the calls, the rest what is left of the iteration."""
    b, prim = p.breakdown_s, p.primitives_s
    calls = sum(v for k, v in b.items() if "dispatch" in k or "combine" in k)
    parts = ("dispatch wait", "combine wait", "dispatch imbalance", "combine imbalance")
    waits_one = sum(prim.get(k, 0.0) for k in parts)
    one_call = prim["dispatch"] + prim["combine"]
    waits = calls * waits_one / one_call
    attention = b.get("attention", 0.0) + b.get("MTP attention", 0.0)
    gap = b.get("scheduling bubble", 0.0)
    rest = p.iteration_s - attention - calls - gap
    terms = {"attention": attention, "calls' own time": calls - waits, "calls' waits": waits,
             "the rest": rest, "scheduling gap": gap}  # fmt: skip
    return {k: v * 1e3 for k, v in terms.items()}


def published_tpot_ms() -> float:
    return (ITERATION_MS + GAP_MS) / TOKENS_PER_STEP
