"""Each request's TTFT and TPOT on the projected clock, at the lengths it is priced at (a trace
replay's own lengths, else the served ones), with the same `Pricer` the dies run.

The dies' virtual clocks price what they served; a trace replay serves prompts scaled down by
`trace.length_scale`, so their clocks say what a 48-token prompt would take on the pod, not the
trace's 12,000-token one. Here every served request is priced alone at its priced lengths:

    TTFT = prefill(prompt) + KV transfer(prompt) [PD only] + one decode step
    TPOT = one decode step at the run's mean decode batch per die, at the request's mean KV
           length (prompt + half its output)

The prefill is one pass over the whole prompt on a prefill die (a colocated die without PD),
every die of its EP group prefilling as much (so a die receives as many routed rows as it
sends); its attention is causal at the grain of `CAUSAL_CHUNK_TOKENS` (chunk i's rows read the
KV of chunks 0..i), in the absorbed form the dies' cost model prices. Queueing is not in it
(the served run's queueing, at scaled lengths, says nothing about the pod's). MTP is not
priced here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xccl.vclock import LinkModel, VirtualClock
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.execution.pricing import Pricer
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.kv_memory import projected_kv_bytes
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.workload.requests import Request

CAUSAL_CHUNK_TOKENS = 512  # a prompt's rows see the KV up to the end of their chunk


@dataclass(frozen=True, kw_only=True)
class Plane:
    """How a die pulls cached KV from the pool: bytes per second and the latency of one pull."""

    name: str
    bytes_per_s: float
    latency_s: float

    def pull_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes else 0.0


def planes(profile: dict) -> dict[str, Plane]:
    """The UB and VPC planes of a hardware profile (configs/hardware/<name>.yaml); the VPC
    bandwidth is a die's share of its node's NIC (`scale_out.vpc_gb_per_s`, the same figure
    a heterogeneous PD pair's KV crosses: xds_mpi/plan/kv_link.py)."""
    ub, out = profile["ub"], profile.get("scale_out", {})
    if "vpc_gb_per_s" not in out:
        raise ConfigError("the hardware profile's 'scale_out' section has no vpc_gb_per_s")
    return {
        "UB": Plane(
            name="UB",
            bytes_per_s=ub["read_gb_per_s_inter"] * 1e9,
            latency_s=ub["read_latency_us_inter"] * 1e-6,
        ),
        "VPC": Plane(name="VPC", bytes_per_s=out["vpc_gb_per_s"] * 1e9, latency_s=0.0),
    }


@dataclass(frozen=True, kw_only=True)
class PricedRequest:
    """Projected seconds of one request: pulling its cached prefix from the KV pool (0 without
    one), prefill, KV transfer (0 without PD), one decode step (the first token's and every later
    one's), and the TTFT and TPOT they make."""

    prefill_s: float
    transfer_s: float
    step_s: float
    pull_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.pull_s + self.prefill_s + self.transfer_s + self.step_s

    @property
    def tpot_s(self) -> float:
        return self.step_s


class RequestPricer:
    """Prices requests at the cost shape on the configured hardware profile.

    num_prefill_dies: the EP group a prompt's prefill pass runs on (the prefill TE; the decode
    dies without PD); num_decode_dies: the decode EP group; batch_per_die: the decode batch a
    step is priced at (the run's mean)."""

    def __init__(
        self,
        cfg: Config,
        *,
        num_prefill_dies: int,
        num_decode_dies: int,
        batch_per_die: float,
        is_pd: bool,
    ) -> None:
        profile = self.profile = load_profile(cfg.hardware.profile)
        self.cost = CostModel(cost_shape(), Hardware.from_profile(profile))
        self.cfg, self.tiny = cfg, cfg.model
        self.num_prefill_dies, self.num_decode_dies = num_prefill_dies, num_decode_dies
        self.batch = max(1, round(batch_per_die))
        self.link = LinkModel.from_profile(profile) if is_pd else None

    def price(self, req: Request, num_cached: int = 0, pool: Plane | None = None) -> PricedRequest:
        """num_cached: leading prompt tokens whose KV is pulled from a pool over `pool` (the
        plane) instead of computed."""
        prompt, output = req.priced_prompt_len, req.priced_output_len
        tp = self.cfg.deployment.prefill_tp if self.link is not None else 1
        prefill = self.pass_s(
            causal_chunks(prompt, num_cached), self.num_prefill_dies, sampled=1, tp=tp
        )
        pull = pool.pull_s(projected_kv_bytes(num_cached, self.cost.m)) if pool else 0.0
        mean_kv = prompt + output // 2
        step = self.pass_s([(mean_kv, 1)] * self.batch, self.num_decode_dies, sampled=self.batch)
        transfer = 0.0
        if self.link is not None:  # the prompt's latent cache over UB, to another server
            nbytes = projected_kv_bytes(prompt, self.cost.m)
            transfer = self.link.transfer_ns(nbytes, num_cores=self.cfg.xccl.num_cores) / 1e9
        return PricedRequest(prefill_s=prefill, transfer_s=transfer, step_s=step, pull_s=pull)

    def die_pricer(self, num_dies: int, tp: int = 1) -> Pricer:
        """A die's pricer on a fresh clock, in an EP group of `num_dies` (tp > 1: a prefill TP
        group's, xds_mpi/execution/prefill_tp.py)."""
        clock = VirtualClock()
        args = dict(num_routed_dies=num_dies, use_int8=self.cfg.xccl.use_int8)
        if tp > 1:
            # start-up: a TP group's pricer and gather only where prefill TP runs (docs/design.md)
            from xds_mpi.execution.prefill_tp import TpPricer

            link = LinkModel.from_profile(self.profile)
            return TpPricer(self.cost, self.tiny, clock, tp=tp, link=link, same_server=True,
                            **args)  # fmt: skip
        return Pricer(self.cost, self.tiny, clock, **args)

    def pass_s(
        self,
        seqs: list[tuple[int, int]],
        num_dies: int,
        *,
        sampled: int,
        tp: int = 1,
        skew: Sequence[float] | None = None,
    ) -> float:
        """Virtual seconds of one forward pass over `seqs` ((KV length, new rows) per sequence)
        on a die of an EP group of `num_dies`, layer by layer as the executor prices it. tp: the
        dies of a prefill TP group (xds_mpi/execution/prefill_tp.py): MLA by stages over its share
        of the rows and its heads, the MoE over its share, and the exchanges. skew: the routed
        rows the die receives at MoE layer i, x its own rows x top-k (None: 1, the rows spread
        evenly; the planner's hottest die, xds_mpi/planning/prefill_cost.py)."""
        pricer = self.die_pricer(num_dies, tp)
        share = -(-sum(n for _, n in seqs) // tp)  # the largest share of the rows (all at TP1)
        for layer_idx in range(self.tiny.num_layers):
            is_moe = layer_idx >= self.tiny.num_dense_layers
            if tp > 1:
                pricer.mla_layer(seqs, share, is_moe=is_moe)
            else:
                pricer.attention_rows(seqs, is_moe=is_moe)
            if not is_moe:
                pricer.dense_ffn(share)
                continue
            spread = skew[layer_idx - self.tiny.num_dense_layers] if skew else 1.0
            rows_in = share * self.tiny.top_k * spread  # even: every die as busy as this one
            pricer.gate(share)
            pricer.dispatch(rows_in)
            pricer.experts(rows_in, share)
            pricer.combine(share)
        if tp > 1:  # the last layer's rows, once
            pricer.exchanged(pricer.rows_values(share), 0.0, is_moe=None)
        pricer.finish(sampled)
        return pricer.clock.now_ns / 1e9


def causal_chunks(num_tokens: int, num_cached: int = 0) -> list[tuple[int, int]]:
    """(KV length, new rows) per chunk of a prompt's causal attention, computing the tokens
    after its first `num_cached` (a cached prefix, whose KV is read but not computed)."""
    first = num_cached + CAUSAL_CHUNK_TOKENS
    ends = list(range(first, num_tokens, CAUSAL_CHUNK_TOKENS)) + [num_tokens]
    return [(end, end - start) for start, end in zip([num_cached, *ends], ends)]


def mean_decode_batch(die_timings: dict[int, dict[str, list]]) -> float:
    """Requests per decode die per iteration, over the iterations in which a die sampled any."""
    sampled = np.concatenate(
        [np.asarray(t["num_sampled"], float) for t in die_timings.values()] or [np.zeros(0)]
    )
    sampled = sampled[sampled > 0]
    return float(sampled.mean()) if len(sampled) else 1.0
