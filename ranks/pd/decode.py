"""The decode dies of a PD deployment: a colocated die (ranks/colocated/die.py) or an attention die
of disaggregated MoE-attention (ranks/afd/attention.py) whose requests arrive already prefilled,
with their latent KV over XCCL p2p (ranks/pd/receive.py), instead of as prompts. Their
iterations, experts, recomputation and output shortcut are the base dies' own; the KV transfers
move between iterations, and a request's first token (the prefill's) streams with the tokens of
its first decode step."""

from __future__ import annotations

from mpi4py import MPI

from ranks.afd.attention import AttentionDie
from ranks.colocated.die import ColocatedDie
from ranks.core.context import RankContext
from ranks.core.die_io import serve
from ranks.core.handshake import handshake
from ranks.pd.receive import KvReceiver


def run_colocated(ctx: RankContext) -> None:
    handshake(ctx)
    serve(PdColocatedDie(ctx))


def run_attention(ctx: RankContext) -> None:
    handshake(ctx)
    serve(PdAttentionDie(ctx))


class PdDecode:
    """What a PD decode die adds to its base die's step: the KV transfers move before the dies
    agree (a request joins the batch only once its KV is here), and the prefill's first tokens
    stream with the tokens of the request's first decode step."""

    kv: KvReceiver

    def granted_by(self, ctx: RankContext) -> dict:
        """Virtual clock: the decode TE-shell grants this die its tasks, whose KV moves before
        the next iteration (ranks/shell/pd_pacers.py)."""
        return {"shell": ctx.plan.pd.decode_shell, "take": lambda task: self.kv.take(task)}

    def news_sent(self) -> int:
        """Virtual clock: the decode TE-shell balances on the completions this die sent it."""
        return self.kv.num_done_sent

    def before_agree(self) -> None:
        self.kv.step()

    def emit(self, emitted, timing) -> None:
        self.outbox.stream(self.kv.take_first_tokens(timing.vtime_s) + emitted, timing)
        self.kv.completed(emitted, self.clock.now_ns / 1e9)

    def close(self) -> None:
        self.kv.drain()
        super().close()

    def leave(self) -> None:
        """A lost decode die at the job's end (ranks/recovery/decode_loss.py): what the decode
        TE-shell and the prefill dies sent it meanwhile (tasks, pings, probes) taken too."""
        super().leave()
        comm = self.outbox.comm
        while (message := comm.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)) is not None:
            message.recv()
        self.kv.drain()


class PdColocatedDie(PdDecode, ColocatedDie):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.kv = KvReceiver(ctx, self.mem, self.scheduler, self.executor)

    def before_agree(self) -> None:
        if self.memory is not None:  # §6.2 stage 3 (ranks/recovery/memory.py), before KV moves
            self.memory.check(self, self.busy_iterations)
        super().before_agree()


class PdAttentionDie(PdDecode, AttentionDie):
    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.kv = KvReceiver(ctx, self.mem, self.scheduler, self.executor)
