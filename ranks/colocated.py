"""A colocated die (xDeepServe §4.1-4.3, Figure 10): one DP group (TP=1) that also hosts expert
slots. Each iteration every die runs attention on its own requests and meets all the others at
every MoE layer's dispatch and combine, even with nothing to send."""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ranks.context import RankContext
from ranks.die_io import DieTotals, Inbox, Outbox, serve
from ranks.handshake import handshake
from ranks.recompute import Recomputer
from xds_mpi.engine.scheduler import DieScheduler


def run(ctx: RankContext) -> None:
    handshake(ctx)
    serve(ColocatedDie(ctx))


class ColocatedDie:
    def __init__(self, ctx: RankContext) -> None:
        import torch  # only now: the handshake does not wait for every die's torch import
        from xccl.ep import EpBuffer
        from xccl.vclock import VirtualClock
        from xds_mpi.cost import CostModel, Hardware
        from xds_mpi.engine.executor import ColocatedExecutor
        from xds_mpi.engine.pricing import Pricer
        from xds_mpi.engine.slots import ExpertSlots
        from xds_mpi.hardware import load_profile
        from xds_mpi.model.shapes import cost_shape
        from xccl.gmem import DieMemory
        from xds_mpi.model.kv_blocks import BlockTable
        from xds_mpi.model.mla import LatentCache
        from xds_mpi.model.tokenizer import EOS_ID
        from xds_mpi.model.weights import build_model
        cfg, topo = ctx.cfg, ctx.topo
        torch.set_num_threads(1)  # ranks share the cores
        self.mem = DieMemory(ctx.comm, ctx.plan.window_bytes[ctx.comm.rank])
        self.dies = ctx.comm.Split(1, ctx.comm.rank)      # the dies only (the shell: color 0)
        model = build_model(cfg.model)
        sched = cfg.scheduler
        table = BlockTable(num_blocks=sched.num_kv_blocks_per_die,
                           block_tokens=sched.kv_block_tokens)
        depth = sched.mtp_depth
        cache = LatentCache(num_layers=model.num_cache_layers(depth),
                            num_slots=sched.num_kv_blocks_per_die * sched.kv_block_tokens,
                            kv_lora_rank=cfg.model.kv_lora_rank, rope_dim=cfg.model.qk_rope_dim,
                            dtype=model.dtype)
        slots = ExpertSlots.from_topology(topo)
        is_dedicated = cfg.deployment.shared_experts == "dedicated"
        clock = VirtualClock()
        ep = EpBuffer(self.mem, ctx.plan.ep, slots.slot_owner, dtype=ctx.plan.row_dtype,
                      clock=clock,
                      num_cores=cfg.xccl.num_cores, timeout_s=cfg.xccl.poll_timeout_s)
        cost = CostModel(cost_shape(), Hardware.from_profile(load_profile(cfg.hardware.profile)))
        self.pricer = Pricer(cost, cfg.model, clock, use_int8=cfg.xccl.use_int8,
                             num_routed_dies=len(set(slots.slot_owner[:slots.num_routed_slots])))
        self.scheduler = DieScheduler(table=table, max_batch=sched.max_batch_per_die,
                                      max_tokens=cfg.xccl.max_tokens_per_die,
                                      prefill_chunk=sched.prefill_chunk_tokens, eos_id=EOS_ID,
                                      ignore_eos=cfg.workload.ignore_eos, mtp_depth=depth)
        self.executor = ColocatedExecutor(model, ep, phy2log=topo.phy2log,
                                          log2phy=topo.log2phy(), table=table, cache=cache,
                                          pricer=self.pricer, slots=slots,
                                          shared_slots=slots.dedicated_shared_slots
                                          if is_dedicated else (), mtp_depth=depth)
        self.recompute = Recomputer(cfg, self.dies, ctx.comm.rank, [ep], self.pricer,
                                    events=self.executor.events, log=ctx.log)
        self.inbox = Inbox(ctx.comm, self.scheduler)
        self.outbox = Outbox(ctx.comm, ctx.comm.rank, timeout_s=cfg.xccl.poll_timeout_s)

    def step(self) -> bool:
        """One iteration, as Figure 10: policy (scheduler) and execution (executor) apart."""
        self.inbox.poll()                                  # requests / stop from the TE-shell
        busy, all_stopped = self.agree()                   # all dies run the same iterations
        if not busy:
            time.sleep(0.001)
            return not all_stopped
        sampled, timing = self.iteration()                 # re-executed after a transient fault
        emitted = self.scheduler.postprocess(sampled)      # finished requests free their blocks
        self.executor.commit({e.req_id for e in emitted if e.is_finished})
        self.outbox.stream(emitted, timing, self.scheduler.kv_used_tokens())  # output shortcut
        return True

    def iteration(self):
        """Schedule and run one iteration; on an injected fault anywhere, restore and again."""
        return self.recompute.run(self.executor.num_iterations, self.attempt,
                                  state=(self.scheduler, self.executor))

    def attempt(self):
        entries = self.scheduler.schedule()                # continuous batching, chunked prefill
        return self.executor.forward(entries)              # MLA, gate, dispatch, experts, combine

    def agree(self) -> tuple[bool, bool]:
        """(does any die have work, has every die been told to stop) — one allreduce."""
        mine = np.array([self.scheduler.num_active, 0 if self.inbox.is_stopped else 1])
        total = np.empty_like(mine)
        self.dies.Allreduce(mine, total, op=MPI.SUM)
        return bool(total[0]), total[1] == 0

    def totals(self) -> DieTotals:
        """The run's totals (collective: the fault count sums over the dies)."""
        return DieTotals(num_iterations=self.executor.num_iterations,
                         virtual_spent=self.pricer.snapshot(), recovery=self.recompute.report())

    def close(self) -> None:
        self.outbox.drain()
        self.recompute.free()
        self.mem.free()
        self.dies.Free()
