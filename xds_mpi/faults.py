"""Where injected XCCL errors strike (xDeepServe §6.2 stage 3): the `faults` section as decisions.

A FaultPlan answers, for one die, "does this call of this operation fail?" (pure Python, no MPI):
  table rows  fire on their die, op, layer and iteration, on attempts 0 .. times - 1 of that
              iteration (attempt 0 = its first execution), so times = 1 is a transient error
              that the re-execution clears and a large `times` a persistent one;
  rate        every call of an operation in `ops` fails with probability `rate`, drawn from a
              generator seeded by (seed, die, op, iteration, layer, attempt, call): the same
              config replays the same faults, and a re-execution draws afresh.
Table rows are explicit and ignore `ops`; `ops` filters the random mode only.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

import numpy as np

from xccl.faults import FaultHook, injector
from xds_mpi.config import FAULT_OPS, FaultsConfig

RANDOM_CODE = 1          # the error code of a fault drawn by the random mode


class FaultPlan:
    def __init__(self, cfg: FaultsConfig, die: int) -> None:
        self.cfg, self.die = cfg, die
        self.rows = [row for row in cfg.table if row.die == die]
        self.random_ops = frozenset(cfg.ops) if cfg.rate > 0 else frozenset()
        self.fired: Counter[str] = Counter()          # op -> decisions that fired

    @property
    def num_fired(self) -> int:
        return sum(self.fired.values())

    def decide(self, op: str, *, iteration: int, layer: int, attempt: int, call: int = 0
               ) -> int | None:
        """The error code if this call fails, else None. call: which call of `op` at this layer
        in this attempt (0 = the first), so calls of one layer draw independently."""
        if op not in FAULT_OPS:
            raise ValueError(f"die {self.die}: unknown operation {op!r} "
                             f"(known: {', '.join(FAULT_OPS)})")
        for row in self.rows:
            if (row.op, row.layer, row.iteration) == (op, layer, iteration) and attempt < row.times:
                self.fired[op] += 1
                return row.code
        if op in self.random_ops:
            seed = (self.cfg.seed, self.die, FAULT_OPS.index(op), iteration, layer, attempt, call)
            if np.random.default_rng(seed).random() < self.cfg.rate:
                self.fired[op] += 1
                return RANDOM_CODE
        return None

    def hook(self, *, iteration: int, attempt: int, layer_of: Callable[[int], int]) -> FaultHook:
        """A fault hook for this die's XCCL buffers during one attempt (a fresh one per attempt).

        layer_of(event_id) -> the MoE layer of an operation's event id. The hook numbers the
        calls of each (op, layer) in the order they come and raises InjectedFault when decide()
        names a code."""
        calls: Counter[tuple[str, int]] = Counter()

        def decide(op: str, event_id: int) -> int | None:
            layer = layer_of(event_id)
            call = calls[op, layer]
            calls[op, layer] += 1
            return self.decide(op, iteration=iteration, layer=layer, attempt=attempt, call=call)
        return injector(self.die, decide)
