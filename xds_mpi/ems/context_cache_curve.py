"""The projected context-caching curve (CloudMatrix-Infer §4.4 EMS, §5.4.3 Figure 23): prefill
throughput and TTFT against the token reuse rate, the cached KV pulled from the pool over the UB
plane or the VPC plane, held against the numbers §5.4.3 publishes.

The scenario is §5.4.3's: 4K-token prompts, 16K tokens per NPU (two prompts per die), a prefill
instance of EP32 (§5.1). At reuse r a prompt's first r x 4K tokens are reused, counted in whole
EMS blocks (§4.4.2: paged blocks of 128-512 tokens; a partial block is recomputed): their latent
KV (every layer, BF16) is pulled from the pool, then one prefill pass computes the rest, reading
the whole KV (`RequestPricer.pass_s`, causal at 512-token grain). Pull and pass run one after
the other (no layer-wise overlap). The planes: UB at the NPU-NPU read bandwidth and latency of
[001] Table 1 (the pool's DRAM reached like a peer die); VPC at [001] §3.2's 400 Gbps per node
shared by the node's 16 dies, all pulling at once. Nothing here is fitted to §5.4.3.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import Config
from xds_mpi.plan.kv_memory import projected_kv_bytes
from xds_mpi.projection.paper_data import CONTEXT_CACHING
from xds_mpi.results.request_pricing import Plane, RequestPricer, causal_chunks, planes

PROMPT_TOKENS = 4096  # [001] §5.4.3: "inputs with a 4K token length"
PROMPTS_PER_DIE = 2  # [001] §5.4.3: "16K total tokens per NPU" = 2 dies x 2 x 4K
PREFILL_EP = 32  # [001] §5.1: each prefill instance employs EP32
# [001] §4.4.2: KV blocks of "128-512 tokens per block"; at these reuse rates both ends cache the
# same prefix (90 % of 4,096 = 3,686 tokens: 28 blocks of 128 or 7 of 512 = 3,584 cached).
CACHE_BLOCK_TOKENS = 128
REUSE_RATES = (0.0, 0.125, 0.25, 0.5, 0.75, 0.9)


@dataclass(frozen=True, kw_only=True)
class CachePoint:
    """One die's prefill batch at one reuse rate on one plane: seconds pulling the cached KV,
    seconds computing the rest; the batch's TTFT and the die's prefill throughput."""

    reuse: float
    plane: str
    pull_s: float
    compute_s: float

    @property
    def ttft_s(self) -> float:
        return self.pull_s + self.compute_s

    @property
    def tokens_per_s(self) -> float:
        return PROMPT_TOKENS * PROMPTS_PER_DIE / self.ttft_s


def cached_prefix(reuse: float) -> int:
    """The tokens of a prompt the pool serves at token reuse rate `reuse`: whole blocks only."""
    return round(reuse * PROMPT_TOKENS) // CACHE_BLOCK_TOKENS * CACHE_BLOCK_TOKENS


def cache_point(pricer: RequestPricer, plane: Plane, reuse: float) -> CachePoint:
    cached = cached_prefix(reuse)
    nbytes = PROMPTS_PER_DIE * projected_kv_bytes(cached, pricer.cost.m)
    seqs = causal_chunks(PROMPT_TOKENS, cached) * PROMPTS_PER_DIE
    compute = pricer.pass_s(seqs, PREFILL_EP, sampled=PROMPTS_PER_DIE)
    return CachePoint(reuse=reuse, plane=plane.name, pull_s=plane.pull_s(nbytes), compute_s=compute)


def cache_curve(cfg: Config) -> list[CachePoint]:
    """Every reuse rate on both planes (reuse 0: no context caching, nothing pulled)."""
    pricer = RequestPricer(
        cfg, num_prefill_dies=PREFILL_EP, num_decode_dies=PREFILL_EP, batch_per_die=1, is_pd=False
    )
    return [
        cache_point(pricer, plane, reuse)
        for plane in planes(load_profile(cfg.hardware.profile)).values()
        for reuse in REUSE_RATES
    ]


def validation_rows(points: list[CachePoint]) -> list[tuple[str, float, float]]:
    """(what, published, projected) for each number of [001] §5.4.3 (paper_data.py)."""
    at = {(p.plane, p.reuse): p for p in points}
    ub = {r: at[("UB", r)] for r in REUSE_RATES}
    projected = (
        ub[0.5].tokens_per_s / ub[0.125].tokens_per_s,
        ub[0.9].tokens_per_s / ub[0.0].tokens_per_s,
        1 - ub[0.5].ttft_s / ub[0.0].ttft_s,
        1 - ub[0.9].ttft_s / ub[0.0].ttft_s,
        ub[0.0].ttft_s,
        max(ub[r].tokens_per_s / at[("VPC", r)].tokens_per_s for r in REUSE_RATES),
    )
    return [
        (what, published, value) for (what, published), value in zip(CONTEXT_CACHING, projected)
    ]
