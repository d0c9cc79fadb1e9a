"""The source TE's slowdown during an NPU-fork, charged on the virtual clock (docs/scaling.md
"The source's slowdown during a fork"; DeepServe §6.2): while its dies' windows are read, their
UB links carry the fork and their own dispatch and combine; the fork takes
`scaling.fork_link_share` of a link, so dispatch and combine take 1 / (1 - share) as long.
Compute is not slowed. `steps.source_slowdown` is the same factor seen on a whole iteration.

A source die holds the TE-Load windows of the forks that read it, (start, end) in virtual
seconds, (0, 0) for an unused slot; an iteration that starts inside one is charged.
"""

from __future__ import annotations

import numpy as np


def link_factor(share: float) -> float:
    """Dispatch's and combine's time factor while a fork takes `share` of the link."""
    if not 0 <= share < 1:
        raise ValueError(f"fork_link_share must be in [0, 1), got {share}")
    return 1.0 / (1.0 - share)


def is_forking(windows: np.ndarray, start_s: float) -> bool:
    """windows: [num_slots, 2] float64 (start, end) virtual s; an iteration starting at `start_s`
    overlaps a fork's TE-Load when start <= start_s < end for some slot."""
    return bool(np.any((windows[:, 0] <= start_s) & (start_s < windows[:, 1])))


def factor_at(windows: np.ndarray, start_s: float, share: float) -> float:
    """The dispatch/combine factor of an iteration starting at `start_s` (1: no fork then)."""
    return link_factor(share) if is_forking(windows, start_s) else 1.0
