"""The job executor of a cluster (docs/cluster.md), world rank 0: owns the workload and the
records, routes each request to one of the TEs by `cluster.policy` (xds_mpi/cluster/policies/)
at its virtual arrival, from the TEs' states then, and writes the one run file with every
request (its TE, its times on the virtual clock) and `--check` over all of them.

The conservative rule, as the JE of PD applies it to its prefill TEs (ranks/shell/pd_pacers.py):
a TE's state at t is the requests routed to it not finished by t, so the JE routes only up to
the earliest virtual time a busy TE may still finish one before: its dies' common start, which
its TE-shell reports once per JE grant (ranks/cluster/te_side.py), after the finishes. An idle TE
finishes nothing before it is given a request; when every TE is idle, the JE routes the next
arrival at once (time warps to it). Each grant carries the requests routed to the TE with their
routing times, and the promise: the next arrival not yet routed (inf: none left), before which
no request is still to come to it.

Every wait is bounded: the TEs' reports and results within run.timeout_s (each TE-shell bounds
its own waits on its dies), errors naming the TE-shells and the grant.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from datetime import datetime

from mpi4py import MPI

from ranks.cluster.messages import TAG_CLUSTER_FINISHED, TAG_CLUSTER_RESULT, TeResult
from ranks.core.context import RankContext
from ranks.core.control import WaitTimeout, recv_from_each, wait_all
from ranks.core.vtime_messages import TAG_VTIME_GRANT, Grant
from ranks.shell.virtual_time import Finishes, GrantRounds
from xds_mpi.cluster.loads import TeLoads
from xds_mpi.cluster.policies import load_policy
from xds_mpi.cluster.prompt_tree import PromptTree
from xds_mpi.report.runfile import run_file_path, write_run_file
from xds_mpi.results.results import RequestRecord
from xds_mpi.scheduling.admission import Completions, decide
from xds_mpi.workload.requests import rejection
from xds_mpi.workload.stream import load_workload

INF = math.inf


def run(ctx: RankContext) -> int:
    """The JE's program; ctx.comm is the link (JE 0, TE-shell of TE k at k + 1)."""
    started_at, started = datetime.now(), time.perf_counter()
    path = run_file_path(ctx.cfg, started_at)
    cluster = ctx.plan.cluster
    ctx.log.info(
        "JE up: %d TEs of %d ranks (%s each), policy %s",
        cluster.num_tes,
        cluster.te_size,
        ctx.topo.summary(),
        cluster.policy,
    )
    status, je = "completed", None
    try:
        je = JobExecutor(ctx)
        je.serve()
        je.collect()
        if ctx.cfg.run.check:
            je.check()
            if je.mismatches:
                status = f"check failed: {len(je.mismatches)} mismatches"
        status = je.te_failure or status
    except Exception as exc:
        status = f"failed: {exc}"
        raise
    finally:
        write_run_file(
            path,
            cfg=ctx.cfg,
            topo=ctx.topo,
            status=status,
            started_at=started_at,
            wall_time_s=time.perf_counter() - started,
            handshake_s=0.0,
            extra=je.write if je is not None and je.results else None,
        )
        ctx.log.info("run %s; run file %s", status.split(":")[0], path.resolve())
        if je is not None and je.check_line:
            print(je.check_line, flush=True)
    return 1 if je is not None and (je.mismatches or je.te_failure) else 0


class TeRounds(GrantRounds):
    """The JE's rounds with its TE-shells: route, grant, take their finishes and reports."""

    def __init__(self, je: JobExecutor) -> None:
        cfg, cluster = je.ctx.cfg, je.ctx.plan.cluster
        shells = range(1, cluster.num_tes + 1)
        super().__init__(je.comm, shells, timeout_s=cfg.run.timeout_s, who="JE")
        self.je = je
        self.completions = Completions()  # finishes not yet applied to the loads
        self.finishes = Finishes(je.comm, TAG_CLUSTER_FINISHED, self.completions, who="JE")
        self.decided_s = 0.0

    def turn(self) -> int:
        num = self._take_reports() + self.finishes.take()
        je = self.je
        if not je.queue:
            return num  # the last grant promised inf: nothing more to route
        missing = self.missing()
        if missing:
            self._check_waiting(missing, len(self.reports) + self.finishes.taken.total())
            return num
        reports = [self.reports[s] for s in self.actors]
        self.finishes.take_counted({r.die_rank: r.num_batches for r in reports}, self.timeout_s)
        busy = [r.start_s for r in reports if not r.is_idle]
        grant = decide(
            je.queue,
            je.loads,
            self.completions,
            now_s=min(busy) if busy else None,
            after_s=self.decided_s,
        )
        to: dict[int, list] = {s: [] for s in self.actors}
        for d in grant.decisions:
            to[d.group + 1].append(d)
            je.routed_s[d.req.req_id] = self.decided_s = d.vtime_s
        seq = self._new_round(grant.horizon_s)
        for shell, decisions in to.items():
            message = Grant(
                seq=seq,
                requests=tuple(d.req for d in decisions),
                horizon_s=grant.horizon_s,  # the promise
                warp_s=-INF,
                times=tuple(d.vtime_s for d in decisions),
            )
            je.sends.append(self.comm.isend(message, dest=shell, tag=TAG_VTIME_GRANT))
        return num + 1


class JobExecutor:
    def __init__(self, ctx: RankContext) -> None:
        cfg, cluster = ctx.cfg, ctx.plan.cluster
        self.ctx, self.comm, self.log = ctx, ctx.comm, ctx.log
        self.records: dict[int, RequestRecord] = {}
        queue = []
        for req in load_workload(cfg):
            reason = rejection(req, cfg)
            self.records[req.req_id] = RequestRecord(req=req, rejected=reason)
            if reason:
                self.log.warning("request %d rejected: %s", req.req_id, reason)
            else:
                queue.append(req)
        self.queue = deque(sorted(queue, key=lambda r: (r.arrival_s, r.req_id)))
        self.num_routed = len(self.queue)
        num_dies = ctx.topo.num_dies
        self.loads = TeLoads(
            cluster.num_tes,
            load_policy(cluster.policy, cfg),
            kinds=[cfg.deployment.kind] * cluster.num_tes,
            num_dies=[num_dies] * cluster.num_tes,
            tree=PromptTree.for_cluster(cfg, cluster.num_tes, num_dies),
        )
        self.routed_s: dict[int, float] = {}  # req_id -> the JE's routing (virtual s)
        self.sends: list[MPI.Request] = []
        self.rounds = TeRounds(self)
        self.results: dict[int, TeResult] = {}
        self.mismatches: list[str] = []
        self.check_line = ""
        self.te_failure = ""

    def serve(self) -> None:
        """Route every request; the TEs serve them."""
        self.started = time.time()
        deadline = time.monotonic() + self.ctx.cfg.run.timeout_s
        while self.queue:
            if not self.rounds.turn():
                time.sleep(0.0005)
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"JE: {len(self.queue)} requests not routed after "
                    f"run.timeout_s({self.ctx.cfg.run.timeout_s:g})"
                )
        self.log.info("JE: %d requests routed, waiting for the TEs", self.num_routed)

    def collect(self) -> None:
        """Every TE's records once it has served (bounded), merged into the JE's."""
        cfg, cluster = self.ctx.cfg, self.ctx.plan.cluster
        left_s = cfg.run.timeout_s - (time.time() - self.started)
        results = recv_from_each(
            self.comm,
            self.rounds.actors,
            tag=TAG_CLUSTER_RESULT,
            timeout_s=max(left_s, cfg.xccl.poll_timeout_s),
            me="JE",
            event="TE result",
        )
        self.ended = time.time()
        wait_all(self.sends, timeout_s=cfg.xccl.poll_timeout_s, me="JE", event="grants")
        self.results = {r.te: r for r in results.values()}
        self.admitted: dict[int, float] = {}
        self.die_timings: dict[int, dict] = {}
        for te, result in sorted(self.results.items()):
            first = cluster.first_rank(te)
            if result.status != "completed" and not self.te_failure:
                self.te_failure = f"failed: TE {te}: {result.status}"
            for req_id, record in result.records.items():
                record.die_rank = first + record.die_rank  # its world rank
                self.records[req_id] = record
            self.admitted.update(result.admitted)
            self.die_timings.update({first + r: t for r, t in result.die_timings.items()})
        # the wall summary from the first TE's serving start (the JE starts routing before the
        # TEs are up)
        self.started = min(
            (r.started for r in self.results.values() if r.started), default=self.started
        )
        self._summarize()

    def _summarize(self) -> None:
        # Lazy imports: after serving (the JE's start-up delays no one, but keep it light).
        from xds_mpi.results.results import format_summary, summarize
        from xds_mpi.results.virtual import format_virtual, virtual_summary, virtual_times

        cfg, cluster = self.ctx.cfg, self.ctx.plan.cluster
        self.summary = summarize(self.records, self.started, self.ended)
        self.summary["serving_clock"] = self.ctx.plan.clock.kind
        self.summary.update(num_tes=cluster.num_tes, cluster_policy=cluster.policy)
        per_te = Counter(self.loads.te_of.values())
        for te in range(cluster.num_tes):
            self.summary[f"te{te}_requests"] = per_te[te]
        self.log.info(format_summary(self.summary))
        self.log.info(
            "cluster: %s",
            ", ".join(f"TE {te} served {per_te[te]} requests" for te in range(cluster.num_tes)),
        )
        self.virtual_times = virtual_times(self.records, self.admitted)
        self.summary.update(virtual_summary(cfg, self.virtual_times, self.summary["wall_s"]))
        self.log.info(format_virtual(self.summary, self.summary["wall_s"]))

    def check(self) -> None:
        """Every served request against the single-process reference, whichever TE served it."""
        from xds_mpi.results.results import check_against_reference

        self.log.info(
            "check: running the single-process reference on %d requests", len(self.records)
        )
        num_requests, num_tokens, self.mismatches = check_against_reference(
            self.ctx.cfg, self.records
        )
        for line in self.mismatches:
            self.log.error("check: %s", line)
        self.check_line = (
            f"check: {num_requests} requests, {num_tokens} tokens, "
            f"{len(self.mismatches)} mismatches"
        )

    def write(self, f) -> None:
        """/requests, /dies (world ranks), /summary, /virtual as a TE's run file has them (with
        the TEs' EMS counts summed and the routing's regret), and /cluster: each request's TE
        and routing time, and the decision log; the file's world_size is the job's."""
        import h5py
        import numpy as np

        from xds_mpi.cluster.decisions import write_decisions
        from xds_mpi.cluster.regret import (
            format_regret,
            regret_summary,
            regrets,
            served_requests,
            write_regret,
        )
        from xds_mpi.cluster.te_counts import ems_over_tes
        from xds_mpi.ems.results import format_ems
        from xds_mpi.results.results import write_serving
        from xds_mpi.results.virtual import write_virtual

        cluster = self.ctx.plan.cluster
        ems = ems_over_tes({te: r.summary for te, r in self.results.items()})
        if ems:
            self.summary.update(ems)
            self.log.info("over the TEs, %s", format_ems(ems))
        served = served_requests(self.records, self.virtual_times, self.loads.te_of, self.routed_s)
        regret = regrets(served, cluster.num_tes)
        self.summary.update(regret_summary(regret))
        self.log.info(format_regret({**self.summary, "policy": cluster.policy}))
        write_serving(f, self.records, self.started, self.summary, self.die_timings)
        f["summary"].attrs["check_mismatches"] = (
            len(self.mismatches) if self.ctx.cfg.run.check else -1
        )
        write_virtual(f, self.virtual_times)
        f.attrs["world_size"] = cluster.world_size
        group = f.create_group("cluster")
        ids = sorted(self.records)
        group["req_id"] = np.array(ids, np.int64)
        group["te"] = np.array([self.loads.te_of.get(r, -1) for r in ids], np.int64)
        group["routed_s"] = np.array([self.routed_s.get(r, np.nan) for r in ids])
        group["te_first_rank"] = np.array(
            [cluster.first_rank(te) for te in range(cluster.num_tes)], np.int64
        )
        group.attrs.update(num_tes=cluster.num_tes, te_size=cluster.te_size, policy=cluster.policy)
        group["te_status"] = np.array(
            [self.results[te].status for te in sorted(self.results)], dtype=h5py.string_dtype()
        )
        write_decisions(group, self.loads.decisions)
        write_regret(group["decisions"], regret, [d.req_id for d in self.loads.decisions])
