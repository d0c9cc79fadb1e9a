"""A colocated die's side of virtual-time serving (run.clock virtual, docs/virtual_time.md).

The colocated dies run every iteration together (they meet at each MoE layer's dispatch and
combine), so they also start it together, at the common start the agreement gives
(ranks/colocated/die.py `agree`), and only before the earliest horizon. The die's part of it is
the one every request-taking die shares, `DieVirtualTime` (ranks/core/virtual_time.py): the afd
attention dies (ranks/afd/) keep the same rule.
"""

from __future__ import annotations

from ranks.core.virtual_time import DieVirtualTime

__all__ = ["DieVirtualTime"]
