"""The TE-shell (host rank): owns the request stream and reports on the job.

At the end of a run it writes the run file (xds_mpi/runfile.py) and names it on its last log line;
a run that fails still writes one, with status "failed: <why>", before the error aborts the job.
"""
from __future__ import annotations

import time
from datetime import datetime

from ranks.context import RankContext
from ranks.handshake import handshake
from xds_mpi.runfile import run_file_path, write_run_file


def run(ctx: RankContext) -> None:
    started_at, started = datetime.now(), time.perf_counter()
    path = run_file_path(ctx.cfg, started_at)
    handshake_s = 0.0
    status = "completed"
    ctx.log.info("TE-shell up; waiting for %d ranks", ctx.comm.size - 1)
    try:
        handshake(ctx)
        handshake_s = time.perf_counter() - started
        ctx.log.info("all %d ranks agree on the deployment (%.2f s): %s", ctx.comm.size,
                     handshake_s, ctx.topo.summary())
    except Exception as exc:
        status = f"failed: {exc}"
        raise
    finally:
        write_run_file(path, cfg=ctx.cfg, topo=ctx.topo, status=status, started_at=started_at,
                       wall_time_s=time.perf_counter() - started, handshake_s=handshake_s)
        ctx.log.info("run %s; run file %s", status.split(":")[0], path.resolve())
