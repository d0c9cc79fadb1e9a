"""The search (docs/planning.md): enumerate, price, replay, rank, keep the frontier."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import ConfigError
from xds_mpi.model.shapes import load_model_preset
from xds_mpi.planning.candidates import DECODE_EP, Candidate, Enumerator, Excluded, Options
from xds_mpi.planning.costs import (
    BASE_CONFIG,
    SHAPE,
    base_config,
    step_table,
    transfer_s,
)
from xds_mpi.planning.frontier import Outcome, Slo, outcome, pareto
from xds_mpi.planning.kv_handoff import Balance
from xds_mpi.planning.prefill_batches import PrefillRule, prefill_batches
from xds_mpi.planning.prefill_cost import prefill_curve, prefill_pass
from xds_mpi.planning.queue import Served, serve
from xds_mpi.planning.routing_skew import prefill_skew
from xds_mpi.planning.workload import PlanWorkload
from xds_mpi.projection.afd_analysis.budget import Scenario, curve, dead_zone
from xds_mpi.projection.afd_analysis.inputs import moe_shape, platform

COLOCATED_CHUNK_TOKENS = 4096  # scheduler.prefill_chunk_tokens written for colocated candidates
# A pod-scale prefill DP group's pass: its token budget and chunk (an assumption: the candidates'
# configs keep the tiny runs' xccl.max_tokens_per_die), one length class (docs/planning.md)
POD_PREFILL_STEP_TOKENS = 16384


def pod_prefill_rule(c: Candidate) -> PrefillRule:
    return PrefillRule(
        step_tokens=POD_PREFILL_STEP_TOKENS,
        chunk_tokens=POD_PREFILL_STEP_TOKENS,
        long_prompt_tokens=0,
        max_batch=c.max_batch,
        mtp_depth=c.mtp_depth,
    )


@dataclass(frozen=True, kw_only=True)
class Priced:
    candidate: Candidate
    outcome: Outcome


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """ranked: by goodput per chip, then tokens/s per chip; frontier: the Pareto points of
    ranked (tokens/s per chip against TPOT p99 and TTFT p99), by tokens/s per chip."""

    ranked: list[Priced]
    frontier: list[Priced]
    excluded: list[Excluded]
    num_dies: int
    wall_s: float


class Planner:
    """One search's fixed inputs: the workload, SLO, hardware profile and MTP acceptance."""

    def __init__(
        self,
        workload: PlanWorkload,
        slo: Slo,
        *,
        profile: str = "ascend910c",
        accept: float = 0.9,
        base: str = BASE_CONFIG,
        chunk_tokens: int = COLOCATED_CHUNK_TOKENS,
        decode_only: bool = False,
        prefill_rule: Callable[[Candidate], PrefillRule] = pod_prefill_rule,
    ) -> None:
        """base: the config the candidates' keys go over (the pod's model; a verification's
        reduced width the emulated one); chunk_tokens: a colocated die's prefill chunk;
        decode_only: the requests arrive prefilled (the papers' decode throughput);
        prefill_rule: a PD candidate's prefill batching (a verification's: the emulated one's)."""
        self.w, self.slo, self.profile, self.accept = workload, slo, profile, accept
        self.base, self.chunk_tokens = base, chunk_tokens
        # the papers' decode figures: every request arrives prefilled, its KV in place; the
        # prefill TEs are neither priced nor counted in the chips
        self.decode_only = decode_only
        self.hw = load_profile(profile)
        self.dies_per_chip = int(self.hw["die"].get("dies_per_chip", 1))
        self.max_prompt = int(workload.prompt_len.max())
        self.prefill_rule = prefill_rule
        base_cfg = base_config((), profile, base)
        self.block_tokens = base_cfg.scheduler.kv_block_tokens
        self.model = base_cfg.model  # whose gate spreads a prefill pass's rows (routing_skew)
        self._transfers: dict[bool, np.ndarray] = {}
        self._prefills: dict[tuple, np.ndarray] = {}

    def enumerate(self, chips: float, kinds: tuple[str, ...], opts: Options) -> Enumerator:
        num_dies = int(chips * self.dies_per_chip)
        smallest = min(DECODE_EP)
        if num_dies < smallest:
            raise ConfigError(
                f"--chips {chips:g} is {num_dies} dies on {self.profile} "
                f"({self.dies_per_chip} per chip): below one TE, whose smallest EP group here "
                f"is {smallest} dies ({smallest / self.dies_per_chip:g} chips): the 256 routed "
                "experts need them for memory"
            )
        e = Enumerator(
            load_model_preset(SHAPE),
            num_dies=num_dies,
            hbm=self.hw["die"]["hbm_gb"] * 1e9,
            weight_bytes=self.hw.get("serving", {}).get("weight_bytes", 1),
            context_len=self.w.mean_context(),
            max_prompt=self.max_prompt,
            dead_zone=self._dead_zone(),
            count_prefill=not self.decode_only,
        )
        e.run(kinds, opts)
        return e

    def _dead_zone(self) -> Callable[[int], str] | None:
        """Seed 003's dead zone on this profile: expert dies -> why excluded ('' if not)."""
        hw = platform(self.profile)
        model = moe_shape(SHAPE)
        try:
            points = curve(model, hw, Scenario(tpot_s=self.slo.tpot_s), 64)
        except ValueError:  # Eq. 1 leaves no budget at this TPOT: no AFD point is feasible
            return None
        zone = set(dead_zone(points))
        if not zone:
            return None
        per_node = hw.ranks_per_node

        def why(expert_dies: int) -> str:
            nodes = -(-expert_dies // per_node)
            if nodes in zone:
                return (
                    f"seed 003's dead zone: {nodes} FFN nodes of {per_node} on "
                    f"{self.profile}: the scale-out link caps the tokens, more FFN nodes "
                    "do not raise HFU"
                )
            return ""

        return why

    def _transfer(self, kv_int8: bool):
        if kv_int8 not in self._transfers:
            self._transfers[kv_int8] = transfer_s(self.w.prompt_len, self.profile, kv_int8=kv_int8)
        return self._transfers[kv_int8]

    def _prefill_ends(self, c: Candidate) -> np.ndarray:
        """Each request's prefill end on c's prefill TEs (with c's MTP modules); decode does not
        change it, so one replay serves every candidate with the same prefill TEs, MTP depth and
        rule."""
        rule = self.prefill_rule(c)
        key = (c.num_prefill_tes, c.prefill_te_dies, c.prefill_tp, c.mtp_depth, rule)
        if key not in self._prefills:
            self._prefills[key] = prefill_batches(
                self.w.arrival_s,
                self.w.prompt_len,
                num_tes=c.num_prefill_tes,
                groups_per_te=c.prefill_te_dies // c.prefill_tp,
                rule=rule,
                pass_cost=prefill_pass(
                    c.prefill_te_dies,
                    c.prefill_tp,
                    self.profile,
                    c.mtp_depth,
                    prefill_skew(self.model, c.prefill_te_dies),
                ),
            )
        return self._prefills[key]

    def price(self, c: Candidate, tokens_per_step=None) -> tuple[Served, Outcome]:
        """tokens_per_step: [n] each request's own (a verification's measured acceptance);
        None: 1 + MTP depth x the planner's acceptance for all."""
        step = step_table(c.decode_sets(), self.profile, c.mtp_depth, self.accept, self.base)
        w = self.w
        groups = _decode_groups(c)
        common = dict(
            arrival_s=w.arrival_s,
            prompt_len=w.prompt_len,
            output_len=w.output_len,
            num_groups=groups,
            max_batch=c.max_batch,
            step=step,
            tokens_per_step=step.tokens_per_step if tokens_per_step is None else tokens_per_step,
            balance=Balance(block_tokens=self.block_tokens, mtp_depth=c.mtp_depth),
        )
        chips = c.chips(self.dies_per_chip)
        if self.decode_only:
            served = serve(**common, prefill_end_s=w.arrival_s)
            chips = c.decode_dies / self.dies_per_chip
        elif c.prefill_dies:
            moves = self._transfer(c.kv_int8)
            served = serve(**common, prefill_end_s=self._prefill_ends(c), transfer_s=moves)
        else:
            skew = prefill_skew(self.model, c.decode_dies)
            pre = prefill_curve(c.decode_dies, 1, self.profile, self.max_prompt, skew)
            served = serve(**common, chunk_tokens=self.chunk_tokens, chunk_cost=pre.chunk)
        return served, outcome(
            served, output_len=w.output_len, duration_s=w.duration_s, chips=chips, slo=self.slo
        )

    def search(
        self,
        chips: float,
        kinds: tuple[str, ...],
        opts: Options | None = None,
        progress: Callable[[str], None] = lambda line: None,
    ) -> SearchResult:
        started = time.monotonic()
        e = self.enumerate(chips, kinds, opts or Options())
        progress(
            f"plan: {len(e.kept)} deployments fit in {e.num_dies} dies, "
            f"{len(e.excluded)} excluded; pricing each on the window's "
            f"{self.w.num_requests} arrivals"
        )
        priced, last = [], time.monotonic()
        for n, c in enumerate(e.kept, start=1):
            priced.append(Priced(candidate=c, outcome=self.price(c)[1]))
            if time.monotonic() - last > 5:
                last = time.monotonic()
                elapsed = last - started
                progress(
                    f"plan: {n}/{len(e.kept)} priced, {elapsed:.0f} s elapsed, ETA "
                    f"{elapsed / n * (len(e.kept) - n):.0f} s"
                )
        ranked = sorted(
            priced, key=lambda p: (-p.outcome.goodput_per_chip, -p.outcome.tokens_per_s_per_chip)
        )
        points = [
            (p.outcome.tokens_per_s_per_chip, p.outcome.tpot_p99_s, p.outcome.ttft_p99_s)
            for p in ranked
        ]
        frontier = sorted(
            (ranked[i] for i in pareto(points)), key=lambda p: -p.outcome.tokens_per_s_per_chip
        )
        return SearchResult(
            ranked=ranked,
            frontier=frontier,
            excluded=e.excluded,
            num_dies=e.num_dies,
            wall_s=time.monotonic() - started,
        )


def _decode_groups(c: Candidate) -> int:
    """DP groups that decode: every colocated die; afd's attention dies."""
    if c.kind != "afd":
        return c.decode_dies
    get = dict(s.split("=", 1) for s in c.sets)
    return int(get["deployment.num_dp_domains"]) * int(get["deployment.dp_groups_per_domain"])
