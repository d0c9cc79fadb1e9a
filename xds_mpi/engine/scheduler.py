"""A die's decode scheduler (policy only: it never computes).

Continuous batching: requests join between iterations when the batch has room and the KV pool can
hold their whole reservation (prompt + max_new_tokens), and leave when done. Each iteration holds
one decode row per running request plus prompt chunks of joining requests, within the dispatch
buffers' token budget (xccl.max_tokens_per_die) and scheduler.prefill_chunk_tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from xds_mpi.engine.requests import Request, kv_tokens_needed
from xds_mpi.model.kv_blocks import BlockTable


@dataclass(kw_only=True)
class Sequence:
    req: Request
    tokens: list[int]                  # prompt + generated
    num_prefilled: int = 0
    num_generated: int = 0

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < len(self.req.prompt)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One sequence's rows in an iteration's batch."""

    req_id: int
    start_pos: int
    input_ids: tuple[int, ...]
    is_sampled: bool                   # its last row yields the next token


@dataclass(kw_only=True)
class Emitted:
    req_id: int
    token: int
    is_finished: bool


@dataclass(kw_only=True)
class DieScheduler:
    table: BlockTable
    max_batch: int
    max_tokens: int                    # rows per iteration (dispatch buffer limit)
    prefill_chunk: int
    eos_id: int
    ignore_eos: bool = False
    waiting: deque = field(default_factory=deque)
    running: dict = field(default_factory=dict)   # req_id -> Sequence
    reserved_blocks: int = 0

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _blocks(self, req: Request) -> int:
        return -(-kv_tokens_needed(req) // self.table.block_tokens)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            need = self._blocks(self.waiting[0])
            if self.reserved_blocks + need > self.table.num_blocks:
                return
            req = self.waiting.popleft()
            self.reserved_blocks += need
            self.table.allocate(req.req_id, 0)
            self.running[req.req_id] = Sequence(req=req, tokens=list(req.prompt))

    def schedule(self) -> list[Entry]:
        """The next iteration's batch: decode rows first, then prompt chunks."""
        self._admit()
        entries, budget = [], self.max_tokens
        for seq in self.running.values():
            if not seq.is_prefilling and budget > 0:
                pos = len(seq.tokens) - 1
                self.table.append(seq.req.req_id, 1)
                entries.append(Entry(req_id=seq.req.req_id, start_pos=pos,
                                     input_ids=(seq.tokens[-1],), is_sampled=True))
                budget -= 1
        for seq in self.running.values():
            if seq.is_prefilling and budget > 0:
                start = seq.num_prefilled
                num = min(len(seq.req.prompt) - start, self.prefill_chunk, budget)
                self.table.append(seq.req.req_id, num)
                seq.num_prefilled += num
                entries.append(Entry(req_id=seq.req.req_id, start_pos=start,
                                     input_ids=tuple(seq.req.prompt[start:start + num]),
                                     is_sampled=not seq.is_prefilling))
                budget -= num
        return entries

    def postprocess(self, tokens: dict[int, int]) -> list[Emitted]:
        """Record each sampled token; finished requests leave and free their KV blocks."""
        emitted = []
        for req_id, token in tokens.items():
            seq = self.running[req_id]
            seq.tokens.append(token)
            seq.num_generated += 1
            is_finished = (seq.num_generated >= seq.req.max_new_tokens or
                           (token == self.eos_id and not self.ignore_eos))
            if is_finished:
                del self.running[req_id]
                self.table.free(req_id)
                self.reserved_blocks -= self._blocks(seq.req)
            emitted.append(Emitted(req_id=req_id, token=token, is_finished=is_finished))
        return emitted

    def kv_used_tokens(self) -> int:
        return sum(self.table.seq_len(r) for r in self.running)
