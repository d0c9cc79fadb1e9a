"""What attention and expert dies of a disaggregated MoE-attention deployment share: the window
with its A2E/E2A buffer, the model, the call plan, and the per-iteration agreement.

On the virtual clock (run.clock virtual, docs/virtual_time.md#afd) the agreement also carries
every die's clock and horizon (ranks/core/virtual_time.py `AgreedClock`): every die, attention
and expert, computes from the same rows the same common start (the latest clock) and horizon
(the earliest, an attention die's: an expert die brings inf), and the dies run an iteration only
when it starts before that horizon, each at that start; a busy round that may not start is no
iteration for any die (parked)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ranks.core.context import RankContext
from ranks.core.decode_die import DecodeDieLoop
from ranks.core.die_parts import make_pricer
from ranks.faults.dead import dead_die
from ranks.faults.stuck import stall
from ranks.recovery import scale_down
from ranks.recovery.memory import afd_memory_check
from ranks.recovery.recompute import Recomputer, Recoverable
from ranks.recovery.watch import DieHealth, is_watched, watch_comm, watcher
from xccl.agreement import IdleBackoff
from xccl.gmem import DieMemory
from xccl.vclock import VirtualClock
from xds_mpi.eplb.placement import from_topology
from xds_mpi.eplb.ring import ring_placement
from xds_mpi.execution.slots import ExpertSlots
from xds_mpi.model.weights import build_model
from xds_mpi.report import trace

if TYPE_CHECKING:
    from ranks.core.virtual_time import AgreedClock
    from xccl.afd.buffer import AfdBuffer
    from xds_mpi.afd.plan import AfdPlan


def expert_placement(cfg, topo):
    """The expert dies' slots as placed for every MoE layer (one row): the topology's, or with
    health.replicas "ring" each expert die's redundant slots holding the next one's experts
    (xds_mpi/eplb/ring.py), so that an expert die can be lost (ranks/recovery/scale_down.py)."""
    place = ring_placement if cfg.health.replicas == "ring" else from_topology
    return place(topo, 1)


class AfdDieBase(DecodeDieLoop):
    vtime: AgreedClock | None = None  # run.clock virtual: the die's clock in the agreement

    def __init__(self, ctx: RankContext) -> None:
        cfg, topo = ctx.cfg, ctx.topo
        self.ctx, self.cfg, self.topo, self.world = ctx, cfg, topo, ctx.comm
        self.mem = DieMemory(ctx.comm, ctx.plan.window_bytes[ctx.comm.rank])
        self.dies = ctx.comm.Split(1, ctx.comm.rank)  # the dies only (the shell: color 0)
        self.model = build_model(cfg.model, unpacked_under=cfg.run.output_dir)
        self.slots = ExpertSlots.from_topology(topo)
        self.placement = expert_placement(cfg, topo)  # who hosts which expert, every layer alike
        self.clock = VirtualClock()
        self.afd = self._afd_buffer()
        self.plan = self._call_plan()
        self.pricer = make_pricer(
            cfg, self.clock, self.slots, rank=ctx.comm.rank, afd_topo=ctx.topo
        )
        # §6.1: heartbeats answered from the loop (ranks/core/decode_die.py); the abort words
        # then span the watcher too (the TE-shell, in PD the decode TE-shell), which fences the
        # waits through them.
        self.iteration = 0  # busy iterations completed, the same on every die
        self.idle = IdleBackoff()  # between agreement rounds while no domain has work
        self.health = None
        if is_watched(cfg, ctx.plan):
            self.health = DieHealth(cfg, ctx.comm, shell=watcher(ctx.plan))
        # Fault injection (ranks/faults/), only on a die a dead row names: None elsewhere
        self.dead = dead_die(cfg, ctx.comm.rank, self.health, self.clock)
        self.recompute = Recomputer(
            cfg,
            self.dies,
            ctx.comm.rank,
            [self.afd],
            self.pricer,
            events=self.plan,
            log=ctx.log,
            window_comm=watch_comm(ctx) if self.health else None,
            stall=stall(cfg, ctx.comm, self, self.health),  # None but on a stuck row's die
        )
        self.is_scaled = self.is_lost = False  # rebuilt without lost dies; lost itself
        self.memory = afd_memory_check(ctx)  # §6.2 stage 3: None without a memory row for the die

    def _afd_buffer(self) -> AfdBuffer:
        """The A2E/E2A buffer in this die's window, at the plan's layout and row dtype."""
        # Lazy import: PD colocated decode dies import this module, never build it (docs/scale.md).
        from xccl.afd.buffer import AfdBuffer

        plan, xccl = self.ctx.plan, self.cfg.xccl
        return AfdBuffer(
            self.mem,
            plan.afd,
            self.slots.slot_owner,
            num_routed_slots=self.slots.num_routed_slots,
            dtype=plan.row_dtype,
            clock=self.clock,
            num_cores=xccl.num_cores,
            timeout_s=xccl.poll_timeout_s,
            wait_log=trace.wait_log(),  # None while tracing is off
        )

    def _call_plan(self) -> AfdPlan:
        """Which A2E/E2A calls an iteration makes: one per MoE layer (the MTP blocks' included),
        DP domain and microbatch."""
        # Lazy import: PD colocated decode dies import this module, never build it (docs/scale.md).
        from xds_mpi.afd.plan import AfdPlan

        depth, num_layers = self.cfg.scheduler.mtp_depth, len(self.model.layers)
        moe_layers = tuple(i for i, layer in enumerate(self.model.layers) if layer.is_moe)
        moe_layers += tuple(range(num_layers, num_layers + depth))  # MTP blocks are MoE too
        return AfdPlan(
            moe_layers=moe_layers,
            num_domains=self.topo.num_dp_domains,
            num_microbatches=self.cfg.deployment.num_microbatches,
        )

    def held_bound_s(self) -> float:
        """How long a die may wait for the TE-shell's next grant on the virtual clock: an XCCL
        wait, and a failover's detection, fence and rebuild (as a colocated die's)."""
        # Lazy import, on the virtual clock only (as ranks/colocated/die.py's).
        from xds_mpi.plan.failures.loss import release_bound_s

        return self.cfg.xccl.poll_timeout_s + release_bound_s(self.cfg.health)

    def run_iteration(self, busy: tuple[int, ...], *, state: Sequence[Recoverable] = ()):
        """This die's part of the iteration (`attempt`), re-executed after a fault as a colocated
        die's (ranks/colocated/die.py `iteration`): `state` back to the iteration's start, then
        the calls planned afresh, with new call numbers and the same events."""
        iteration, recompute = self.iteration, self.recompute
        with recompute.checkpoint(iteration, state):
            while True:
                try:
                    result = self.attempt(busy, self.plan.iteration(busy, iteration))
                except recompute.failures as exc:  # () without faults configured
                    recompute.fail(exc)  # the abort word, the vote, the die restored
                    continue
                if not recompute.is_voting or recompute.vote():  # every die completed it
                    break
        self.iteration += 1  # not before: a fence's Released leaves the iteration to redo
        if self.dead is not None:  # a dead row of this die (ranks/faults/dead.py)
            self.dead = self.dead.after(self.iteration)
        return result

    @property
    def busy_iterations(self) -> int:
        """Busy iterations completed, the same count on every die (idle domains included)."""
        return self.iteration

    @property
    def iteration_start_s(self) -> float:
        """The running iteration's virtual start (a stuck row's at_s, and its stall priced on
        the clock: ranks/faults/stuck.py); -1 on the wall clock."""
        return self.vtime.start_s if self.vtime is not None else -1.0

    def falls_silent(self) -> bool:
        """At the iteration's virtual start (after `vtime.begin`): an at_s dead row of this die
        (ranks/faults/dead.py) at or before it silences the die instead of running it (True),
        as a colocated die's; its peers wait for it in the iteration's first A2E or E2A."""
        if self.dead is None or not self.dead.at_start(self.vtime.start_s, self.iteration):
            return False
        self.dead = None
        return True

    def rebuild(self, failover: scale_down.Failover) -> None:
        """Go on without `failover.lost` (ranks/recovery/scale_down.py, die steps 1-4)."""
        self.recompute.restore_interrupted()  # Step 1
        self.dies = scale_down.survivors(self.dies, self.world, failover.lost)  # Step 2
        afd = self.afd.rebuilt(self.dies)  # the lost attention dies as -1
        self.recompute.regroup(self.dies, [afd])  # the vote moves with the buffer
        self.afd = afd
        self.placement, routing = scale_down.rerouted(self, failover.lost)  # Step 3
        self.install(afd, routing)
        self.plan.renumber(self.dies.allreduce(self.plan.num_calls, op=MPI.MAX))
        # No vote ends an iteration here: a die whose part of it was done (an idle domain's,
        # one whose last E2A came back, an expert die that sent its last E2A') has counted it
        # and waits in the next agreement, while the fence undid it on the others (Step 1).
        # Every survivor takes the highest count, as for the calls, so that all of them number
        # the events of the next iteration alike (the undone work runs again under it).
        agreed = self.dies.allreduce(self.iteration, op=MPI.MAX)
        self.skip_iterations(agreed - self.iteration)
        self.iteration = agreed
        self.is_scaled = True
        fault_s = self._priced_failover()  # virtual clock: past the failover (-1 on the wall)
        shell = self.health.shell  # the watcher: the TE-shell, in PD the decode TE-shell
        scale_down.send_ready(self.world, shell, self.num_batches_sent(), fault_s)  # Step 4

    def _priced_failover(self) -> float:
        """run.clock virtual: this die's clock moved past the failover's priced cost, as a
        colocated die's (ranks/core/virtual_time.py AgreedClock.failed_over: an attention die
        parks there, an expert die meets it in the next agreement); the clock before, seconds
        (-1: the wall clock)."""
        if self.vtime is None:
            return -1.0
        # Lazy import, on the virtual clock only (as ranks/colocated/die.py's).
        from xds_mpi.plan.failures.loss import FailoverCost

        return self.vtime.failed_over(FailoverCost.of(self.cfg.health).total_s)

    def skip_iterations(self, num: int) -> None:
        """`num` iteration numbers this die takes no part in (a failover's, `rebuild`)."""

    def install(self, afd: AfdBuffer, routing: scale_down.Routing) -> None:
        """The rebuilt A2E/E2A buffer and routing, after a failover."""
        raise NotImplementedError

    def use_placement(self, placement) -> None:
        """Who hosts which expert from now on (a masked slot, ranks/recovery/memory.py)."""
        self.placement = placement

    def num_batches_sent(self) -> int:
        """Token batches this die has sent the TE-shell (an expert die sends none)."""
        return 0

    def xccl_buffer(self):
        return self.afd

    def attempt(self, busy: tuple[int, ...], planned: list):
        """This die's part of the iteration over its `planned` calls (AfdPlan.iteration)."""
        raise NotImplementedError

    def agree(self, num_active: int, is_running: bool) -> tuple[tuple[int, ...], bool]:
        """(the DP domains with work this iteration, has every attention die been told to stop)
        — one-sided, over the dies' windows (xccl/agreement.py), no MPI collective in the die
        loop (§4.2); expert dies bring zeros. Idle rounds back off (self.idle). On the virtual
        clock, no domain when the dies may not start the iteration before the horizon (parked:
        no back-off, the attention dies wait for their grant out of the agreement)."""
        vtime = self.vtime
        # word 1: running (bit 0) and, on the virtual clock, the newest grant taken (the rest)
        grant = vtime.seq if vtime is not None else 0
        mine = (num_active, (grant << 1) | (1 if is_running else 0))
        clock_words = vtime.words() if vtime is not None else ()
        interrupt, timeout_s = self.agreement_wait()
        afd = self.afd
        rows = afd.agreement.agree((*mine, *clock_words), interrupt=interrupt, timeout_s=timeout_s)
        domains = afd.layout.member_domains  # expert dies bring 0 requests
        busy = sorted({domains[i] for i in np.flatnonzero(rows[:, 0])})
        all_stopped = not (rows[:, 1] & 1).any()
        if vtime is not None:
            takes_grants = np.asarray(domains) >= 0  # the attention dies (experts take none)
            vtime.agreed(rows[:, 2:4], grants=rows[takes_grants, 1] >> 1)
            if busy and not vtime.may_run():  # parked at the horizon
                return (), all_stopped
        if busy:
            self.idle.busy()
        elif not all_stopped:  # every die leaves now, without an idle round's sleep first
            self.idle.idle()
        return tuple(busy), all_stopped

    def agreement_wait(self):
        """(interrupt, timeout_s) the agreement waits with: the fence (decode_die.py)."""
        return self.agreement_fence()  # a lost die never writes
