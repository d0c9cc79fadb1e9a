"""A pool TE's TE-shell (docs/cluster.md "A pool of ranks"): a pre-warmed pod, launched with the
runtime imported but no dies of its own. Until the JE scales out to its TE it takes the JE's
grants (none routes a request here: a standby TE is no candidate) and reports idle once per
round, as a standby TE's TE-shell does. Then, for each activation:

1. the JE's `PoolActivation` (before its load order): the pool ranks that are its dies;
2. the TE's communicator formed with them (ranks/cluster/pool_rank.py `form_te_comm`);
3. the TE-shell's program on it (ranks/shell/te_shell.py, the same as a launched TE's: the
   handshake, the windows, the JE's load order passed on to the dies, serving), its JE-side state
   (`JeGrants`, `JeReports`: the rounds so far) carried in and out through the link, so that the
   JE's rounds go on as if the TE had always been there;
4. at the JE's `PoolRelease` (its drain done: nothing left to serve) the program ends as at a
   run's end (its dies stop, the windows are freed), its records kept, the communicator freed.

At the job's end (the JE's last promise) it sends the JE one `TeResult` for all its activations:
each record's die named by the world rank that served it, each die's timings by world rank, and
its own run file: the last activation's, with every activation's under `turn<i>/` (`own_turns`),
so `/cluster/te<k>/` keeps each turn's summary, virtual times and failures.
"""

from __future__ import annotations

import math
import time
from array import array
from dataclasses import replace

from mpi4py import MPI

from ranks.cluster.je_parts import MERGED
from ranks.cluster.link import cluster_link, set_link
from ranks.cluster.messages import (
    TAG_CLUSTER_POOL,
    TAG_CLUSTER_RESULT,
    TAG_VTIME_GRANT,
    PoolActivation,
    PoolRelease,
    TeResult,
)
from ranks.cluster.pool_rank import form_te_comm
from ranks.cluster.te_side import JeGrants, JeReports, own_run_file
from ranks.core.context import RankContext
from ranks.core.control import WaitTimeout, send_to_each, wait_all
from ranks.shell import te_shell
from xccl.wake import Doze
from xds_mpi.plan.cluster import JE_RANK

INF = math.inf


def run(ctx: RankContext) -> int:
    """ctx.comm: this rank alone (its TE has no die until activated)."""
    shell = PoolShell(ctx)
    shell.serve()
    shell.send_result()
    return 0


class PoolShell:
    """The TE-shell between its TE's activations: its JE-side state, its activations' records."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx, self.link = ctx, cluster_link()
        self.grants = JeGrants(self.link)  # carried into each activation's TePacer
        self.sends: list[MPI.Request] = []
        self.to_je = JeReports(self.link, self, self.grants)
        self.is_released = False  # the JE's PoolRelease taken by the serving TePacer
        self.activation: PoolActivation | None = None  # the current one
        self.served: list[tuple[object, str, PoolActivation]] = []  # (serving, status, its own)
        self.timeout_s = ctx.cfg.run.timeout_s
        self.me = f"TE-shell of pool TE {self.link.te}"

    def serve(self) -> None:
        """Idle reports until an activation, each activation served, until the JE's last
        promise (bounded by run.timeout_s)."""
        deadline, doze = time.monotonic() + self.timeout_s, Doze()
        while self.grants.promise_s != INF:
            activation = self._take_je()
            if activation is not None:
                self._serve(activation)
                doze.reset()
            elif self.to_je.report(start_s=0.0, is_idle=True):
                doze.reset()
            else:
                doze.pause()
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"{self.me}: the JE's last promise not received after run.timeout_s("
                    f"{self.timeout_s:g}) (promise {self.grants.promise_s:.6f} s virtual, JE "
                    f"grant {self.grants.round})"
                )

    def _take_je(self) -> PoolActivation | None:
        """The JE's grants (no request can be routed to a standby TE) up to an activation."""
        comm, status = self.link.comm, MPI.Status()
        for je in self.link.jes:
            while comm.iprobe(source=je, tag=MPI.ANY_TAG, status=status):
                if status.tag == TAG_CLUSTER_POOL:
                    message = comm.recv(source=je, tag=TAG_CLUSTER_POOL)
                    if isinstance(message, PoolActivation):
                        return message
                    continue  # a release the TE's own loop did not need (it had ended)
                if status.tag != TAG_VTIME_GRANT:
                    raise RuntimeError(
                        f"{self.me}: message with tag {status.tag} from JE {je} while no dies "
                        "are formed (only grants and activations come then)"
                    )
                grant = comm.recv(source=je, tag=TAG_VTIME_GRANT)
                if grant.requests:
                    raise RuntimeError(
                        f"{self.me}: JE {je}'s grant {grant.seq} routes "
                        f"{len(grant.requests)} requests here before any activation"
                    )
                self.grants.take(je, grant, None)
        return None

    def _serve(self, activation: PoolActivation) -> None:
        """Steps 2-4: the TE formed, served until released (or the run's end), taken apart."""
        ctx = self.ctx
        wait_all(self.sends, timeout_s=ctx.cfg.xccl.poll_timeout_s, me=self.me, event="reports")
        self.sends, self.is_released, self.activation = [], False, activation
        started = time.perf_counter()
        comm = form_te_comm(MPI.COMM_WORLD, activation, ctx.cfg.xccl.poll_timeout_s)
        ctx.log.info(
            "%s: formed with pool ranks %s in %.4f s wall",
            self.me,
            activation.members[1:],
            time.perf_counter() - started,
        )
        link = self.link
        set_link(replace(link, pool=self))  # TePacer takes the rounds on (te_side.py)
        try:
            te_ctx = RankContext(plan=ctx.plan, comm=comm, log=ctx.log, node_leader=ctx.node_leader)
            te_shell.run(te_ctx)
        finally:
            set_link(link)
        self.to_je.send_through(self)
        comm.Free()
        ctx.log.info("%s: its dies back in the pool", self.me)

    def release(self, message: PoolRelease) -> None:
        """The serving TePacer took the JE's word that the drain is done."""
        self.is_released = True

    def keep(self, serving, status: str) -> None:
        """An activation's end (te_side.py send_result): its records, for the one result."""
        if serving is not None:
            self.served.append((serving, status, self.activation))

    def send_result(self) -> None:
        """Every activation's records to JE 0, dies named by world rank (the JE adds the
        TE-shell's world rank to a record's die rank)."""
        first = MPI.COMM_WORLD.rank  # this TE-shell's world rank
        result = TeResult(te=self.link.te, status="completed")
        for serving, status, activation in self.served:
            members = activation.members
            if status != "completed":
                result.status = status
            for req_id, record in serving.records.items():
                record.die_rank = members[record.die_rank] - first
                result.records[req_id] = record
            result.admitted.update(serving.admitted)
            for local, timings in serving.die_timings.items():
                _add_timings(result.die_timings, members[local] - first, timings)
            result.summary = serving.summary
            result.started = min(result.started or serving.started, serving.started)
        result.own = own_turns([(own_run_file(serving), a) for serving, _, a in self.served])
        wait_all(
            self.sends, timeout_s=self.ctx.cfg.xccl.poll_timeout_s, me=self.me, event="reports"
        )
        send_to_each(
            self.link.comm,
            {JE_RANK: result},
            tag=TAG_CLUSTER_RESULT,
            timeout_s=self.ctx.cfg.xccl.poll_timeout_s,
            me=self.me,
            event="TE result to the JE",
        )


def own_turns(owns: list[tuple[bytes, PoolActivation]]) -> bytes:
    """The pool TE's own run file for the JE (HDF5 bytes): the last activation's, and each
    activation's i-th under `turn<i>/` (but what the JE's run file merges), its attributes
    `scale_event` and `world_ranks` (the TE-shell's, then its dies')."""
    # Lazy imports: at the job's end only, as own_run_file's.
    import io

    import h5py

    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as out:
        for index, (own, activation) in enumerate(owns):
            with h5py.File(io.BytesIO(own), "r") as f:
                turn = out.create_group(f"turn{index}")
                turn.attrs.update(f.attrs)
                turn.attrs.update(
                    scale_event=activation.event, world_ranks=list(activation.members)
                )
                for name in f:
                    if name not in MERGED:
                        f.copy(f[name], turn, name=name)
                if index == len(owns) - 1:  # the last at the root, as a TE launched whole's
                    out.attrs.update(f.attrs)
                    for name in f:
                        f.copy(f[name], out, name=name)
    return buffer.getvalue() if owns else b""


def _add_timings(into: dict, rank: int, timings: dict) -> None:
    """A die's per-iteration timings, appended to what the same world rank logged before."""
    if rank not in into:
        into[rank] = {name: array(values.typecode, values) for name, values in timings.items()}
        return
    for name, values in timings.items():
        into[rank][name].extend(values)
