"""The TE-shell (host rank): owns the request stream and reports on the job."""
from __future__ import annotations

import time

from ranks.context import RankContext
from ranks.handshake import handshake


def run(ctx: RankContext) -> None:
    started = time.perf_counter()
    ctx.log.info("TE-shell up; waiting for %d ranks", ctx.comm.size - 1)
    handshake(ctx)
    ctx.log.info("all %d ranks agree on the deployment (%.2f s): %s", ctx.comm.size,
                 time.perf_counter() - started, ctx.topo.summary())
