"""Prefill on the prefill dies (xDeepServe §4.3 "Prefill DP load balancing", §5.1 steps 2-3).

`PrefillScheduler` is the decode scheduler's continuous batching limited to prompts: a request
reserves only its prompt's KV blocks, and when its prompt is done it leaves the batch holding
those blocks (a PD-transfer task) until its KV transfer completes (`release`). A die whose KV is
full stops admitting: the leader sees it in the die's status.

`assign` is the single-level collaborative scheduler's decision at the leader (prefill DP-0):
the pending requests are shared by every prefill DP group; each step the leader has every
group's status and hands out requests with a cost model, the tokens each group still has to
compute (less what the EMS pool holds for it, when there is one), never mixing long and short
prompts on one group.
"""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.scheduling.scheduler import DieScheduler, Sampled, Sequence
from xds_mpi.workload.requests import Request


@dataclass(frozen=True, kw_only=True)
class PrefillStatus:
    """One prefill DP group at a step: free_blocks (not reserved), room (requests it may still
    take into its batch), queued_tokens (prompt tokens assigned, not yet computed), length_class
    (0 short, 1 long, -1 idle) of what it holds."""

    free_blocks: int
    room: int
    queued_tokens: int
    length_class: int


@dataclass(frozen=True, kw_only=True)
class Prefilled:
    """A request whose prompt is done: its first token; is_finished when that token ends it
    (max_new_tokens 1, or EOS), else it waits for its KV transfer holding its blocks."""

    seq: Sequence
    token: int
    drafts: tuple[int, ...]
    is_finished: bool


def length_class(req: Request, long_prompt_tokens: int) -> int:
    return int(bool(long_prompt_tokens) and len(req.prompt) >= long_prompt_tokens)


def blocks_for_prompt(req: Request, block_tokens: int) -> int:
    return -(-len(req.prompt) // block_tokens)


def assign(
    pending: list[Request],
    statuses: list[PrefillStatus],
    *,
    block_tokens: int,
    long_prompt_tokens: int,
    step_tokens: int,
    cached: dict[int, int] | None = None,
) -> tuple[list[list[Request]], list[Request]]:
    """Hand pending requests (in arrival order) to prefill DP groups: each to the group with the
    fewest tokens left to compute that has room and free blocks for its prompt, holds no
    request of the other length class, and has less than `step_tokens` (one step's rows) queued
    (an idle group always takes one): the rest stays shared for the next step, so a group that
    frees up takes it. cached: req_id -> prompt tokens the EMS pool holds for it (the leader's
    probe, docs/ems.md): not to compute, so not in the cost. Returns (requests per group, still
    pending)."""
    free = [s.free_blocks for s in statuses]
    room = [s.room for s in statuses]
    cost = [s.queued_tokens for s in statuses]
    kind = [s.length_class for s in statuses]
    batches: list[list[Request]] = [[] for _ in statuses]
    left = []
    for req in pending:
        need, cls = blocks_for_prompt(req, block_tokens), length_class(req, long_prompt_tokens)
        tokens = len(req.prompt) - (cached or {}).get(req.req_id, 0)
        fits = [
            g
            for g in range(len(statuses))
            if room[g] > 0
            and free[g] >= need
            and kind[g] in (-1, cls)
            and (cost[g] == 0 or cost[g] + tokens <= step_tokens)
        ]
        if not fits:
            left.append(req)
            continue
        g = min(fits, key=lambda g: (cost[g], g))
        batches[g].append(req)
        free[g], room[g], kind[g] = free[g] - need, room[g] - 1, cls
        cost[g] += tokens
    return batches, left


class PrefillScheduler(DieScheduler):
    """Prompts only; finished prompts keep their blocks until `release`. A request whose leading
    blocks were pulled from the EMS pool starts after them (`DieScheduler.prefix_hits`)."""

    def _blocks(self, req: Request) -> int:
        return blocks_for_prompt(req, self.table.block_tokens)

    def status(self, long_prompt_tokens: int) -> PrefillStatus:
        held = [s.req for s in self.running.values()] + list(self.waiting)
        classes = {length_class(r, long_prompt_tokens) for r in held}
        return PrefillStatus(
            free_blocks=self.table.num_blocks - self.reserved_blocks,
            room=self.max_batch - len(self.running) - len(self.waiting),
            queued_tokens=sum(len(r.prompt) for r in self.waiting)
            + sum(len(s.req.prompt) - s.num_prefilled for s in self.running.values()),
            length_class=max(classes) if len(classes) == 1 else -1,
        )

    def postprocess(self, sampled: dict[int, Sampled]) -> list[Prefilled]:
        """Each sampled entry finished its prompt: it leaves the batch with its first token (as
        the reference: EOS or max_new_tokens 1 ends it here and frees its blocks)."""
        done = []
        for req_id, out in sampled.items():
            seq = self.running.pop(req_id)
            token = out.tokens[0]
            is_finished = seq.req.max_new_tokens == 1 or (
                token == self.eos_id and not (self.ignore_eos or seq.req.ignore_eos)
            )
            seq.tokens.append(token)
            seq.num_generated = 1
            if is_finished:
                self.release(seq.req)
            done.append(Prefilled(seq=seq, token=token, drafts=out.drafts, is_finished=is_finished))
        return done

    def release(self, req: Request) -> None:
        """Step 8 on the prefill side: the transfer completed (or was never needed)."""
        self.table.free(req.req_id)
        self.reserved_blocks -= self._blocks(req)
