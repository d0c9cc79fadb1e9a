"""Where injected XCCL errors strike (xDeepServe §6.2 stage 3): the `faults` section as decisions.

A FaultPlan answers, for one die, "does this call of this operation fail?" (pure Python, no MPI):
  table rows  fire on their die, op, layer and iteration, on attempts 0 .. times - 1 of that
              iteration (attempt 0 = its first execution), so times = 1 is a transient error
              that the re-execution clears and a large `times` a persistent one;
  rate        every call of an operation in `ops` fails with the per-call chance faults.rate
              comes to (xds_mpi/execution/fault_rates.py: a rate per iteration or die-hour is
              converted with the deployment's calls per iteration), drawn from a
              generator seeded by (seed, die, op, iteration, layer, attempt, call): the same
              config replays the same faults, and a re-execution draws afresh.
Table rows are explicit and ignore `ops`; `ops` filters the random mode only.

The plan is also the die's fault hook (`check`, installed once in its XCCL buffers): the die's
recomputer tells it which iteration and attempt run (`begin`), and an `EventMap` given at
construction turns an operation's event id into its MoE layer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from xccl.errors import InjectedFault
from xds_mpi.config.schema import FAULT_OPS, FaultsConfig
from xds_mpi.execution.fault_rates import chance_per_call

RANDOM_CODE = 1  # the error code of a fault drawn by the random mode


class EventMap(Protocol):
    """How a deployment numbers its XCCL operations' events."""

    def layer_of_event(self, event_id: int) -> int:
        """The MoE layer of an event id (MTP depth k: layer L + k - 1)."""


@dataclass(frozen=True, kw_only=True)
class LayerEvents:
    """One event per MoE layer per iteration, as the colocated executor numbers its dispatch
    and combine: event id = iteration x events_per_iteration + layer (L layers + D MTP depths)."""

    events_per_iteration: int

    def event_id(self, iteration: int, layer: int) -> int:
        return iteration * self.events_per_iteration + layer

    def layer_of_event(self, event_id: int) -> int:
        return event_id % self.events_per_iteration


class FaultPlan:
    def __init__(self, cfg: FaultsConfig, die: int, events: EventMap) -> None:
        self.cfg, self.die, self.events = cfg, die, events
        self.rows = [row for row in cfg.table if row.die == die]
        self.chance = chance_per_call(cfg, die)  # each call's, in the random mode
        self.random_ops = frozenset(cfg.ops) if self.chance > 0 else frozenset()
        self.fired: Counter[str] = Counter()  # op -> decisions that fired
        self.iteration = self.attempt = 0  # what runs now (`begin`)
        self.num_calls: Counter[tuple[str, int]] = Counter()  # (op, layer) -> calls so far

    @property
    def num_fired(self) -> int:
        return sum(self.fired.values())

    def decide(
        self, op: str, *, iteration: int, layer: int, attempt: int, call: int = 0
    ) -> int | None:
        """The error code if this call fails, else None. call: which call of `op` at this layer
        in this attempt (0 = the first), so calls of one layer draw independently."""
        if op not in FAULT_OPS:
            raise ValueError(
                f"die {self.die}: unknown operation {op!r} (known: {', '.join(FAULT_OPS)})"
            )
        for row in self.rows:
            if (row.op, row.layer, row.iteration) == (op, layer, iteration) and attempt < row.times:
                self.fired[op] += 1
                return row.code
        if op in self.random_ops:
            seed = (self.cfg.seed, self.die, FAULT_OPS.index(op), iteration, layer, attempt, call)
            if np.random.default_rng(seed).random() < self.chance:
                self.fired[op] += 1
                return RANDOM_CODE
        return None

    def begin(self, *, iteration: int, attempt: int) -> None:
        """An attempt of `iteration` starts (attempt 0 = its first execution): calls are
        numbered afresh."""
        self.iteration, self.attempt = iteration, attempt
        self.num_calls = Counter()

    def check(self, op: str, event_id: int) -> None:
        """The fault hook of this die's XCCL buffers (xccl/recovery/faults.py): numbers the calls of
        each (op, layer) of the attempt in the order they come and raises InjectedFault when
        decide() names a code."""
        layer = self.events.layer_of_event(event_id)
        call = self.num_calls[op, layer]
        self.num_calls[op, layer] += 1
        code = self.decide(
            op, iteration=self.iteration, layer=layer, attempt=self.attempt, call=call
        )
        if code is not None:
            raise InjectedFault(self.die, op, event_id, code)
