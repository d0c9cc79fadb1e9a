"""A die's program until its role's decode loop lands: join the handshake, report, end."""

from __future__ import annotations

from ranks.context import RankContext
from ranks.handshake import handshake


def run(ctx: RankContext) -> None:
    handshake(ctx)
    info = ctx.info
    ctx.log.debug("ready at server %d chip %d die %d", info.server, info.chip, info.die_in_chip)
