"""The decode dies of a PD deployment: a colocated die (ranks/colocated.py) or an attention die
of disaggregated MoE-attention (ranks/attention.py) whose requests arrive already prefilled,
with their latent KV over XCCL p2p (ranks/pd_receive.py), instead of as prompts. Their
iterations, experts, recomputation and output shortcut are the base dies' own; the KV transfers
move between iterations, and a request's first token (the prefill's) streams with the tokens of
its first decode step."""

from __future__ import annotations

import time

from ranks.attention import IDLE, AttentionDie
from ranks.colocated import ColocatedDie
from ranks.context import RankContext
from ranks.pd_receive import KvReceiver


class PdColocatedDie(ColocatedDie):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.kv = KvReceiver(ctx, self.mem, self.scheduler, self.executor)

    def step(self) -> bool:
        """As ColocatedDie.step, with the KV transfers moved before the dies agree: a request
        joins the batch only once its KV is here."""
        self.inbox.poll()  # the stop from the JE
        self.kv.step()
        busy, all_stopped = self.agree()
        if not busy:
            time.sleep(0.001)
            return not all_stopped
        sampled, timing = self.iteration()
        emitted = self.scheduler.postprocess(sampled)
        self.executor.commit({e.req_id for e in emitted if e.is_finished})
        self.outbox.stream(self.kv.take_first_tokens(timing.vtime_s) + emitted, timing)
        self.kv.completed(emitted)
        return True

    def close(self) -> None:
        self.kv.drain()
        super().close()


class PdAttentionDie(AttentionDie):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.kv = KvReceiver(ctx, self.mem, self.scheduler, self.executor)

    def step(self) -> bool:
        """As AttentionDie.step, with the KV transfers moved before the dies agree."""
        self.inbox.poll()
        self.kv.step()
        busy, all_stopped = self.agree(self.scheduler.num_active, not self.inbox.is_stopped)
        if not busy:
            time.sleep(0.001)
            return not all_stopped
        result = self.run_iteration(busy, state=(self.scheduler, self.executor))
        if result is None:  # the other domains took their turn
            self.outbox.stream([], IDLE)
            return True
        sampled, timing = result
        emitted = self.scheduler.postprocess(sampled)
        self.executor.commit({e.req_id for e in emitted if e.is_finished})
        self.outbox.stream(self.kv.take_first_tokens(timing.vtime_s) + emitted, timing)
        self.kv.completed(emitted)
        return True

    def close(self) -> None:
        self.kv.drain()
        super().close()
