"""Startup handshake: rank 0 checks that every rank loaded the same config and sees itself where
rank 0's topology puts it, then tells every rank to go on (or why the job stops). Rank 0 also
learns where every rank runs (host name and MPI node), for the run file's rank table."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ranks.core.context import RankContext
from ranks.core.control import recv_from_each, send_to_each
from ranks.core.tags import TAG_HELLO, TAG_VERDICT


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one rank runs."""

    host: str  # Slurm's node name inside a job ($SLURMD_NODENAME), else the host name
    node: int  # the lowest world rank sharing this rank's memory node (MPI_COMM_TYPE_SHARED)


def handshake(ctx: RankContext) -> tuple[Placement, ...] | None:
    """Collective. Rank 0 returns every rank's placement; the other ranks None."""
    host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    hello = (ctx.config_digest(), ctx.info, Placement(host=host, node=ctx.node_leader))
    if ctx.comm.rank != 0:
        _await_verdict(ctx, hello)
        return None
    hellos = _give_verdict(ctx, hello)
    return (hello[2], *(hellos[r][2] for r in range(1, ctx.comm.size)))


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


def _give_verdict(ctx: RankContext, hello: tuple) -> dict:
    """Rank 0: collect every rank's hello, compare it with its own, and send every rank the
    same verdict ("" = go on) so that all of them stop together when one disagrees."""
    timeout_s = ctx.cfg.xccl.poll_timeout_s
    others = range(1, ctx.comm.size)
    hellos = recv_from_each(
        ctx.comm,
        others,
        tag=TAG_HELLO,
        timeout_s=timeout_s,
        me=ctx.name,
        event="handshake hello",
        log=ctx.log,
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
    return hellos


def _disagreements(ctx: RankContext, digest: str, hellos: dict) -> list[str]:
    """Every rank whose config digest differs from rank 0's `digest`, then every rank that sees
    itself elsewhere than rank 0's topology puts it."""
    problems = [
        f"rank {r} loaded config {their_digest}, rank 0 loaded {digest}"
        for r, (their_digest, _, _) in hellos.items()
        if their_digest != digest
    ]
    problems += [
        f"rank {r} sees itself as {info}, rank 0 expects {ctx.topo.ranks[r]}"
        for r, (_, info, _) in hellos.items()
        if info != ctx.topo.ranks[r]
    ]
    return problems
