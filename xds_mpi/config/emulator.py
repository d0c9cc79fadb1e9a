"""The `emulator` section: how the emulator's own processes run (xDeepServe §4.4 applied to the
emulation: a rank pinned to a core, the garbage collector kept out of dispatch and combine).

Part of the config schema (`xds_mpi.config.schema` re-exports it); launch/job/rank.py applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xds_mpi.config.loader import positive


@dataclass(frozen=True, kw_only=True)
class EmulatorConfig:
    """pin_cores: "auto" pins each rank to one core when the node has at least as many cores as
    ranks on it, "always" pins round-robin even when it has fewer, "never" does not pin (not
    on/off: YAML reads those as booleans).
    gc: "controlled" freezes the objects of start-up and collects only between iterations,
    every gc_every iterations (never inside dispatch / combine); "default" leaves Python's GC
    (start-up's objects are frozen at the first iteration with either).
    """

    pin_cores: Literal["auto", "always", "never"] = "auto"
    # Off by default: on this 2-core machine, with more ranks than cores, controlled runs served
    # fewer tokens/s than Python's own GC (4 dies, alternated: docs/xccl.md, "The emulator's
    # own §4.4").
    gc: Literal["controlled", "default"] = "default"
    gc_every: int = 256  # §4.4: "after every few hundred forward passes"

    def __post_init__(self) -> None:
        positive("emulator", gc_every=self.gc_every)
