"""What every decode die builds alike (colocated and attention dies): its KV block table, latent
cache and scheduler, and its pricer on the virtual clock."""

from __future__ import annotations

from dataclasses import dataclass

from ranks.core.die_io import DieTotals
from xds_mpi.config.hardware import load_profile
from xds_mpi.config.schema import Config
from xds_mpi.execution.pricing import Pricer
from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.model.mla import LatentCache
from xds_mpi.model.shapes import cost_shape
from xds_mpi.model.tokenizer import EOS_ID
from xds_mpi.projection.cost import CostModel, Hardware
from xds_mpi.report import trace
from xds_mpi.scheduling.scheduler import DieScheduler


@dataclass(frozen=True, kw_only=True)
class DecodeState:
    """A decode die's own memory and policy: table (KV blocks of its requests), cache (their
    latent KV per layer, MTP layers included), scheduler (continuous batching over them)."""

    table: object
    cache: object
    scheduler: object


def decode_state(cfg: Config, model, scheduler_class=None) -> DecodeState:
    """scheduler_class: DieScheduler or a subclass (the prefill dies' PrefillScheduler)."""
    sched = cfg.scheduler
    table = BlockTable(num_blocks=sched.num_kv_blocks_per_die, block_tokens=sched.kv_block_tokens)
    cache = LatentCache(
        num_layers=model.num_cache_layers(sched.mtp_depth),
        num_slots=sched.num_kv_blocks_per_die * sched.kv_block_tokens,
        kv_lora_rank=cfg.model.kv_lora_rank,
        rope_dim=cfg.model.qk_rope_dim,
        dtype=model.dtype,
        latent_int8=sched.kv_int8,
    )
    scheduler = (scheduler_class or DieScheduler)(
        table=table,
        max_batch=sched.max_batch_per_die,
        max_tokens=cfg.xccl.max_tokens_per_die,
        prefill_chunk=sched.prefill_chunk_tokens,
        eos_id=EOS_ID,
        ignore_eos=cfg.workload.ignore_eos,
        mtp_depth=sched.mtp_depth,
    )
    return DecodeState(table=table, cache=cache, scheduler=scheduler)


def make_pricer(cfg: Config, clock, slots, *, rank: int = -1, afd_topo=None, profile: str = ""):
    """The die's pricer: the cost model at the target shape on the configured hardware profile,
    advancing `clock` (which the die's trace reads too); routed experts spread over the dies
    that host routed slots. The attention and expert dies of an afd deployment (`rank`: this
    die, `afd_topo`: the plan's topology) also price A2E/E2A (xds_mpi/afd/pricing.py);
    colocated and prefill dies (no afd_topo) price dispatch/combine. profile: this die's hardware
    profile when it is not hardware.profile (a 910B prefill die: pd.prefill_profile)."""
    hardware = Hardware.from_profile(load_profile(profile or cfg.hardware.profile))
    cost = CostModel(cost_shape(), hardware, kv_int8=cfg.scheduler.kv_int8)
    trace.set_clock(clock)
    args = dict(use_int8=cfg.xccl.use_int8, num_routed_dies=len(slots.routed_dies))
    if afd_topo is None:
        return Pricer(cost, cfg.model, clock, **args)
    # Lazy import, afd dies only: a start-up cost of every colocated die otherwise (docs/scale.md).
    from xds_mpi.afd.pricing import AfdPricer
    from xds_mpi.projection.layers import AfdHops, counts

    hops = AfdHops.of(cfg, counts(cfg, afd_topo))
    here = slots.slot_owner[: slots.num_routed_slots].count(rank)
    return AfdPricer(cost, cfg.model, clock, hops=hops, num_routed_slots_here=here, **args)


def decode_totals(executor, pricer, recompute, scheduler) -> DieTotals:
    """A decode die's totals for its report (collective: the fault count sums over the dies)."""
    return DieTotals(
        num_iterations=executor.num_iterations,
        virtual_spent=pricer.snapshot(),
        recovery=recompute.report(),
        cancelled={
            "requests": scheduler.num_cancelled,
            "kv_blocks_freed": scheduler.num_cancelled_blocks,
        },
    )
