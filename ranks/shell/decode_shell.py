"""The decode TE-shell of a PD deployment (xDeepServe §5.1 step 5, §4.3), host rank 1.

The JE hands it every PD-transfer task (with one decode TE, the JE's choice of decode TE by load
is that one); it picks the decode DP group with §4.3's balancer by load (lowest reserved KV,
then fewest requests; the group itself defers while its KV is full, step 6) and forwards the
task there. It sees only what balancing needs: the tasks and each group's completions (request
ids, TAG_PD_DONE); tokens go from the groups straight to the JE (the output shortcut).
With a stuck/dead row on a decode die it also watches its dies with heartbeats, fences them and
fails over on a loss (ranks/recovery/decode_loss.py).
"""

from __future__ import annotations

import time

from mpi4py import MPI

from ranks.core.context import RankContext
from ranks.core.control import WaitTimeout, wait_all
from ranks.core.handshake import handshake
from ranks.core.messages import JE, TAG_STOP
from ranks.core.ready import report_ready
from ranks.pd.messages import TAG_PD_DONE, TAG_PD_TASK
from ranks.recovery.decode_loss import DecodeWatch
from xccl.gmem import DieMemory
from xds_mpi.pd.failover import Routed, pick_decode


def run(ctx: RankContext) -> None:
    handshake(ctx)
    mem = DieMemory(ctx.comm, 0)  # joins the window collective, holds no die memory
    alone = ctx.comm.Split(0, ctx.comm.rank)
    shell = DecodeShell(ctx)
    report_ready(ctx.comm)
    shell.serve()
    if not shell.watch.has_failed_over:  # collective over every rank: not after a failover
        mem.free()
    alone.Free()


class DecodeShell:
    def __init__(self, ctx: RankContext) -> None:
        # Lazy import, PD only (docs/scale.md).
        from ranks.shell.je import LoadBalancer

        sched = ctx.cfg.scheduler
        self.ctx, self.comm = ctx, ctx.comm
        self.balancer = LoadBalancer(
            ctx.plan.pd.decode,
            max_batch=1 << 40,
            kv_capacity_tokens=1 << 40,
            block_tokens=sched.kv_block_tokens,
            mtp_depth=sched.mtp_depth,
        )
        self.sends: list[MPI.Request] = []
        self.num_tasks = 0
        self.watch = DecodeWatch(self)  # §6.1 heartbeats over the decode dies (PD decode loss)
        self.virtual = None  # run.clock virtual: the decode dies' pacer (ranks/shell/pd_pacers.py)
        if ctx.plan.cluster is not None:  # a PD pair in a cluster (ranks/cluster/pd_side.py)
            from ranks.cluster.pd_side import PairDecodePacer

            self.virtual = PairDecodePacer(self)
        elif ctx.plan.clock.is_virtual:
            from ranks.shell.pd_pacers import DecodePacer

            self.virtual = DecodePacer(self)

    def serve(self) -> None:
        """Route tasks and take completions until the JE says stop."""
        started, deadline = time.time(), time.monotonic() + self.ctx.cfg.run.timeout_s
        while (stop := self.comm.improbe(source=JE, tag=TAG_STOP)) is None:
            did = self.virtual.turn() if self.virtual else self._route() + self._take_completions()
            if not did:
                time.sleep(0.0005)
            self.watch.poll(started)
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"decode TE-shell: no stop from the JE after run.timeout_s"
                    f"({self.ctx.cfg.run.timeout_s:g}); {self.num_tasks} tasks routed"
                )
        stop.recv()
        self.watch.close()  # watched: the JE stopped us first; the dies have closed after it
        if self.virtual is not None:  # the dies' reports for the last grant
            self.virtual.finish(self.ctx.cfg.xccl.poll_timeout_s)
            self.num_tasks = self.virtual.num_tasks
        self._take_completions()
        # The tasks routed to the decode dies, which took them all before the JE's stop came.
        wait_all(
            self.sends,
            timeout_s=self.ctx.cfg.xccl.poll_timeout_s,
            me="decode TE-shell",
            event="tasks to the decode dies",
        )

    def _route(self) -> int:
        num = 0
        while (msg := self.comm.improbe(source=JE, tag=TAG_PD_TASK)) is not None:
            routed: Routed = msg.recv()
            task = routed.task
            # routed before (its pair went down, or its prefill TE was lost and it was
            # prefilled again, §6.1-6.2): the old die's load goes back first
            self.balancer.on_complete(task.req.req_id)
            group = pick_decode(self.balancer, task.req, routed.hard, routed.soft)
            self.balancer.on_dispatch(group, task.req)
            self.sends.append(self.comm.isend(task, dest=group, tag=TAG_PD_TASK))
            num += 1
        self.num_tasks += num
        return num

    def _take_completions(self) -> int:
        num = 0
        while (msg := self.comm.improbe(source=MPI.ANY_SOURCE, tag=TAG_PD_DONE)) is not None:
            for req_id, _ in msg.recv():  # (req_id, the die's virtual clock then)
                self.balancer.on_complete(req_id)
            num += 1
        return num
