"""A die's decode scheduler (policy only: it never computes).

Continuous batching: requests join between iterations when the batch has room and the KV pool can
hold their whole reservation (prompt + max_new_tokens), and leave when done. Each iteration holds
one decode row per running request plus prompt chunks of joining requests, within the dispatch
buffers' token budget (xccl.max_tokens_per_die) and scheduler.prefill_chunk_tokens.

With MTP (xDeepServe §4.6) a decoding request's row is [last token, its D drafts]: the verify
step. The MTP passes that draft the next step's tokens run after the main model in the same
iteration over the positions just committed, plus up to k - 1 older ones at depth k, so every
entry also holds D - 1 rows of headroom in the budget.

Nothing here is committed before `postprocess`: a failed iteration `restore`s the `checkpoint`
taken before `schedule` (token recomputation, §6.2) and schedules the same batch again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.workload.requests import Request, kv_tokens_needed


@dataclass(kw_only=True)
class Sequence:
    req: Request
    tokens: list[int]  # prompt + generated
    num_prefilled: int = 0
    num_generated: int = 0
    drafts: tuple[int, ...] = ()  # MTP drafts to verify in the next step

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < len(self.req.prompt)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One sequence's rows in an iteration's batch."""

    req_id: int
    start_pos: int
    input_ids: tuple[int, ...]
    is_sampled: bool  # its last row yields the next token
    num_drafts: int = 0  # input_ids[1:] are MTP drafts to verify
    context: tuple[int, ...] = ()  # with MTP: every token known (prompt + generated)


@dataclass(frozen=True, kw_only=True)
class Sampled:
    """What one iteration produced for a sampled entry: the accepted drafts followed by one
    main-model token, and the MTP drafts for the next step."""

    tokens: tuple[int, ...]
    drafts: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """The scheduler at the start of an iteration (what `schedule` changes)."""

    waiting: tuple
    num_prefilled: dict
    reserved_blocks: int
    table: object
    prefix_hits: dict | None = None


@dataclass(frozen=True, kw_only=True)
class VerifiedDrafts:
    """One MTP decode step of one request: the drafts it verified and how many of them the main
    model accepted, before the cut at max_new_tokens or EOS (as the reference counts them). The
    prefill's sampled token is no step."""

    req_id: int
    drafts: tuple[int, ...]
    num_accepted: int


@dataclass(kw_only=True)
class Emitted:
    req_id: int
    token: int
    is_finished: bool
    step: VerifiedDrafts | None = None  # on a decode step's first token: what the step verified


@dataclass(kw_only=True)
class DieScheduler:
    """prefix_hits (the EMS context cache, ranks/ems/client.py; None without it): req_id ->
    (cached tokens, write(slots)) of a request whose leading blocks were pulled from the pool:
    on admission its first KV slots are written with them and its prefill starts after them
    (chunked prefill's path: a chunk on top of earlier KV)."""

    table: BlockTable
    max_batch: int
    max_tokens: int  # rows per iteration (dispatch buffer limit)
    prefill_chunk: int
    eos_id: int
    ignore_eos: bool = False
    mtp_depth: int = 0
    waiting: deque = field(default_factory=deque)
    running: dict = field(default_factory=dict)  # req_id -> Sequence
    reserved_blocks: int = 0
    num_cancelled: int = 0  # requests the TE-shell cancelled (serve)
    num_cancelled_blocks: int = 0  # KV blocks they held, freed
    prefix_hits: dict | None = None

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def drop(self, req_id: int):
        """Take a running request out: its KV blocks and its reservation are freed; returns its
        sequence (a finished request, or one whose KV a memory fault took)."""
        seq = self.running.pop(req_id)
        self.table.free(req_id)
        self.reserved_blocks -= self._blocks(seq.req)
        return seq

    def cancel(self, req_id: int) -> bool:
        """Drop a request the TE-shell cancelled, waiting or running (its KV blocks freed);
        False when it is not here (not arrived yet, or finished)."""
        if req_id in self.running:
            self.num_cancelled_blocks += len(self.table.blocks(req_id))
            self.drop(req_id)
        elif any(req.req_id == req_id for req in self.waiting):
            self.waiting = deque(req for req in self.waiting if req.req_id != req_id)
        else:
            return False
        self.num_cancelled += 1
        return True

    def _blocks(self, req: Request) -> int:
        return -(-kv_tokens_needed(req, self.mtp_depth) // self.table.block_tokens)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            need = self._blocks(self.waiting[0])
            if self.reserved_blocks + need > self.table.num_blocks:
                return
            req = self.waiting.popleft()
            self.reserved_blocks += need
            self.table.allocate(req.req_id, 0)
            seq = self.running[req.req_id] = Sequence(req=req, tokens=list(req.prompt))
            hit = self.prefix_hits.pop(req.req_id, None) if self.prefix_hits else None
            if hit is not None:
                num_tokens, write = hit
                self.table.append(req.req_id, num_tokens)
                write(self.table.slots(req.req_id, 0, num_tokens))
                seq.num_prefilled = num_tokens

    def schedule(self) -> list[Entry]:
        """The next iteration's batch: decode rows first, then prompt chunks."""
        self._admit()
        entries, budget = [], self.max_tokens
        headroom = max(self.mtp_depth - 1, 0)  # MTP depth k runs up to k - 1 more rows
        for seq in self.running.values():
            ids = (seq.tokens[-1], *seq.drafts)
            if not seq.is_prefilling and len(ids) + headroom <= budget:
                self.table.append(seq.req.req_id, len(ids))
                entries.append(
                    Entry(
                        req_id=seq.req.req_id,
                        start_pos=len(seq.tokens) - 1,
                        input_ids=ids,
                        is_sampled=True,
                        num_drafts=len(seq.drafts),
                        context=self._context(seq),
                    )
                )
                budget -= len(ids) + headroom
        for seq in self.running.values():
            if seq.is_prefilling and budget > headroom:
                start = seq.num_prefilled
                num = min(len(seq.req.prompt) - start, self.prefill_chunk, budget - headroom)
                self.table.append(seq.req.req_id, num)
                seq.num_prefilled += num
                entries.append(
                    Entry(
                        req_id=seq.req.req_id,
                        start_pos=start,
                        input_ids=tuple(seq.req.prompt[start : start + num]),
                        is_sampled=not seq.is_prefilling,
                        context=self._context(seq),
                    )
                )
                budget -= num + headroom
        return entries

    def _context(self, seq: Sequence) -> tuple[int, ...]:
        return tuple(seq.tokens) if self.mtp_depth else ()

    def postprocess(self, sampled: dict[int, Sampled]) -> list[Emitted]:
        """Commit each sampled entry's tokens (as the reference: at most max_new_tokens, up to
        EOS) and drop the KV entries of rejected drafts; finished requests leave and free their
        KV blocks. With MTP a decode step's first token carries the drafts the step verified."""
        emitted = []
        for req_id, out in sampled.items():
            seq = self.running[req_id]
            step = (
                VerifiedDrafts(req_id=req_id, drafts=seq.drafts, num_accepted=len(out.tokens) - 1)
                if seq.num_generated and self.mtp_depth
                else None
            )
            self.table.truncate(req_id, len(seq.tokens) - 1 + len(out.tokens))
            tokens = out.tokens[: seq.req.max_new_tokens - seq.num_generated]
            ignore_eos = self.ignore_eos or seq.req.ignore_eos
            if not ignore_eos and self.eos_id in tokens:
                tokens = tokens[: tokens.index(self.eos_id) + 1]
            seq.tokens.extend(tokens)
            seq.num_generated += len(tokens)
            seq.drafts = out.drafts
            is_finished = seq.num_generated >= seq.req.max_new_tokens or (
                tokens[-1] == self.eos_id and not ignore_eos
            )
            if is_finished:
                self.drop(req_id)
            emitted.extend(
                Emitted(
                    req_id=req_id,
                    token=token,
                    is_finished=is_finished and i == len(tokens) - 1,
                    step=None if i else step,
                )
                for i, token in enumerate(tokens)
            )
        return emitted

    def checkpoint(self) -> Checkpoint:
        """Everything `schedule` changes, taken before it (see `restore`)."""
        return Checkpoint(
            waiting=tuple(self.waiting),
            num_prefilled={r: s.num_prefilled for r, s in self.running.items()},
            reserved_blocks=self.reserved_blocks,
            table=self.table.snapshot(),
            prefix_hits=None if self.prefix_hits is None else dict(self.prefix_hits),
        )

    def restore(self, cp: Checkpoint) -> None:
        """Back to `cp`: admissions undone, prompt progress and KV lengths as they were."""
        self.waiting = deque(cp.waiting)
        self.running = {r: s for r, s in self.running.items() if r in cp.num_prefilled}
        for req_id, seq in self.running.items():
            seq.num_prefilled = cp.num_prefilled[req_id]
        self.reserved_blocks = cp.reserved_blocks
        self.table.restore(cp.table)
        if cp.prefix_hits is not None:  # an undone admission writes its pulled blocks again
            self.prefix_hits = dict(cp.prefix_hits)
