"""Role programs: one per role a rank can play. `role_program(role, is_pd=...)(ctx)` runs a rank.

Every program starts with the startup handshake (all ranks agree on config and topology).
- host: the TE-shell (ranks/shell/): the frontend of a colocated or afd deployment; with PD, host
  rank 0 is the JE and host rank 1 the decode TE-shell.
- colocated (ranks/colocated/): attention for its DP group plus expert slots (Figure 10).
- attention, expert (ranks/afd/): disaggregated MoE-attention (§5.2).
- prefill (ranks/pd/prefill.py): prefill dies, idle without PD; with PD the decode dies receive
  the KV cache (ranks/pd/decode.py) instead of prefilling in chunks.
- pool (ranks/ems/pool.py): an EMS pool rank (`ems.enabled`, PD only): no die, its window
  stands for CPU DRAM holding KV blocks the prefill dies pull (docs/ems.md).
- je (ranks/cluster/je.py): a cluster's job executor (`cluster.num_tes` > 1, docs/cluster.md),
  world rank 0: routes the requests to the TEs, whose ranks play the roles above.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ranks.core.context import RankContext

# "module:function" that plays each role, without and with PD. Imported only by the ranks that
# play it, so a rank imports only its own role's code.
ROLE_PROGRAMS = {
    "host": ("ranks.shell.te_shell:run", "ranks.shell.te_shell:run"),
    "colocated": ("ranks.colocated.die:run", "ranks.pd.decode:run_colocated"),
    "attention": ("ranks.afd.attention:run", "ranks.pd.decode:run_attention"),
    "expert": ("ranks.afd.expert:run", "ranks.afd.expert:run"),
    "prefill": ("ranks.pd.prefill:run", "ranks.pd.prefill:run"),
    "pool": ("ranks.ems.pool:run", "ranks.ems.pool:run"),
    "je": ("ranks.cluster.je:run", "ranks.cluster.je:run"),
}


def role_program(role: str, *, is_pd: bool) -> Callable[[RankContext], int | None]:
    """run(ctx) -> exit code (None = 0) of the program for `role` (`is_pd`: pd.enabled)."""
    module, function = ROLE_PROGRAMS[role][is_pd].split(":")
    return getattr(importlib.import_module(module), function)


__all__ = ["ROLE_PROGRAMS", "RankContext", "role_program"]
