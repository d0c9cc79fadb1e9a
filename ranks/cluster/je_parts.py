"""What both of a cluster's JEs share (docs/cluster.md): the virtual-clock JE (ranks/cluster/je.py)
and the served one (ranks/cluster/served_je.py): the run around a JE's job, its view of the TEs'
loads, the check of every request whichever TE served it, the per-TE counts and the run file's
per-TE columns."""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime

from ranks.core.context import RankContext
from xds_mpi.cluster.autoscaler import Autoscaler
from xds_mpi.cluster.loads import TeLoads
from xds_mpi.cluster.policies import load_policy
from xds_mpi.cluster.prompt_tree import PromptTree, te_capacity_blocks
from xds_mpi.cluster.scale_trace import write_cluster_trace
from xds_mpi.plan.cluster import te_config
from xds_mpi.report.runfile import run_file_path, write_run_file
from xds_mpi.report.trace_writer import trace_path


def run_job(ctx: RankContext, make, serve, *, what: str) -> int:
    """A JE's run around its job (a JobExecutor, or a served cluster): `make(ctx)` it,
    `serve(job, started)` it until its TEs' results are in, check every request against the
    reference, and write the one run file, whatever happened (exit code 1 on a mismatch or a
    TE's failure)."""
    started_at, started = datetime.now(), time.perf_counter()
    path = run_file_path(ctx.cfg, started_at)
    ctx.log.info("%s: %s", what, ctx.plan.cluster.describe().splitlines()[0])
    status, job = "completed", None
    try:
        job = make(ctx)
        serve(job, started)
        if ctx.cfg.run.check:
            job.check()
            if job.mismatches:
                status = f"check failed: {len(job.mismatches)} mismatches"
        status = job.te_failure or status
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
            extra=job.write if job is not None and job.results else None,
        )
        if getattr(job, "trace", None) is not None:  # run.trace: beside the run file
            write_cluster_trace(trace_path(path), job.trace)
        ctx.log.info("run %s; run file %s", status.split(":")[0], path.resolve())
        if job is not None and job.check_line:
            print(job.check_line, flush=True)
    return 1 if job is not None and (job.mismatches or job.te_failure) else 0


def cluster_loads(cfg, cluster, autoscaler: Autoscaler | None, arrival_of) -> TeLoads:
    """The JE's view of its TEs (xds_mpi/cluster/loads.py): cluster.policy, each TE's kind and
    dies, the prompt tree with each TE's capacity as its own config gives it."""
    return TeLoads(
        cluster.num_tes,
        load_policy(cluster.policy, cfg),
        kinds=[t.kind for t in cluster.tes],
        num_dies=[t.num_dies for t in cluster.tes],
        tree=PromptTree(
            cluster.num_tes,
            block_tokens=cfg.scheduler.kv_block_tokens,
            capacity_blocks=[
                te_capacity_blocks(te_config(cfg, t.overrides), t.num_dies) for t in cluster.tes
            ],
        ),
        autoscaler=autoscaler,
        arrival_of=arrival_of,
    )


def write_te_columns(group, cluster, statuses: list[str]) -> None:
    """The run file's per-TE columns of /cluster (docs/cluster.md "The run file"): each TE's
    TE-shell world rank, size, kind, group, standby and status."""
    import h5py
    import numpy as np

    text = h5py.string_dtype()
    group["te_standby"] = np.array([t.standby for t in cluster.tes])
    group["te_first_rank"] = np.array(
        [cluster.first_rank(te) for te in range(cluster.num_tes)], np.int64
    )
    group["te_size"] = np.array([t.size for t in cluster.tes], np.int64)
    group["te_kind"] = np.array([t.kind for t in cluster.tes], dtype=text)
    group["te_group"] = np.array([t.group for t in cluster.tes], dtype=text)
    group.attrs.update(num_tes=cluster.num_tes, policy=cluster.policy)
    group["te_status"] = np.array(statuses, dtype=text)


MERGED = ("requests", "dies")  # a TE's own groups the JE's run file holds merged


def write_own_files(group, results: dict) -> None:
    """Each TE's own run file (`TeResult.own`) under /cluster/te<k>/ but for what the JE's run
    file merges: a PD pair's /pd, a TE's /failures and /slo, its own /summary and /virtual."""
    import io

    import h5py

    for te, result in sorted(results.items()):
        if not result.own:
            continue
        target = group.create_group(f"te{te}")
        with h5py.File(io.BytesIO(result.own), "r") as own:
            target.attrs.update(own.attrs)
            for name in own:
                if name not in MERGED:
                    own.copy(own[name], target, name=name)


def check_every_request(cfg, records: dict, log) -> tuple[list[str], str]:
    """`--check`: every request against the single-process reference, whichever TE served it;
    (its mismatches, the check line)."""
    # Lazy import: the reference runs once, after serving.
    from xds_mpi.results.results import check_against_reference

    log.info("check: running the single-process reference on %d requests", len(records))
    num_requests, num_tokens, mismatches = check_against_reference(cfg, records)
    for line in mismatches:
        log.error("check: %s", line)
    return (
        mismatches,
        f"check: {num_requests} requests, {num_tokens} tokens, {len(mismatches)} mismatches",
    )


def count_per_te(summary: dict, cluster, te_of: dict[int, int], log) -> None:
    """`/summary`'s `te<k>_requests` (the TE each request was routed to last) and the log line."""
    per_te = Counter(te_of.values())
    for te in range(cluster.num_tes):
        summary[f"te{te}_requests"] = per_te[te]
    log.info(
        "cluster: %s",
        ", ".join(f"TE {te} served {per_te[te]} requests" for te in range(cluster.num_tes)),
    )
