"""The job executor of a cluster (docs/cluster.md), world rank 0: owns the workload and the
records, routes each request to one of the TEs by `cluster.policy` (xds_mpi/cluster/policies/)
at its virtual arrival, from the TEs' states then, and writes the one run file with every
request (its TE, its times on the virtual clock) and `--check` over all of them.

The conservative rule, as the JE of PD applies it to its prefill TEs (ranks/shell/pd_pacers.py):
a TE's state at t is the requests routed to it not finished by t, so the JE routes only up to
the earliest virtual time a busy TE may still finish one before: its dies' common start, which
its TE-shell reports once per JE grant (ranks/cluster/te_side.py), after the finishes (the
rounds: ranks/cluster/te_rounds.py; what the served JE shares: ranks/cluster/je_parts.py). An
idle TE finishes nothing before it is given a request; when every TE is idle, the JE routes the
next arrival at once (time warps to it). Each grant carries the requests routed to the TE with their
routing times, and the promise: the next arrival not yet routed (inf: none left), before which
no request is still to come to it.

Several JEs (`cluster.num_jes`, world ranks 0..J-1): the frontend deals the requests to them in
arrival order (JE j the j-th of every J); each routes its share by the policy from its own view
(its own requests' loads and prompt tree: DeepServe's JEs schedule independently) under the same
rule, a TE's promise being the lowest of theirs (ranks/cluster/te_side.py `JeGrants`). JE 0
writes the run file: the TEs' results and the other JEs' shares (`JeShare`) come to it.

Every wait is bounded: the TEs' reports and results within run.timeout_s (each TE-shell bounds
its own waits on its dies), errors naming the TE-shells and the grant.
"""

from __future__ import annotations

import time
from collections import Counter, deque

from mpi4py import MPI

from ranks.cluster.je_parts import (
    check_every_request,
    cluster_loads,
    count_per_te,
    run_job,
    write_own_files,
    write_te_columns,
)
from ranks.cluster.messages import TAG_CLUSTER_RESULT, TAG_CLUSTER_SHARE, JeShare, TeResult
from ranks.cluster.te_rounds import TeRounds
from ranks.cluster.weights_load import ScaleOutLoads
from ranks.core.context import RankContext
from ranks.core.control import WaitTimeout, recv_from_each, send_to_each, wait_all
from xds_mpi.cluster.autoscaler import make_autoscaler
from xds_mpi.cluster.pool import pool_rows
from xds_mpi.plan.cluster import JE_RANK
from xds_mpi.results.results import RequestRecord
from xds_mpi.workload.requests import rejection
from xds_mpi.workload.stream import load_workload


def run(ctx: RankContext) -> int:
    """The JE's program; ctx.comm is the link (JE j at j, TE-shell of TE k at num_jes + k)."""
    if ctx.comm.rank != JE_RANK:  # another JE: its share routed, handed to JE 0
        je = JobExecutor(ctx)
        je.serve()
        je.hand_over()
        return 0
    if ctx.cfg.serve.enabled:  # xds-mpi serve: the endpoint's requests on the wall clock
        # Lazy import, serve only: aiohttp and the API (docs/scale.md).
        from ranks.cluster.served_je import run as run_served

        return run_served(ctx)

    def serve(je: JobExecutor, started: float) -> None:
        je.serve()
        je.take_shares()
        je.collect()
        if je.weights is not None and ctx.plan.cluster.pool_ranks:
            je.weights.stop_pool()  # every TE has ended: the pool ranks wait in their loop

    return run_job(ctx, JobExecutor, serve, what="JE up")


class JobExecutor:
    def __init__(self, ctx: RankContext) -> None:
        cfg, cluster = ctx.cfg, ctx.plan.cluster
        self.ctx, self.comm, self.log = ctx, ctx.comm, ctx.log
        self.index = ctx.comm.rank  # this JE's (0: the one writing the run file)
        self.name = "JE" if cluster.num_jes == 1 else f"JE {self.index}"
        self.records: dict[int, RequestRecord] = {}  # JE 0: every request's; JE j: its share's
        requests = load_workload(cfg)
        self.dealt = deal(requests, cluster.num_jes)  # req_id -> its JE
        queue = []
        for req in requests:
            je = self.dealt[req.req_id]
            if je != self.index and self.index != JE_RANK:
                continue
            reason = rejection(req, cfg)
            self.records[req.req_id] = RequestRecord(req=req, rejected=reason)
            if je != self.index:
                continue
            if reason:
                self.log.warning("request %d rejected: %s", req.req_id, reason)
            else:
                queue.append(req)
        self.queue = deque(sorted(queue, key=lambda r: (r.arrival_s, r.req_id)))
        self.num_routed = len(self.queue)
        self.routed_s: dict[int, float] = {}  # req_id -> the JE's routing (virtual s)
        self.orphaned: dict[int, int] = {}  # req_id -> the lost TE it was first routed to
        self.sends: list[MPI.Request] = []
        self.rounds = TeRounds(self)
        self.autoscaler = self.weights = None
        if cfg.autoscaler.enabled:  # xds_mpi/cluster/autoscaler.py
            self.autoscaler = make_autoscaler(cfg, cluster.tes, cluster.pool_ranks)
            self.weights = ScaleOutLoads(cfg, cluster, self.comm, self.log)  # moved for real
        self.loads = cluster_loads(cfg, cluster, self.autoscaler, self.rounds.arrival_of)
        self.results: dict[int, TeResult] = {}
        self.mismatches: list[str] = []
        self.check_line = ""
        self.te_failure = ""
        self.trace: dict | None = None  # run.trace: the JE's trace (xds_mpi/cluster/scale_trace.py)

    def serve(self) -> None:
        """Route every request; the TEs serve them."""
        self.started = time.time()
        deadline = time.monotonic() + self.ctx.cfg.run.timeout_s
        while self.queue or self.rounds.losses or self.rounds.is_watching:
            if not self.rounds.turn():
                time.sleep(0.0005)
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"{self.name}: {len(self.queue)} requests not routed after "
                    f"run.timeout_s({self.ctx.cfg.run.timeout_s:g})"
                )
        self.log.info("%s: %d requests routed, waiting for the TEs", self.name, self.num_routed)
        for event in self.autoscaler.events if self.autoscaler else ():
            self.log.info(
                "autoscaler: %s TE %d at %.3f s virtual (load %.2f unfinished requests per die)%s",
                "scaled out to" if event.kind == "out" else "drained",
                event.te,
                event.decided_s,
                event.load,
                f", serving from {event.serves_s:.3f} s" if event.kind == "out" else "",
            )

    def hand_over(self) -> None:
        """JE j > 0: what it routed, to JE 0 (bounded), once its grants are out."""
        cfg = self.ctx.cfg
        wait_all(self.sends, timeout_s=cfg.run.timeout_s, me=self.name, event="grants")
        share = JeShare(
            je=self.index,
            routed_s=self.routed_s,
            te_of=self.loads.te_of,
            orphaned=self.orphaned,
            decisions=self.loads.decisions,
        )
        send_to_each(
            self.comm,
            {JE_RANK: share},
            tag=TAG_CLUSTER_SHARE,
            timeout_s=cfg.run.timeout_s,
            me=self.name,
            event="its share to JE 0",
        )

    def take_shares(self) -> None:
        """JE 0: the other JEs' shares (bounded), merged into its own view for the run file."""
        cluster = self.ctx.plan.cluster
        if cluster.num_jes == 1:
            return
        shares = recv_from_each(
            self.comm,
            range(1, cluster.num_jes),
            tag=TAG_CLUSTER_SHARE,
            timeout_s=self.ctx.cfg.run.timeout_s,
            me=self.name,
            event="another JE's share",
        )
        loads = self.loads
        for share in shares.values():
            self.routed_s.update(share.routed_s)
            loads.te_of.update(share.te_of)
            self.orphaned.update(share.orphaned)
            loads.decisions.extend(share.decisions)
        loads.decisions.sort(key=lambda d: (d.decided_s, d.req_id))

    def collect(self) -> None:
        """Every TE's records once it has served (bounded), merged into the JE's."""
        cfg, cluster = self.ctx.cfg, self.ctx.plan.cluster
        left_s = cfg.run.timeout_s - (time.time() - self.started)
        results = recv_from_each(
            self.comm,
            [cluster.shell(te) for te in range(cluster.num_tes)],  # a lost TE's too
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
                if self.orphaned.get(req_id) == te:
                    continue  # lost with its TE, served again elsewhere
                record.die_rank = first + record.die_rank  # its world rank
                self.records[req_id] = record
            self.admitted.update(
                (r, t) for r, t in result.admitted.items() if self.orphaned.get(r) != te
            )
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
        self.summary.update(
            num_tes=cluster.num_tes, num_jes=cluster.num_jes, cluster_policy=cluster.policy
        )
        self.summary["rerouted_requests"] = len(self.orphaned)
        if self.autoscaler is not None:
            kinds = Counter(e.kind for e in self.autoscaler.events)
            self.summary.update(scale_outs=kinds["out"], scale_ins=kinds["in"])
            pool = self.autoscaler.pool
            if pool is not None:  # docs/cluster.md "A pool of ranks"
                self.summary.update(
                    pool_size=len(pool.ranks),
                    pool_skips=pool.num_skips,
                    pool_waits=pool.num_waits,
                    pool_lost=len(pool.lost),
                )
        self.log.info(format_summary(self.summary))
        count_per_te(self.summary, cluster, self.loads.te_of, self.log)
        self.virtual_times = virtual_times(self.records, self.admitted)
        self.summary.update(virtual_summary(cfg, self.virtual_times, self.summary["wall_s"]))
        self.log.info(format_virtual(self.summary, self.summary["wall_s"]))

    def check(self) -> None:
        """Every served request against the single-process reference, whichever TE served it."""
        self.mismatches, self.check_line = check_every_request(self.ctx.cfg, self.records, self.log)

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
        from xds_mpi.cluster.scale_trace import trace_of_run
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
        group["je"] = np.array([self.dealt[r] for r in ids], np.int64)  # the JE dealt it
        group["routed_s"] = np.array([self.routed_s.get(r, np.nan) for r in ids])
        # the TE a request was first routed to: a lost one's, for a request routed again
        group["first_te"] = np.array(
            [self.orphaned.get(r, self.loads.te_of.get(r, -1)) for r in ids], np.int64
        )
        rounds = self.rounds
        group["te_lost_s"] = np.array(
            [rounds.lost_at.get(te, np.nan) for te in range(cluster.num_tes)]
        )
        group["te_found_s"] = np.array(
            [rounds.found_at.get(te, np.nan) for te in range(cluster.num_tes)]
        )
        if self.autoscaler is not None:  # the scale events, in decision order
            events = self.autoscaler.events
            scaling = group.create_group("scaling")
            scaling["kind"] = np.array([e.kind for e in events], dtype=h5py.string_dtype())
            scaling["te"] = np.array([e.te for e in events], np.int64)
            scaling["decided_s"] = np.array([e.decided_s for e in events])
            scaling["serves_s"] = np.array([e.serves_s for e in events])
            scaling["load"] = np.array([e.load for e in events])
            # each scale-out's steps (DeepServe's five, or one fixed), virtual s; 0 for a drain
            names = [name for e in events for name, _ in e.steps]
            names = list(dict.fromkeys(names))
            scaling["step_s"] = np.array(
                [[dict(e.steps).get(name, 0.0) for name in names] for e in events]
            ).reshape(len(events), len(names))
            scaling["step_name"] = np.array(names, dtype=h5py.string_dtype())
            self.weights.collect()  # each TE's weights really moved, wall time (not virtual)
            for key, values in self.weights.columns(events).items():
                is_text = key == "load_path"
                scaling[key] = np.array(values, dtype=h5py.string_dtype() if is_text else None)
        if self.autoscaler is not None and self.autoscaler.pool is not None:
            write_pool(group, self.autoscaler.pool, cluster)
        if self.ctx.cfg.run.trace:  # the scale events and each TE's serving, virtual clock
            self.trace = trace_of_run(  # written beside the run file (je_parts.py run_job)
                cluster,
                self.autoscaler,
                self.virtual_times,
                self.loads.te_of,
                self.routed_s,
                rounds.lost_at,
            )
        write_te_columns(group, cluster, [self._status(te) for te in sorted(self.results)])
        write_own_files(group, self.results)
        write_decisions(group, self.loads.decisions)
        write_regret(group["decisions"], regret, [d.req_id for d in self.loads.decisions])

    def _status(self, te: int) -> str:
        found_s = self.rounds.found_at.get(te)
        if found_s is None:
            return self.results[te].status
        return f"lost at {self.rounds.lost_at[te]:g} s virtual, found at {found_s:g} s"


def deal(requests, num_jes: int) -> dict[int, int]:
    """The frontend's deal: req_id -> its JE, in arrival order, JE j the j-th of every
    `num_jes`."""
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.req_id))
    return {req.req_id: i % num_jes for i, req in enumerate(ordered)}


def write_pool(group, pool, cluster) -> None:
    """/cluster/pool: one row per pool rank and turn, in the order taken: `rank` (world rank)
    served as rank `die` inside TE `te` (after its host ranks) from `taken_s` (the scale-out's
    decision) until `given_back_s` (the decision after its drain's last finish; inf: the run's
    end, or lost), `lost_s` (its TE's loss, which took the rank out of the pool; nan: none),
    virtual seconds; attributes the pool's size, the scale-outs that passed over or waited for
    a pool TE, and the ranks lost."""
    import numpy as np

    rows = pool_rows(pool.turns, {t.te: t.num_launched for t in cluster.tes if t.is_pool})
    table = group.create_group("pool")
    for key in ("te", "rank", "die", "taken_s", "given_back_s", "lost_s"):
        dtype = np.float64 if key.endswith("_s") else np.int64
        table[key] = np.array([getattr(row, key) for row in rows], dtype)
    table.attrs.update(
        size=len(pool.ranks), skips=pool.num_skips, waits=pool.num_waits, lost=len(pool.lost)
    )
