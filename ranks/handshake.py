"""Startup handshake: rank 0 checks that every rank loaded the same config and sees itself where
rank 0's topology puts it, then tells every rank to go on (or why the job stops)."""

from __future__ import annotations

from ranks.context import RankContext
from xds_mpi.control import recv_from_each, send_to_each

TAG_HELLO, TAG_VERDICT = 101, 102


def handshake(ctx: RankContext) -> None:
    hello = (ctx.config_digest(), ctx.info)
    if ctx.comm.rank != 0:
        _await_verdict(ctx, hello)
    else:
        _give_verdict(ctx, hello)


def _await_verdict(ctx: RankContext, hello: tuple) -> None:
    """Any rank but 0: send (config digest, RankInfo) to rank 0 and wait for its verdict."""
    ctx.comm.send(hello, dest=0, tag=TAG_HELLO)
    verdict = recv_from_each(
        ctx.comm,
        [0],
        tag=TAG_VERDICT,
        timeout_s=ctx.cfg.xccl.poll_timeout_s,
        me=ctx.name,
        event="handshake verdict",
    )[0]
    if verdict:
        raise RuntimeError(f"{ctx.name}: startup refused by rank 0: {verdict}")


def _give_verdict(ctx: RankContext, hello: tuple) -> None:
    """Rank 0: collect every rank's hello, compare it with its own, and send every rank the
    same verdict ("" = go on) so that all of them stop together when one disagrees."""
    timeout_s = ctx.cfg.xccl.poll_timeout_s
    others = range(1, ctx.comm.size)
    hellos = recv_from_each(
        ctx.comm, others, tag=TAG_HELLO, timeout_s=timeout_s, me=ctx.name, event="handshake hello"
    )
    verdict = "; ".join(_disagreements(ctx, hello[0], hellos))
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


def _disagreements(ctx: RankContext, digest: str, hellos: dict) -> list[str]:
    """Every rank whose config digest differs from rank 0's `digest`, then every rank that sees
    itself elsewhere than rank 0's topology puts it."""
    problems = [
        f"rank {r} loaded config {their_digest}, rank 0 loaded {digest}"
        for r, (their_digest, _) in hellos.items()
        if their_digest != digest
    ]
    problems += [
        f"rank {r} sees itself as {info}, rank 0 expects {ctx.topo.ranks[r]}"
        for r, (_, info) in hellos.items()
        if info != ctx.topo.ranks[r]
    ]
    return problems
