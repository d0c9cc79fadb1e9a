"""Per-rank entry point: `python -m mpi4py -m launch.job.rank CONFIG [--set SECTION.KEY=VALUE ...]
[--resolved FILE]` (FILE: the launcher's copy of CONFIG and its --set values as JSON).

Every rank loads the config, builds the deployment plan for the communicator's size (the checks
of `xds-mpi validate` but the checkpoint's and the workload's, which the launcher made), and runs
the program ranks/ registers for its role. In a cluster (`cluster.num_tes` > 1,
xds_mpi/plan/cluster.py) world rank 0 is the JE and every TE runs on a communicator of its own,
split from the world, as if it were the world (its ranks 0..S-1, TE-shell 0); the JE and the
TE-shells share a second one, the link (ranks/cluster/link.py). With `cluster.pool` the pool
ranks join no TE at launch (ranks/cluster/pool_rank.py), and a pool TE's TE-shell waits for its
dies (ranks/cluster/pool_shell.py). Run it under `python -m mpi4py`
so that an exception on one rank aborts the whole job instead of leaving the others waiting.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from mpi4py import MPI

from xds_mpi.config.dataclass_cache import use_cache

use_cache()  # before the project's dataclasses are defined: their methods compiled once, not here

from launch.job.log import setup_logging
from launch.job.startup import RANK_STATS_ENV, mark_loaded
from ranks import RankContext, role_program
from ranks.cluster.link import ClusterLink, set_link
from xccl.gmem_paths import set_memory_path, set_node_leader
from xccl.wake import MPI_TIME, quiet_barrier, set_wait_mode
from xds_mpi.config.schema import load_config
from xds_mpi.execution import emulator_runtime
from xds_mpi.plan.cluster import plan_cluster
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.plan.resolved import read_resolved
from xds_mpi.report import trace


def _pool_rank(ctx: RankContext, base) -> int:
    from ranks.cluster.pool_rank import run  # a pool rank's only

    return run(ctx, base)


def _pool_host(ctx: RankContext, base) -> int:
    from ranks.cluster.pool_shell import run  # a pool TE's TE-shell's only

    return run(ctx)  # its plan is its TE's already


# The pool's programs (docs/cluster.md "A pool of ranks"), beside the role registry's
POOL_PROGRAMS = {"pool rank": _pool_rank, "pool host": _pool_host, "pool pd host": _pool_rank}

USAGE = (
    "usage: python -m mpi4py -m launch.job.rank CONFIG [--set SECTION.KEY=VALUE ...]"
    " [--resolved FILE]"
)


def write_rank_stats(rank: int, role: str, core: int | None) -> None:
    """With $XDS_RANK_STATS=DIR (set by `xds-mpi bench serve`): this rank's MPI time and GC
    collections as DIR/rank<N>.json."""
    out = os.environ.get(RANK_STATS_ENV)
    if not out:
        return
    stats = {
        "rank": rank,
        "role": role,
        "core": core,
        "mpi_work_s": MPI_TIME.work_s,
        "mpi_wait_s": MPI_TIME.wait_s,
        "mpi_calls": MPI_TIME.calls,
        "gc_collections": emulator_runtime.collections(),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(stats))


@dataclass(frozen=True, kw_only=True)
class RankArgs:
    config: str  # the YAML file
    overrides: list[str]  # its --set values
    resolved: str | None = None  # the launcher's resolved copy of both (xds_mpi/plan/resolved.py)


def parse_args(argv: list[str]) -> RankArgs:
    """The arguments launch/job/mpiexec.py `rank_program` writes.
    By hand, not argparse: its import and parser cost every rank ~9 ms of start-up CPU (gettext
    looks up a translation for each of its messages)."""
    config, overrides, resolved = None, [], None
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(__doc__)
            sys.exit(0)
        if arg.startswith("--set="):
            overrides.append(arg.removeprefix("--set="))
        elif arg in ("--set", "--resolved"):
            value = next(args, None)
            if value is None:
                what = "SECTION.KEY=VALUE" if arg == "--set" else "a FILE"
                sys.exit(f"{USAGE}\nlaunch.rank: {arg} needs {what}")
            if arg == "--set":
                overrides.append(value)
            else:
                resolved = value
        elif arg.startswith("-") or config is not None:
            sys.exit(f"{USAGE}\nlaunch.rank: unrecognized argument {arg!r}")
        else:
            config = arg
    if config is None:
        sys.exit(f"{USAGE}\nlaunch.rank: a CONFIG is required")
    return RankArgs(config=config, overrides=overrides, resolved=resolved)


def read_config(args: RankArgs):
    """The launcher's resolved copy when it is there and was made of this CONFIG and these --set
    values (read without PyYAML's ~25 ms), else the YAML file (a test body, a hand-written
    line, a dry run's line, a host that does not see the copy)."""
    if args.resolved is not None:
        cfg = read_resolved(args.resolved, args.config, args.overrides)
        if cfg is not None:
            return cfg
    return load_config(args.config, args.overrides)


def split_cluster(world: MPI.Comm, plan: DeploymentPlan) -> tuple[MPI.Comm, ClusterLink | None]:
    """Collective over the world: this rank's communicator (its TE's, or the link for the JE)
    and, for the JE and the TE-shells, the link (xds_mpi/plan/cluster.py)."""
    te, local = plan.cluster.te_of(world.rank)
    is_pool_rank = plan.cluster.is_pool_rank(world.rank)  # in no TE, not on the link
    te_comm = world.Split(MPI.UNDEFINED if te < 0 else te, key=world.rank)
    link = world.Split(0 if local == 0 and not is_pool_rank else MPI.UNDEFINED, key=world.rank)
    if is_pool_rank:
        return world, None
    if link == MPI.COMM_NULL:
        return te_comm, None
    return (link if te < 0 else te_comm), ClusterLink(
        comm=link, te=te, num_jes=plan.cluster.num_jes
    )


def unreceived(comm: MPI.Comm) -> list[str]:
    """The messages sent to this rank on `comm` that it never received, taken now (MPI_Finalize
    fails on one, and hydra then kills the job with SIGKILL, saying nothing of why): "from rank
    R, tag T (its type)"."""
    found, status = [], MPI.Status()
    while comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
        data = bytearray(status.Get_count(MPI.BYTE))
        comm.Recv(data, source=status.source, tag=status.tag)
        try:
            kind = type(pickle.loads(data)).__name__
        except Exception:  # a raw buffer (Send), not a pickled object
            kind = f"{len(data)} bytes"
        found.append(f"from rank {status.source}, tag {status.tag} ({kind})")
    return found


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    world = MPI.COMM_WORLD
    mark_loaded(world.rank)  # the launcher counts these during a long start-up
    cfg = base_cfg = read_config(args)
    cluster = plan_cluster(cfg)  # None: one TE
    te, local = cluster.te_of(world.rank) if cluster else (-1, world.rank)
    # made before launch; a cluster's TE: its own config (its group's) and ranks 0..S-1
    plan = DeploymentPlan.build(cfg, world.size, launcher_checks=False, te=te if cluster else None)
    cfg = plan.cfg
    role = "je" if plan.cluster and te < 0 else plan.topo.ranks[local].role
    if plan.cluster is not None and plan.cluster.is_pool_rank(world.rank):
        role = "pool rank"
    elif plan.cluster is not None and te >= 0 and plan.cluster.tes[te].is_pool:
        role = "pool host" if local == 0 else "pool pd host"  # a pair's decode TE-shell: 1
    log = setup_logging(world.rank, role if te < 0 else f"{role} te{te}", cfg.run.log_level)
    set_memory_path(cfg.xccl.memory_path)  # every window this rank makes uses it
    # The ranks finish importing at different times; MPICH's blocking collectives poll, so the
    # early ones would burn the cores the late ones still import on. They meet dozing first.
    quiet_barrier(world, what="start-up", timeout_s=cfg.xccl.poll_timeout_s)
    comm = world
    if plan.cluster is not None:  # each TE on its own communicator; the JE on the link
        comm, link = split_cluster(world, plan)
        set_link(link)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    node_leader = node.allreduce(world.rank, op=MPI.MIN)
    set_node_leader(node_leader)  # every window this rank makes learns its peers' nodes from it
    set_wait_mode(cfg.xccl.wait, local_ranks=node.size)  # before pinning narrows the cores
    core = emulator_runtime.start(cfg.emulator, local_rank=node.rank, local_size=node.size)
    node.Free()
    if core is not None:
        log.debug("pinned to core %d", core)
    weights = None  # standby TEs: every die's weights in a window over the world
    if plan.cluster is not None and any(t.standby for t in plan.cluster.tes):
        # Lazy import: only then (the model's modules, on the JE and TE-shells too)
        from ranks.core.weights_window import open_weights_window, set_weights_window

        weights = open_weights_window(world, plan)  # a pool rank's: 0 bytes or a fork slot
        set_weights_window(weights)
    trace.configure(enabled=cfg.run.trace)  # buffered; sent to the TE-shell at the end
    # Print every rank's stack shortly before MPIEXEC_TIMEOUT would kill the job silently.
    faulthandler.dump_traceback_later(max(1.0, cfg.run.timeout_s - 5), exit=False, file=sys.stderr)
    if role in POOL_PROGRAMS:  # a pool rank builds its TEs' plans from the config as read
        program = partial(POOL_PROGRAMS[role], base=base_cfg)
    else:
        program = role_program(role, is_pd=plan.pd is not None)
    exit_code = program(RankContext(plan=plan, comm=comm, log=log, node_leader=node_leader))
    if weights is not None:
        weights.free()  # collective over the world, once every rank's program ended
    faulthandler.cancel_dump_traceback_later()
    write_rank_stats(world.rank, role, core)
    if left := unreceived(world):
        log.error(
            "message(s) sent to this rank and never received (a protocol's end misses a "
            "receive; MPI_Finalize would fail on them): %s",
            "; ".join(left),
        )
        exit_code = exit_code or 1
    if exit_code:
        sys.exit(exit_code)  # after every collective: mpi4py turns it into the job's exit code


if __name__ == "__main__":
    main()
