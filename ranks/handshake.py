"""Startup handshake: rank 0 checks that every rank loaded the same config and sees itself where
rank 0's topology puts it, then tells every rank to go on (or why the job stops)."""

from __future__ import annotations

from ranks.context import RankContext
from xds_mpi.control import recv_from_each, send_to_each

TAG_HELLO, TAG_VERDICT = 101, 102


def handshake(ctx: RankContext) -> None:
    timeout_s = ctx.cfg.xccl.poll_timeout_s
    hello = (ctx.config_digest(), ctx.info)
    if ctx.comm.rank != 0:
        ctx.comm.send(hello, dest=0, tag=TAG_HELLO)
        verdict = recv_from_each(
            ctx.comm,
            [0],
            tag=TAG_VERDICT,
            timeout_s=timeout_s,
            me=ctx.name,
            event="handshake verdict",
        )[0]
        if verdict:
            raise RuntimeError(f"{ctx.name}: startup refused by rank 0: {verdict}")
        return
    others = range(1, ctx.comm.size)
    hellos = recv_from_each(
        ctx.comm, others, tag=TAG_HELLO, timeout_s=timeout_s, me=ctx.name, event="handshake hello"
    )
    problems = [
        f"rank {r} loaded config {digest}, rank 0 loaded {hello[0]}"
        for r, (digest, _) in hellos.items()
        if digest != hello[0]
    ]
    problems += [
        f"rank {r} sees itself as {info}, rank 0 expects {ctx.topo.ranks[r]}"
        for r, (_, info) in hellos.items()
        if info != ctx.topo.ranks[r]
    ]
    verdict = "; ".join(problems)
    send_to_each(
        ctx.comm,
        {r: verdict for r in others},
        tag=TAG_VERDICT,
        timeout_s=timeout_s,
        me=ctx.name,
        event="handshake verdict",
    )
    if verdict:
        raise RuntimeError(f"{ctx.name}: ranks disagree on the deployment: {verdict}")
