"""A decode die of a PD deployment: a colocated die (ranks/colocated.py) whose requests arrive
already prefilled, with their latent KV over XCCL p2p (ranks/pd_receive.py), instead of as
prompts. Its iterations, experts, recomputation and output shortcut are the colocated die's."""

from __future__ import annotations

import time

from ranks.colocated import ColocatedDie
from ranks.context import RankContext
from ranks.pd_receive import KvReceiver


class PdColocatedDie(ColocatedDie):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.kv = KvReceiver(ctx, self.mem, self.scheduler, self.executor)

    def step(self) -> bool:
        """As ColocatedDie.step, with the KV transfers moved before the dies agree: a request
        joins the batch only once its KV is here; its first token (the prefill's) streams
        with the tokens of its first decode step."""
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
        return True

    def close(self) -> None:
        self.kv.drain()
        super().close()
