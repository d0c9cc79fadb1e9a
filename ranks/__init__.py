"""Role programs: one per role a rank can play. `role_program(role)(ctx)` runs a rank.

Every program starts with the startup handshake (all ranks agree on config and topology). The
colocated deployment serves requests (ranks/colocated/die.py, ranks/shell/frontend.py), and so does
the
disaggregated MoE-attention one (ranks/afd/attention.py, ranks/afd/expert.py); with `pd.enabled` the
host rank is the JE (ranks/shell/je.py) and prefill dies prefill (ranks/pd/prefill.py) for decode
dies that
receive the KV cache (ranks/pd/decode.py); without it prefill dies end after the handshake.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ranks.core.context import RankContext

# The module whose run(ctx) plays each role. Imported only by the ranks that play it, so ranks
# that do not compute the model never load the model's modules (no rank imports torch).
ROLE_MODULES = {
    "host": "ranks.shell.te_shell",
    "attention": "ranks.afd.attention",
    "expert": "ranks.afd.expert",
    "colocated": "ranks.colocated.die",
    "prefill": "ranks.pd.prefill",
}


def role_program(role: str) -> Callable[[RankContext], int | None]:
    """run(ctx) -> exit code (None = 0) of the program for `role`."""
    return importlib.import_module(ROLE_MODULES[role]).run


__all__ = ["ROLE_MODULES", "RankContext", "role_program"]
