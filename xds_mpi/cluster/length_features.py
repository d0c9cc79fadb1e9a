"""What the JE knows of a request at its arrival, as numbers (DeepServe §5.3.3;
docs/decode_length.md): the features `length_model` classifies into 128-token output buckets.

The trace gives no prompt text, only lengths and the ids of 512-token prompt blocks (equal
leading ids: a shared prefix, e.g. the earlier turns of the same conversation). So a request's
features are its prompt length and what earlier requests sharing its prefix tell: how many
leading blocks it shares with any earlier arrival, how much its prompt grew since the one it
shares most with, and the output lengths of earlier requests on its prefix -- a conversation's
previous turns.

Causality. `PrefixHistory` is fed the requests in arrival order (`observe`: the features of a
request, then it joins the history). Its prompt and blocks are known from its arrival on; its
output length only from `arrival_s + known_after_s` on (the rule: an earlier request's output
counts as known once it arrived at least `known_after_s` seconds before; a conservative stand-in
for "it has finished", which the JE sees only later in a run). A request never reads its own
output, and no request reads one that arrives after it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from xds_mpi.workload.requests import Request

FEATURE_NAMES = (
    "log_prompt",  # log1p(prompt tokens)
    "log_shared_blocks",  # log1p(leading blocks shared with any earlier arrival)
    "shared_share",  # those blocks' tokens / prompt tokens, at most 1
    "log_growth",  # log1p(prompt - the prompt of the latest arrival sharing the most), >= 0
    "has_known",  # 1 when an earlier request on the prefix has a known output
    "known_blocks",  # leading blocks shared with the deepest such request (0: none)
    "log_known_last",  # log1p(its output: the latest known one on that deepest prefix)
    "log_known_mean",  # the mean log1p(output) of the known ones on that prefix
    "log_known_count",  # log1p(how many they are)
)
NUM_FEATURES = len(FEATURE_NAMES)


@dataclass
class _Known:
    """The known outputs of the requests whose prompt holds one prefix (a chain of blocks)."""

    last_log: float = 0.0
    sum_log: float = 0.0
    count: int = 0

    def add(self, output_len: int) -> None:
        self.last_log = math.log1p(output_len)
        self.sum_log += self.last_log
        self.count += 1


def prefix_chain(block_ids: tuple[int, ...]) -> list[int]:
    """One key per leading prefix: key k stands for blocks 0..k (equal keys, equal prefixes)."""
    keys, key = [], 0
    for block_id in block_ids:
        key = hash((key, block_id))
        keys.append(key)
    return keys


class PrefixHistory:
    """The requests seen so far, by prefix, fed in arrival order (module docstring: causality).

    block_tokens: trace tokens per block id (Mooncake: 512); known_after_s: seconds after its
    arrival from which a request's output length counts as known."""

    def __init__(self, *, block_tokens: int = 512, known_after_s: float = 60.0) -> None:
        if block_tokens < 1 or known_after_s < 0:
            raise ValueError(
                f"block_tokens({block_tokens}) must be >= 1 and known_after_s({known_after_s}) >= 0"
            )
        self.block_tokens, self.known_after_s = block_tokens, known_after_s
        self.arrived: dict[int, int] = {}  # prefix key -> prompt tokens of its latest arrival
        self.known: dict[int, _Known] = {}  # prefix key -> the known outputs on it
        self.pending: deque[tuple[float, list[int], int]] = deque()  # (known at, keys, output)
        self.now_s = -math.inf

    def observe(self, req: Request) -> np.ndarray:
        """[NUM_FEATURES] float64: `req`'s features at its arrival; then `req` joins the history.
        Refused (ValueError) when `req` arrives before the last request observed."""
        if req.arrival_s < self.now_s:
            raise ValueError(
                f"request {req.req_id} arrives at {req.arrival_s:g} s, before the last one "
                f"observed ({self.now_s:g} s): feed the history in arrival order"
            )
        self.now_s = req.arrival_s
        self._release(req.arrival_s)
        keys = prefix_chain(req.block_ids)
        features = self._features(req, keys)
        for key in keys:
            self.arrived[key] = req.priced_prompt_len
        self.pending.append((req.arrival_s + self.known_after_s, keys, req.priced_output_len))
        return features

    def _release(self, now_s: float) -> None:
        """The outputs known by `now_s` join `known` (pending is in known-at order: FIFO)."""
        while self.pending and self.pending[0][0] <= now_s:
            _, keys, output_len = self.pending.popleft()
            for key in keys:
                self.known.setdefault(key, _Known()).add(output_len)

    def _features(self, req: Request, keys: list[int]) -> np.ndarray:
        prompt = req.priced_prompt_len
        num_shared = 0
        while num_shared < len(keys) and keys[num_shared] in self.arrived:
            num_shared += 1
        growth = prompt - self.arrived[keys[num_shared - 1]] if num_shared else 0
        # the deepest prefix with a known output (known implies arrived: inside the shared part)
        depth = num_shared
        while depth and keys[depth - 1] not in self.known:
            depth -= 1
        known = self.known[keys[depth - 1]] if depth else _Known()
        return np.array(
            [
                math.log1p(prompt),
                math.log1p(num_shared),
                min(num_shared * self.block_tokens / max(prompt, 1), 1.0),
                math.log1p(max(growth, 0)),
                float(depth > 0),
                float(depth),
                known.last_log,
                known.sum_log / known.count if known.count else 0.0,
                math.log1p(known.count),
            ]
        )


def history_features(
    requests: list[Request], *, block_tokens: int = 512, known_after_s: float = 60.0
) -> np.ndarray:
    """[len(requests), NUM_FEATURES]: each request's features, fed in the order given (which
    must be arrival order) to one fresh history."""
    history = PrefixHistory(block_tokens=block_tokens, known_after_s=known_after_s)
    rows = [history.observe(req) for req in requests]
    return np.array(rows).reshape(len(requests), NUM_FEATURES)
