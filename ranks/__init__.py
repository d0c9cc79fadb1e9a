"""Role programs: one per role a rank can play. `ROLE_PROGRAMS[role](ctx)` runs a rank.

Every program starts with the startup handshake (all ranks agree on config and topology). The
decode step loops of each role land with the decode issues; until then a die's program ends after
the handshake and the TE-shell reports the deployment it brought up.
"""
from __future__ import annotations

from typing import Callable

from ranks.context import RankContext
from ranks import die, shell

ROLE_PROGRAMS: dict[str, Callable[[RankContext], None]] = {
    "host": shell.run,
    "attention": die.run,
    "expert": die.run,
    "colocated": die.run,
    "prefill": die.run,
}

__all__ = ["ROLE_PROGRAMS", "RankContext"]
