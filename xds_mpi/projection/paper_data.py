"""Published numbers the projection is held to, in two sets kept apart (docs/design.md,
"Calibration and validation"). [000] = xDeepServe (arXiv 2508.02520), [001] = CloudMatrix-Infer
(arXiv 2506.12708).

CALIBRATION: micro-level data only (one primitive, one operator, one launch). Constants in
configs/hardware/ come from these or from the hardware specs and operator tables cited there.
VALIDATION: end-to-end numbers. None of them sets a constant; `xds-mpi project --paper` prints
how far the projection lands from each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xds_mpi.eplb.drift import DRIFT_SAME_REQUESTS

# -- CALIBRATION --------------------------------------------------------------------------------
# [001] Table 7: dispatch / combine latency (us) per rank, 128 tokens per rank, top-8.
TABLE7_TOKENS = 128
TABLE7_CM384 = [  # "CANN EP on CM384"
    ("dispatch", 8, 116.0), ("dispatch", 16, 131.0), ("dispatch", 32, 133.0),
    ("dispatch", 64, 141.0), ("dispatch", 128, 152.0), ("dispatch", 256, 152.0),
    ("combine", 8, 118.0), ("combine", 16, 132.0), ("combine", 32, 146.0),
    ("combine", 64, 150.0), ("combine", 128, 150.0), ("combine", 256, 149.0),
]  # fmt: skip
TABLE7_H800 = [  # "DeepSeek DeepEP on H800"
    ("dispatch", 8, 163.0), ("dispatch", 16, 173.0), ("dispatch", 32, 182.0),
    ("dispatch", 64, 186.0), ("dispatch", 128, 192.0), ("dispatch", 256, 194.0),
    ("combine", 8, 318.0), ("combine", 16, 329.0), ("combine", 32, 350.0),
    ("combine", 64, 353.0), ("combine", 128, 369.0), ("combine", 256, 360.0),
]  # fmt: skip
# [000] Figure 20 (DP288 / EP288, batch 60 per die), through seed 004 (a memo of [000] that
# quotes the figure's numbers its text conversion lost): one call's latency (us) over the
# iteration's calls, (min, mean). The minimum is a call that waited for no peer: its kernel's
# own cost, which sets the XCCL kernel starts of [000]'s scenarios (`Scenario.xccl_starts`).
# The mean minus the minimum is what the calls waited: a validation row of the wait model.
FIG20_DISPATCH_US = (185.0, 234.0)
FIG20_COMBINE_US = (165.0, 312.0)
# The same calls' maxima (seed 004): the slowest call of the run, a validation row of the wait
# model's tail (waits.py), never a constant.
FIG20_MAX_US = {"dispatch": 1231.0, "combine": 2939.0}
# [001] §4.2.4: "Each graph dispatch introduces a startup latency of 0.6 - 0.8 ms".
GRAPH_LAUNCH_MS = (0.6, 0.8)


# -- VALIDATION ---------------------------------------------------------------------------------
# [001] §5.1: one decode instance, DP320 / EP320, one expert per die: 32 shared-expert copies,
# 256 routed and 32 redundant experts. The config holds 256 routed dies and 64 others; 32 of those
# hold a routed replica (`redundant_dies`), so the shared expert runs on 32 dies.
_EP320 = ("deployment.dp_groups_per_domain=320", "deployment.num_shared_expert_dies=64")


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A published deployment and workload. kv_spread: half-width of a DP group's requests' KV
    lengths over their mean (requests spread uniformly through their decode); microbatches: 2 =
    the two-stream overlap ([001] §4.2.3); pipelined_graphs: graph launches hidden ([001] §4.2.4);
    skew: the expert-load skew (hottest / mean, share above the mean; [000] Figure 11a) that
    FlowServe's EPLB rebalances, None where the paper gives none (expected loads even; one
    iteration's routing noise remains); drift_sigma: how far the experts' loads move between
    the slices EPLB placed on and the slice priced (Skew.drift_sigma); redundant_dies: as
    project() takes it; batch: requests per die (published_batch: as the paper states it, per
    NPU for [001]); scheduling_bubble: the host's gap between iterations is paid ([000] §7.1
    states 2 ms; [001] §4.2.4 runs the graphs back to back, with the CPU scheduling the next
    graph while the NPU runs one, and states no gap); xccl_starts: where the XCCL kernel starts
    come from, "table7" (the profile's fit to [001] Table 7, CANN's EP kernels) or "fig20 min"
    ([000]'s own XCCL kernels: Figure 20's fastest dispatch and combine, FIG20_*_US);
    int8_attention: the share of the layers whose attention core runs in INT8 (project());
    the INT8 KV cache is the override scheduler.kv_int8=true; straggler_tail: the dies' starts
    have the heavy tail [000] §4.4 describes for FlowServe (waits.py, the profile's
    `stragglers`), paid by [000]'s scenarios."""

    name: str
    setup: str
    config: str
    overrides: tuple[str, ...] = ()
    batch: int
    published_batch: int = 0
    kv_len: int
    kv_spread: float
    mtp_depth: int = 1
    accept: float
    microbatches: int = 1
    pipelined_graphs: bool = False
    skew: tuple[float, float] | None = (30.0, 0.2)
    drift_sigma: float = DRIFT_SAME_REQUESTS
    redundant_dies: int = 0
    stream0_aic: int | None = None
    scheduling_bubble: bool = True
    xccl_starts: str = "table7"
    int8_attention: float = 0.0
    straggler_tail: bool = False

    @property
    def conditions(self) -> str:
        """The scenario in a few words, for the table."""
        overlap = ", 2 streams" if self.microbatches > 1 else ""
        batch = f"b{self.batch}/die"
        if self.published_batch:
            batch = f"b{self.published_batch}/NPU={batch}"
        mtp = f"MTP {self.accept:.0%}" if self.mtp_depth else "no MTP"
        return f"{self.setup}, {batch}, KV {self.kv_len}, {mtp}{overlap}"


def _cmi(batch: int, prompt: int, output: int, *, mtp: bool = True) -> Scenario:
    """[001] Table 5's rows. The batch is per NPU (two dies): Table 4 gives the NPU 1,504 INT8
    TOPS (the package, [001] §3.3) and its tokens/s are batch / TPOT, and §4.2.1 sizes a die's
    buffers for "a local batch of at most 96 tokens" (48 requests x 2 with MTP at batch 96).
    MTP 1 at 70 % ([001] §5.2); pipelined MTP graphs ([001] §4.2.4); the two-stream pipeline
    where [001] evaluates it, batch 64-128 (§5.4.1, Figure 20a), not at 24 or 8; no load
    distribution is published ([001] §4.1: EPLB splits a replicated expert's tokens evenly).
    KV lengths run from the prompt to prompt + output."""
    return Scenario(
        name=f"001 b{batch} {prompt}+{output}" + ("" if mtp else " no MTP"),
        setup="DP320/EP320",
        config="ep288",
        overrides=_EP320,
        batch=batch // 2,
        published_batch=batch,
        kv_len=prompt + output // 2,
        kv_spread=(output / 2) / (prompt + output / 2),
        mtp_depth=1 if mtp else 0,
        accept=0.7 if mtp else 0.0,
        microbatches=2 if batch >= 64 else 1,
        # §4.2.3 states the split (16 of 24 AIC for stream 0) at 4K, batch 96, MTP; elsewhere
        # the streams are rebalanced adaptively
        stream0_aic=16 if (batch, prompt, mtp) == (96, 4096, True) else None,
        pipelined_graphs=True,
        scheduling_bubble=False,  # §4.2.4: "compute graphs ... execute back-to-back"
        skew=None,
        redundant_dies=32,
    )


# [000] §4.7 (KV Cache Quantization): "we quantize non-RoPE components ... to INT8. For
# attention layers with lower sensitivity to precision, we further optimize by performing the
# attention computation entirely in INT8." The first holds for every layer of [000]'s
# deployments; the second for "some" layers, a count the paper does not give. Assumption, not
# fitted: half of them, the midpoint of none and all; `xds-mpi project --paper` prints the
# [000] rows at none and at all beside it. [001] states no INT8 KV or attention.
_INT8_000 = ("scheduler.kv_int8=true",)
INT8_ATTENTION_000 = 0.5
INT8_ATTENTION_BRACKET = (0.0, 1.0)


def _fig20a(batch: int) -> Scenario:
    """[001] §5.4.1 / Figure 20a: decode throughput with and without the two-stream pipeline,
    "All requests have a 4,096-token KV cache length" (no spread), batch per NPU as Table 5's,
    MTP on as in every [001] decode run; the stated 16/8 split at batch 96 (§4.2.3's "4K
    sequence, batch size 96, MTP enabled"), the balancing one elsewhere."""
    return replace(
        _cmi(96, 4096, 0),
        name=f"001 Fig. 20a b{batch}",
        batch=batch // 2,
        published_batch=batch,
        kv_len=4096,
        kv_spread=0.0,
        microbatches=2,
        stream0_aic=16 if batch == 96 else None,
    )


SCENARIOS = {
    # [000] §7.1 / Figure 20: DP288 EP288, batch 60 per die, ~3K sequence length, MTP 90 %.
    # "complete prefill for all requests before entering the decode phase simultaneously", fixed
    # 2K prompts and 2K outputs: every request has the same KV length at every step (no spread).
    "000 colocated": Scenario(
        name="000 colocated",
        setup="DP288/EP288",
        config="ep288",
        overrides=_INT8_000,
        batch=60,
        kv_len=3072,
        kv_spread=0.0,
        accept=0.9,
        xccl_starts="fig20 min",
        int8_attention=INT8_ATTENTION_000,
        straggler_tail=True,
    ),
    # [000] §7.1 AFD / §3.3 (the §5.2 deployment): 3 DP domains x 160 attention dies + EP288,
    # batch 96, 2K+2K workload.
    "000 afd": Scenario(
        name="000 afd",
        setup="3x160 attention + EP288",
        config="afd_pod",
        overrides=("deployment.redundant_slots_per_die=1", *_INT8_000),  # [000] §4.5: "Each
        # MoE layer reserves redundant slots per NPU" for EP288 (the afd_pod config has none)
        batch=96,
        kv_len=3072,
        kv_spread=1 / 3,
        accept=0.9,
        xccl_starts="fig20 min",  # A2E/E2A are XCCL kernels of the same library ([000] §3.3)
        int8_attention=INT8_ATTENTION_000,
        straggler_tail=True,
    ),
    "001 b128 1024+1024": _cmi(128, 1024, 1024),
    "001 b112 2048+256": _cmi(112, 2048, 256),
    "001 b96 4096+256": _cmi(96, 4096, 256),
    "001 b24 4096+256": _cmi(24, 4096, 256),
    "001 b8 4096+256": _cmi(8, 4096, 256),
    "001 b96 4096+256 no MTP": _cmi(96, 4096, 256, mtp=False),
    **{f"001 Fig. 20a b{b}": _fig20a(b) for b in (64, 96, 128)},
}


ROLES = ("validation", "derived", "calibration")
# The measurements the validation rows come from: one run (or one sweep of one setup) each.
E000_COLOCATED = "000 §7.1 colocated run"
E000_AFD = "000 §7.1 AFD run"
E000_A2E = "000 §3.3 A2E/E2A"
E001_TABLE5 = "001 Table 5 sweep"
E001_LAYER = "001 b96 4K layer (Fig. 22b, §4.2.3)"
E001_FIG20A = "001 Fig. 20a ablation"
EXPERIMENTS = (E000_COLOCATED, E000_AFD, E000_A2E, E001_TABLE5, E001_LAYER, E001_FIG20A)


@dataclass(frozen=True, kw_only=True)
class Published:
    """One row: `metric` of the projection of `scenario` against `value`. role: "validation" (an
    independent published point, counted), "derived" (arithmetic of other published numbers,
    shown and not counted; `derived_from` says which) or "calibration" (a number a constant was
    set from, shown beside the sentence it shares with a validation row). lacks: the mechanism
    the model does not have that the row would need, printed when the row misses. experiment:
    the measurement a validation row comes from (EXPERIMENTS): rows of one experiment share its
    setup and its errors, so the table counts them by row and by experiment."""

    source: str
    scenario: str
    metric: str
    value: float
    unit: str
    role: str = "validation"
    derived_from: str = ""
    lacks: str = ""
    experiment: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES or (self.role == "derived") != bool(self.derived_from):
            raise ValueError(
                f"{self.source} {self.metric}: role {self.role!r} with derived_from "
                f"{self.derived_from!r}; a derived row names what it is made of"
            )
        if self.role == "validation" and self.experiment not in EXPERIMENTS:
            raise ValueError(
                f"{self.source} {self.metric}: a validation row names its experiment, one of "
                f"{EXPERIMENTS}; got {self.experiment!r}"
            )


_LACKS_000_ITERATION = (
    "dispatch/combine waits from the dies' own imbalance (Figure 20: up to 10x between dies; the "
    "model has only Table 7's start jitter) and the attention path's operators beyond MLAProlog "
    "and MLA"
)
_LACKS_ATTENTION = (
    "a time on the attention path that grows with the rows and the stream's cores, about "
    "0.7-1.7 us per row on the whole die beyond MLAProlog's weight reads and MLA's core at "
    "Tables 8-10; every operator's shape was checked against the papers and none names it "
    "(design.md §5b, the attention-path audit)"
)
_LACKS_OVERLAP = (
    "the size, not the sign: both streams are priced about 20 % under §4.2.3's 600 us (the "
    "stream rows below); the time each path misses (the attention path's per-row time of the "
    "audit; on the MoE path, work Figure 20b finds only marginally longer per microbatch than "
    "for the whole batch on one stream) is paid by one stream too and sets how much two hide "
    "(docs/design.md §5b, the overlap's sign)"
)
_LACKS_SMALL_BATCH = (
    "priced slow at 4 requests per die: the dispatch/combine starts fitted at Table 7's 128 "
    "tokens per rank (quantization included) are paid whole at 8 rows; no small-batch primitive "
    "figure is published"
)

VALIDATION = [
    # [000] §7.1: "takes approximately 93 ms. The scheduling bubble between iterations adds around
    # 2 ms" (93 + 2 = 95), "TPOT of 50 ms", "2 x 60 x 1000 / 50 = 2400 tokens/s". The 2 ms sets
    # the profile's serving.scheduler_bubble_ms: a calibration number from the same sentence, so
    # the independent point is the 93 ms forward; 95, 50 and 2400 are its arithmetic.
    Published(source="000 §7.1", scenario="000 colocated", metric="forward", value=93.0,
              unit="ms", lacks=_LACKS_000_ITERATION, experiment=E000_COLOCATED),
    Published(source="000 §7.1", scenario="000 colocated", metric="scheduling bubble", value=2.0,
              unit="ms", role="calibration"),
    Published(source="000 §7.1", scenario="000 colocated", metric="iteration", value=95.0,
              unit="ms", role="derived", derived_from="93 + 2 (forward + bubble)"),
    Published(source="000 §7.1", scenario="000 colocated", metric="tpot", value=50.0, unit="ms",
              role="derived", derived_from="95 / 1.9"),
    Published(source="000 §7.1", scenario="000 colocated", metric="tokens/s/chip", value=2400.0,
              unit="tok/s", role="derived", derived_from="2 x 60 x 1000 / 50"),
    # [000] §7.1 / Figure 20: attention 21.8 %, dispatch + combine "about 36 %" of the iteration.
    Published(source="000 Fig. 20", scenario="000 colocated", metric="share attention",
              value=21.8, unit="%",
              lacks="the share of the layers running INT8 attention ([000] §4.7 says "
              "\"some\"; taken as half, an assumption: the rows at none and at all are printed "
              "below) and the attention path's per-row time (design.md §5b)",
              experiment=E000_COLOCATED),
    # "about 36 %": Figure 20's mean calls over the forward, (234 + 312) us x 59 MoE layer
    # passes / 93 ms = 35 %; the calls' minima set constants and their waits are the rows below.
    Published(source="000 Fig. 20", scenario="000 colocated", metric="share dispatch+combine",
              value=36.0, unit="%", role="derived",
              derived_from="(234 + 312) us x 59 MoE layers / 93 ms: the calls' minima "
              "(calibration) and waits (the wait rows) over the forward"),
    # [000] Figure 20 via seed 004: the fastest dispatch / combine set the [000] XCCL starts
    # (calibration); mean - min is the calls' wait (validation of the wait model).
    Published(source="004 (000 Fig. 20)", scenario="000 colocated", metric="dispatch intrinsic",
              value=FIG20_DISPATCH_US[0], unit="us", role="calibration"),
    Published(source="004 (000 Fig. 20)", scenario="000 colocated", metric="combine intrinsic",
              value=FIG20_COMBINE_US[0], unit="us", role="calibration"),
    Published(source="004 (000 Fig. 20)", scenario="000 colocated", metric="dispatch wait",
              value=FIG20_DISPATCH_US[1] - FIG20_DISPATCH_US[0], unit="us",
              lacks="a start spread of [000]'s own dies: the body is the spread fitted to [001] "
              "Table 7's CANN kernels (which carries all of Table 7's growth with EP) and the "
              "straggler tail is assumed (waits.py); [000]'s dies start closer together than "
              "both give, and [000] §7.1's compute variance between dies is not priced",
              experiment=E000_COLOCATED),
    Published(source="004 (000 Fig. 20)", scenario="000 colocated", metric="combine wait",
              value=FIG20_COMBINE_US[1] - FIG20_COMBINE_US[0], unit="us",
              lacks="the expert dies' compute variance beyond the expected hottest die (up to "
              "17.8x on combine: stragglers the model has no source for)",
              experiment=E000_COLOCATED),
    # seed 004's maxima of the same calls: the slowest call over the run (the tail's rows)
    *[
        Published(source="004 (000 Fig. 20)", scenario="000 colocated", metric=f"{op} max",
                  value=us, unit="us", experiment=E000_COLOCATED,
                  lacks=f"a spread of the {what} from layer to layer ([000] §7.1 names it as "
                  f"{op}'s variance): every layer is priced at the expected {where}, the same "
                  f"in each; {tail}")
        for op, us, what, where, tail in (
            ("dispatch", FIG20_MAX_US["dispatch"], "DP groups' MLA compute",
             "slowest DP group", "the launch straggler (waits.py form 2, ascend910c_kernels) "
             "reaches each pass's first dispatch only, over one iteration's 288 x 2 launches"),
            ("combine", FIG20_MAX_US["combine"], "expert dies' MoE compute",
             "hottest expert die", "no launch straggler reaches combine (waits.py form 2)"),
        )
    ],
    # [000] §3.3: "A2E achieves a latency of 172 us, while E2A completes in 193 us".
    Published(source="000 §3.3", scenario="000 afd", metric="A2E", value=172.0, unit="us",
              lacks="a start of its own: stage 1 (to the die's trampoline) pays the whole "
              "dispatch start set on Figure 20's fastest EP288 dispatch, and stage 2 waits for "
              "the slowest of 160 trampolines at Table 7's start spread; [000] gives neither "
              "for the A2E kernels", experiment=E000_A2E),
    Published(source="000 §3.3", scenario="000 afd", metric="E2A", value=193.0, unit="us",
              lacks="a start of its own: stage 1 waits for the slowest of the expert dies at "
              "Table 7's start spread and stage 2 pays the whole combine start set on Figure "
              "20's fastest EP288 combine; [000] gives neither for the E2A kernels",
              experiment=E000_A2E),
    # [000] §7.1 (disaggregated MoE-attention): "MLAProlog, MLA, Gating, and the first stage of
    # A2E each take approximately 700 [us] per layer" (the text's "ns" read by its own sum,
    # 0.7 x 2 x 61 ms): the attention side of one microbatch.
    Published(source="000 §7.1 AFD", scenario="000 afd", metric="attention side", value=700.0,
              unit="us", lacks=_LACKS_ATTENTION, experiment=E000_AFD),
    # [000] §7.1 (disaggregated MoE-attention, the §5.2 deployment): MoE 0.12 ms per layer.
    Published(source="000 §7.1 AFD", scenario="000 afd", metric="MoE", value=120.0, unit="us",
              lacks="the expert dies' work beside the GEMMs (the persistent kernel's polling, "
              "token reordering, the shared expert's scheduling); no operator figure published",
              experiment=E000_AFD),
    # "we achieve a per-chip throughput of 2400 tokens/second with a 50 ms TPOT" (one measured
    # point: 46,080 x 1000 / 50 / 384 chips = 2400); then "2 ms scheduler overhead, 5 ms for the
    # MTP layer, 0.7 x 2 x 61 ms, A2E 0.17, MoE 0.12, E2A 0.19: forward ~93 ms, TPOT 93 / 1.9 ~
    # 49 ms": arithmetic of the rows above. The 2400 and the rows above are one run: counted once.
    Published(source="000 §7.1 AFD", scenario="000 afd", metric="tokens/s/chip", value=2400.0,
              unit="tok/s", role="derived",
              derived_from="the AFD run's 50 ms TPOT: 46,080 x 1000 / 50 / 384 chips (the run "
              "the attention-side row counts)"),
    # "5 ms for the MTP layer": the MTP pass (its block over the committed tokens, eh_proj,
    # the shared head and sampling, its graph's launch).
    Published(source="000 §7.1 AFD", scenario="000 afd", metric="MTP pass", value=5.0,
              unit="ms",
              lacks="what the 5 ms holds beyond the MTP block, eh_proj, the shared head, "
              "sampling and the graph launch is not described; the block's attention side is "
              "priced about 20 % fast, as in the attention-side row", experiment=E000_AFD),
    Published(source="000 §7.1 AFD", scenario="000 afd", metric="tpot", value=49.0, unit="ms",
              role="derived",
              derived_from="(2 + 5 + 0.7 x 2 x 61 + 0.17 + 0.12 + 0.19) / 1.9 of the rows above"),
    # [001] Table 5 (Table 4's CloudMatrix-Infer row is its 4096+256 row): achieved TPOT, and the
    # throughput per NPU (two dies; see _cmi) that is batch / TPOT.
    *[
        Published(source="001 Table 5", scenario=f"001 {cond}", metric=metric, value=value,
                  unit=unit, **extra)
        for cond, tpot, tput in (
            ("b128 1024+1024", 46.8, 2733.0),
            ("b112 2048+256", 47.4, 2360.0),
            ("b96 4096+256", 49.4, 1943.0),
            ("b24 4096+256", 24.6, 974.0),
            ("b8 4096+256", 14.9, 538.0),
        )
        for metric, value, unit, extra in (
            ("tpot", tpot, "ms", {"lacks": _LACKS_SMALL_BATCH if tpot < 20 else _LACKS_ATTENTION,
                                  "experiment": E001_TABLE5}),
            ("tokens/s/chip", tput, "tok/s",
             {"role": "derived", "derived_from": f"{cond.split()[0][1:]} x 1000 / {tpot}"}),
        )
    ],
    # [001] Figure 22b: per-layer latency with MTP, batch 96, 4K: 1,260 us, measured (a bar of
    # the figure, not arithmetic of §4.2.3's "about 600 us" streams, which it agrees with).
    Published(source="001 Fig. 22b", scenario="001 b96 4096+256", metric="layer", value=1260.0,
              unit="us", lacks=_LACKS_ATTENTION, experiment=E001_LAYER),
    # [001] Figure 22b: without MTP, 874 us.
    Published(source="001 Fig. 22b", scenario="001 b96 4096+256 no MTP", metric="layer",
              value=874.0, unit="us", lacks=_LACKS_ATTENTION, experiment=E001_LAYER),
    # [001] §5.4.1 / Figure 20a: "enabling the microbatch-based pipeline improves decode
    # throughput by 5.8%, 9.4%, and 6.9% for batch sizes of 64, 96, and 128": tokens/s with the
    # two streams over tokens/s with one, the same scenario otherwise. Figure 20b's "approximate
    # 10% reduction in overall per-layer latency" at batch 96 is the same measurement.
    *[
        Published(source="001 Fig. 20a", scenario=f"001 Fig. 20a b{b}",
                  metric="two-stream gain", value=gain, unit="%", lacks=_LACKS_OVERLAP,
                  experiment=E001_FIG20A)
        for b, gain in ((64, 5.8), (96, 9.4), (128, 6.9))
    ],
    # [001] §4.2.3: each stream ~600 us per microbatch (4K, batch 96, MTP). Stream 1's
    # "comparable latency" restates the balance: stream 0 is the row, stream 1 derived.
    Published(source="001 §4.2.3", scenario="001 b96 4096+256", metric="stream 0", value=600.0,
              unit="us", lacks=_LACKS_ATTENTION, experiment=E001_LAYER),
    Published(source="001 §4.2.3", scenario="001 b96 4096+256", metric="stream 1", value=600.0,
              unit="us", role="derived",
              derived_from="§4.2.3's 'comparable latency' of the two streams: stream 0's 600 us"),
]  # fmt: skip


# [001] §5.4.3 (Figure 23), EMS context caching, 4K prompts, 16K tokens per NPU; on the UB plane
# unless named: (what, published value). xds_mpi/ems/context_cache_curve.py projects each.
CONTEXT_CACHING = (
    ("prefill throughput, reuse 50 % / 12.5 %", 1.42),
    ("prefill throughput, reuse 90 % / no caching", 2.28),
    ("TTFT reduction at reuse 50 %", 0.34),  # "reduced TTFT by 861 ms (34%)"
    ("TTFT reduction at reuse 90 %", 0.59),  # "a 1,505 ms (59%) decrease"
    ("TTFT without caching (s; 861 ms = 34 %)", 0.861 / 0.34),
    ("prefill throughput UB / VPC, the largest over the reuse rates", 1.52),
)
