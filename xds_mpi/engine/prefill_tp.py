"""A prefill DP group of several dies (`deployment.prefill_tp`: xDeepServe §5.1's prefill TEs run
TP=4; CloudMatrix-Infer §4.3's hybrid parallelism: TP attention, EP MoE).

Every die of the group holds the group's whole batch (the same requests, the same latent KV:
MLA's latent is shared by every head, so each die keeps all of it and the leader sends it to
decode). Per layer:

    attention  die i computes heads [i H/tp, (i+1) H/tp): its query columns, scores and
               attention-weighted latents o_i [n, H/tp, kv_lora_rank]; the o_i are all-gathered
               (xccl/tp_gather.py, one-sided writes into the peers' windows) and every die
               applies the whole output projection to [o_0 | ... | o_tp-1] itself.
    MoE        die i dispatches rows [i n/tp, (i+1) n/tp) (its share, as many rows as the
               others within one), runs its experts, combines, adds the shared expert; the
               shares' outputs are all-gathered by rows.
    dense FFN  every die over every row (the tiny model's one dense layer; not split).

Why gather the heads' outputs, not all-reduce partial sums (Megatron's row-parallel o_proj):
the partial sums o_i W_o,i added across dies sum each output in another float order than one
product over all heads does, so TP=2 or 4 would move the last bits of the hidden state and,
through the argmax, tokens. Here every value a die computes is one the single-process reference
computes too: a head's query columns and its score and value rows come out of the batch-invariant
matmul bit for bit the same whatever other heads or rows are beside them
(tests/test_prefill_tp.py), the output projection is the reference's own product over all heads,
and a row's MoE never sees the other rows. The price: each die applies all of W_o (not 1/tp),
and the gather moves kv_lora_rank values per head and row (DeepSeek-V3: 512) where an
all-reduce moves hidden (7168) per row; both are on the virtual clock (`TpPricer`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from xccl.tp_gather import TpGather
from xccl.vclock import LinkModel
from xds_mpi.engine.executor import ColocatedExecutor
from xds_mpi.engine.pricing import Meter, Pricer
from xds_mpi.projection.cost import CostModel

WIRE_BYTES = 2  # the gathered values travel as BF16 at the cost shape


def row_bounds(num_rows: int, tp: int) -> list[int]:
    """Where each member's share of `num_rows` rows starts (and the end): sizes within one,
    the first members the larger."""
    base, extra = divmod(num_rows, tp)
    return [i * base + min(i, extra) for i in range(tp + 1)]


class TpPricer(Pricer):
    """A TP die's pricer: attention at H/tp heads (the query up-projection, absorbed W_UK and the
    scores; the latent cache is still read whole, it is every head's), the whole W_o, and the
    gathers on the UB link."""

    def __init__(self, *args, tp: int, link: LinkModel, same_server: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tp, self.link, self.same_server = tp, link, same_server
        m = self.cost.m
        self.cost_tp = CostModel(
            replace(m, num_heads=m.num_heads // tp), self.cost.hw, kv_int8=self.cost.kv_int8
        )
        self.wo_rest = (m.num_heads - m.num_heads // tp) * m.v_head_dim * m.hidden
        self.sent_ns: float | None = None  # the attention gather's peers, priced with it

    def attention_rows(self, seqs: list[tuple[int, int]], *, is_moe: bool) -> None:
        """This die's heads, then the gather of every die's (the peers stamped their records
        at the attention's start: every member computes the same rows, so waiting for that
        stamp before the compute is waiting for their end after it)."""
        scale = self.moe_scale if is_moe else self.dense_scale
        rows = sum(num for _, num in seqs)
        if self.sent_ns is not None:
            with self.waiting("tp gather"):
                self.clock.arrive(self.sent_ns)
            self.sent_ns = None
        self._add(
            "MLAProlog",
            scale * (self.cost_tp.mla_prolog(rows) + self.cost.gemm(rows, self.wo_rest)),
        )
        self._add("attention", scale * self.cost_tp.attention(seqs))
        m = self.cost.m
        self._gather_writes(scale, rows * (m.num_heads // self.tp) * m.kv_lora_rank)

    def rows_gathered(self, rows: int, sent_ns: float) -> None:
        """The MoE outputs' gather: this die's `rows` share, after the peers' stamps."""
        with self.waiting("tp gather"):
            self.clock.arrive(sent_ns)
        self._gather_writes(self.moe_scale, rows * self.cost.m.hidden)

    def _gather_writes(self, scale: float, values: int) -> None:
        """This die's piece of `values` written to each of the tp - 1 peers."""
        nbytes = (self.tp - 1) * values * WIRE_BYTES
        if nbytes:
            ns = self.link.transfer_ns(nbytes, same_server=self.same_server)
            self._add("tp gather", scale * ns / 1e9)


class TpPrefillExecutor(ColocatedExecutor):
    """A ColocatedExecutor whose attention and MoE are split over its TP group (module doc)."""

    def __init__(self, *args, gather: TpGather, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gather = gather
        self.tp, self.tp_idx = gather.layout.num_members, gather.me_idx

    def _attention(self, block, x: np.ndarray, positions, chunks, layer_idx: int) -> np.ndarray:
        attn = block.attn
        per_die = attn.num_heads // self.tp
        heads = slice(self.tp_idx * per_die, (self.tp_idx + 1) * per_die)
        o = attn.attend_heads(block.attn_norm(x), positions, chunks, self.cache, layer_idx, heads)
        got = self.gather.all_gather(
            o,
            [o.shape] * self.tp,
            self.events.event_id(self.num_iterations, layer_idx),
            f"attention layer {layer_idx}",
        )
        self.pricer.sent_ns = got.sent_ns
        return x + attn.project_out(np.concatenate(got.pieces, axis=1))  # [n, H, c] -> [n, hidden]

    def _moe(self, moe, h: np.ndarray, layer_idx: int, meter: Meter) -> np.ndarray:
        bounds = row_bounds(len(h), self.tp)
        lo, hi = bounds[self.tp_idx], bounds[self.tp_idx + 1]
        out = np.ascontiguousarray(super()._moe(moe, h[lo:hi], layer_idx, meter))
        with meter("xccl", "tp gather", layer=layer_idx):
            got = self.gather.all_gather(
                out,
                [(bounds[i + 1] - bounds[i], h.shape[1]) for i in range(self.tp)],
                self.events.event_id(self.num_iterations, layer_idx),
                f"MoE layer {layer_idx}",
            )
            self.pricer.rows_gathered(hi - lo, got.sent_ns)
        return np.concatenate(got.pieces)
