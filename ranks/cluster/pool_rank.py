"""A pool rank (`cluster.pool`, docs/cluster.md "A pool of ranks"): a world rank that belongs to
no TE at launch. It waits for the JE; at a pool TE's scale-out it

1. takes the JE's `PoolActivation` (its TE, its rank inside the TE, the TE's world ranks),
2. forms the TE's communicator with the TE-shell and the TE's other dies
   (`form_te_comm`: `Comm.Create_group`, collective over the members only),
3. builds its TE's plan exactly as a launched die of that TE does (its group's config) and
   allocates its die's weights memory (ranks/cluster/pool_window.py),
4. runs the die's program on that communicator: its XCCL windows allocated, its weights loaded
   by the TE's path (the TE-shell passes the JE's load order on, CRC-checked), serving;

and when its TE is drained the TE-shell stops the dies as at a run's end: the program frees its
windows and returns, the rank frees its weights memory and the communicator and waits again, to
be a die of any pool TE's shape next. At the job's end the JE's `PoolStop` ends the loop. Every
wait is bounded (run.timeout_s for the JE, xccl.poll_timeout_s for the TE's members), naming the
rank and event.
"""

from __future__ import annotations

import time

from mpi4py import MPI

from ranks import role_program
from ranks.cluster.messages import TAG_POOL_GROUP, TAG_POOL_RANK, PoolActivation, PoolStop
from ranks.cluster.pool_window import activate, deactivate
from ranks.core.context import RankContext
from ranks.core.control import WaitTimeout, recv_from_each, send_to_each
from ranks.core.weights_window import is_loading_role, set_weights_window, weights_window
from xccl.wake import Doze
from xds_mpi.plan.cluster import JE_RANK
from xds_mpi.plan.deployment import DeploymentPlan


def run(ctx: RankContext, base) -> int:
    """A pool rank's loop, or a pool PD pair's decode TE-shell's (its rank 1, launched: it
    waits for its pair's activations alike, and holds no weights); base: the config before any
    group's values, from which each TE's plan is built."""
    world, cfg, window = MPI.COMM_WORLD, ctx.cfg, weights_window()
    # the world's window: 0 bytes, or a slot for a pool TE forks read (ranks/cluster/pool_window.py)
    world_mem, world_bytes = window.mem, window.sizes[world.rank]
    is_pool_rank = ctx.plan.cluster.is_pool_rank(world.rank)
    me = f"pool rank {world.rank}" if is_pool_rank else f"pool PD pair's host rank {world.rank}"
    num_served = 0
    while not isinstance(message := _next(world, cfg.run.timeout_s, me), PoolStop):
        local = message.members.index(world.rank)
        ctx.log.info(
            "%s: rank %d inside TE %d (scale event %d), with world ranks %s",
            me,
            local,
            message.te,
            message.event,
            message.members,
        )
        comm = form_te_comm(world, message, cfg.xccl.poll_timeout_s)  # Step 2
        plan = DeploymentPlan.build(base, world.size, launcher_checks=False, te=message.te)
        is_die = is_loading_role(plan, local)  # not a pair's decode TE-shell
        if is_die:
            set_weights_window(activate(window, plan, message.te, local))  # Step 3
        program = role_program(plan.topo.ranks[local].role, is_pd=plan.pd is not None)
        program(RankContext(plan=plan, comm=comm, log=ctx.log, node_leader=ctx.node_leader))
        if is_die:  # Step 4 done: its windows freed, then its weights memory
            window = deactivate(weights_window(), world_mem, world_bytes)
            set_weights_window(window)
        comm.Free()
        num_served += 1
        ctx.log.info("%s: back in the pool after TE %d", me, message.te)
    ctx.log.info("%s: stopped after %d TEs", me, num_served)
    return 0


def _next(world: MPI.Comm, timeout_s: float, me: str) -> PoolActivation | PoolStop:
    """The JE's next word (bounded: the JE stops every pool rank at the job's end)."""
    deadline, doze = time.monotonic() + timeout_s, Doze()
    while (message := world.improbe(source=JE_RANK, tag=TAG_POOL_RANK)) is None:
        if time.monotonic() > deadline:
            raise WaitTimeout(
                f"{me}: no activation or stop from the JE (world rank {JE_RANK}) after "
                f"run.timeout_s({timeout_s:g})"
            )
        doze.pause()
    return message.recv()


def form_te_comm(world: MPI.Comm, activation: PoolActivation, timeout_s: float) -> MPI.Comm:
    """Collective over the TE's members only (the TE-shell first): its communicator, ranks as
    in `members`. They meet at the TE-shell first (bounded: a die still draining another TE
    comes when done), so the blocking Create_group finds every member there."""
    shell, where = activation.members[0], f"TE {activation.te} (scale event {activation.event})"
    if world.rank == shell:
        recv_from_each(
            world,
            activation.members[1:],
            tag=TAG_POOL_GROUP,
            timeout_s=timeout_s,
            me=f"TE-shell of {where}",
            event="pool ranks at the TE's forming",
        )
    else:
        send_to_each(
            world,
            {shell: world.rank},
            tag=TAG_POOL_GROUP,
            timeout_s=timeout_s,
            me=f"pool rank {world.rank} of {where}",
            event="at the TE's forming",
        )
    group = world.Get_group().Incl(list(activation.members))
    comm = world.Create_group(group, tag=TAG_POOL_GROUP)
    group.Free()
    return comm
