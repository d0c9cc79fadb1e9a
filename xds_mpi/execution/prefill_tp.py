"""A prefill DP group of several dies (`deployment.prefill_tp`: xDeepServe §5.1's prefill TEs run
TP=4), with CloudMatrix-Infer §4.3.1's staged hybrid parallelism (SP-TP-SP) for MLA.

The group's batch is one packed sequence of rows; die i owns the rows [b_i, b_i+1) (`row_bounds`,
sizes within one): its share of the residual stream. Per layer:

    stage 1 (SP)  die i down-projects its rows: the query latent q_lora, the KV latent c_kv and
                  the RoPE key (`MLA.q_down`, `MLA.project_latent`); the three are all-gathered
                  by rows (xccl/tp_gather.py, one-sided writes into the peers' windows), so every
                  die writes every row's latent into its cache (MLA's latent is every head's:
                  each die holds the whole KV, and the group's leader sends it to decode).
    stage 2 (TP)  die i computes heads [i H/tp, (i+1) H/tp) over every row: its query columns,
                  the scores and the attention-weighted latents o_i [n, H/tp, kv_lora_rank]
                  (`MLA.attend_latents`); an all-to-all sends die j the rows of o_i it owns.
    stage 3 (SP)  die i applies the whole output projection to its rows' [o_0 | ... | o_tp-1],
                  adds the residual, then runs the MoE (dispatch/combine with the TE's dies) or
                  the dense FFN over its rows only.

After the last layer (and after each MTP block) the rows are all-gathered once, so every die
of the group samples the same tokens and keeps the same scheduler state.

Token-exact: every value a die computes is one the single-process reference computes too, by the
same operations in the same order. Projections and norms are per row and the matmul is batch
invariant (a row's result does not depend on the other rows); a head's query columns come out of
the product bit for bit the same whatever other columns are computed beside them, and a head's
score and value rows are rows of the batched (token x head) products
(tests/e2e/pd/test_prefill_tp.py checks the stages against the whole MLA at TP 2 and 4). Megatron's
split instead (a row-parallel W_o, its partial products all-reduced across the dies) would sum
each output in another float order than the reference's one product over all heads, moving the
hidden state's last bits and, through the argmax, tokens: here the sum over heads stays inside
one die's W_o product. The exchanges move only what a die cannot compute itself.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from xccl.tp_gather import TpGather
from xccl.vclock import LinkModel
from xds_mpi.execution.executor import ColocatedExecutor
from xds_mpi.execution.pricing import Pricer
from xds_mpi.projection.cost import CostModel

WIRE_BYTES = 2  # the exchanged values travel as BF16 at the cost shape


def row_bounds(num_rows: int, tp: int) -> list[int]:
    """Where each member's share of `num_rows` rows starts (and the end): sizes within one,
    the first members the larger."""
    base, extra = divmod(num_rows, tp)
    return [i * base + min(i, extra) for i in range(tp + 1)]


class TpPricer(Pricer):
    """A TP die's pricer: MLA by stages at the cost shape (the terms of `CostModel.mla_prolog`,
    each on the rows its stage runs over), the attention core at H/tp heads (the latent cache is
    still read whole: it is every head's), and the exchanges on the UB link."""

    def __init__(self, *args, tp: int, link: LinkModel, same_server: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tp, self.link, self.same_server = tp, link, same_server
        self._cost_tp: tuple[CostModel, CostModel] | None = None  # (cost, its H/tp twin)

    @property
    def cost_tp(self) -> CostModel:
        """The cost model at H/tp heads, on the hardware of the current one (a stream of the
        prefill pipeline prices on its share of the cores: xds_mpi/execution/two_streams.py)."""
        if self._cost_tp is None or self._cost_tp[0] is not self.cost:
            m = self.cost.m
            twin = CostModel(
                replace(m, num_heads=m.num_heads // self.tp),
                self.cost.hw,
                kv_int8=self.cost.kv_int8,
            )
            self._cost_tp = (self.cost, twin)
        return self._cost_tp[1]

    def _scale(self, is_moe: bool) -> float:
        return self.moe_scale if is_moe else self.dense_scale

    def mla_down(self, rows: int, *, is_moe: bool) -> None:
        """Stage 1 over this die's rows: W_q_a and W_kv_a (INT8)."""
        m = self.cost.m
        params = m.hidden * m.q_lora_rank + m.hidden * (m.kv_lora_rank + m.qk_rope_dim)
        self._add("MLAProlog", self._scale(is_moe) * self.cost.gemm(rows, params))

    def mla_heads(self, seqs: list[tuple[int, int]], *, is_moe: bool) -> None:
        """Stage 2 over every row, this die's heads: W_q_b's columns (INT8), the absorbed W_UK
        (BF16) and the attention core."""
        m, cost_tp = self.cost.m, self.cost_tp
        rows, heads = sum(num for _, num in seqs), cost_tp.m.num_heads
        up = cost_tp.gemm(rows, m.q_lora_rank * heads * (m.qk_nope_dim + m.qk_rope_dim))
        absorbed = 2 * heads * m.qk_nope_dim * m.kv_lora_rank
        if rows:
            hw = cost_tp.hw
            up += cost_tp._roofline(
                2.0 * rows * absorbed, absorbed * 2, peak=hw.bf16_flops, eff=hw.gemm_eff
            )
        scale = self._scale(is_moe)
        self._add("MLAProlog", scale * up)
        self._add("attention", scale * cost_tp.attention(seqs))

    def mla_out(self, rows: int, *, is_moe: bool) -> None:
        """Stage 3 over this die's rows: W_UV and W_o over every head (INT8)."""
        m = self.cost.m
        params = m.num_heads * m.v_head_dim * m.hidden
        self._add("MLAProlog", self._scale(is_moe) * self.cost.gemm(rows, params))

    def exchanged(self, values_out: int, sent_ns: float, *, is_moe: bool | None) -> None:
        """An exchange: wait for the peers' stamps (they published when their stage ended),
        then this die's `values_out` values written to its peers; is_moe: which layers the
        emulated one stands for (None: once per pass, not per layer)."""
        with self.waiting("tp gather"):
            self.clock.arrive(sent_ns)
        nbytes = values_out * WIRE_BYTES
        if nbytes:
            ns = self.link.transfer_ns(nbytes, same_server=self.same_server)
            scale = 1.0 if is_moe is None else self._scale(is_moe)
            self._add("tp gather", scale * ns / 1e9)

    # -- what one layer's exchanges move, at the cost shape ----------------------------------
    def down_values(self, rows: int) -> int:
        """Stage 1's all-gather: this die's rows' latents to each of the tp - 1 peers."""
        m = self.cost.m
        return (self.tp - 1) * rows * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_dim)

    def heads_values(self, rows: int) -> int:
        """Stage 2's all-to-all: this die's heads of every other die's rows (`rows` in all)."""
        m = self.cost.m
        return rows * (m.num_heads // self.tp) * m.kv_lora_rank

    def rows_values(self, rows: int) -> int:
        """The last layer's rows to each peer."""
        return (self.tp - 1) * rows * self.cost.m.hidden

    def mla_layer(self, seqs: list[tuple[int, int]], rows: int, *, is_moe: bool) -> None:
        """A whole MLA layer of a die owning `rows` of the batch, its peers in step (the
        per-request projection, xds_mpi/results/request_pricing.py)."""
        num_rows = sum(num for _, num in seqs)
        self.mla_down(rows, is_moe=is_moe)
        self.exchanged(self.down_values(rows), 0.0, is_moe=is_moe)
        self.mla_heads(seqs, is_moe=is_moe)
        self.exchanged(self.heads_values(num_rows - rows), 0.0, is_moe=is_moe)
        self.mla_out(rows, is_moe=is_moe)


class TpPrefillExecutor(ColocatedExecutor):
    """A ColocatedExecutor whose layers run SP-TP-SP over its TP group (module doc)."""

    def __init__(self, *args, gather: TpGather, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gather = gather
        self.tp, self.tp_idx = gather.layout.num_members, gather.me_idx

    def _own_rows(self, num_rows: int) -> slice:
        bounds = row_bounds(num_rows, self.tp)
        return slice(bounds[self.tp_idx], bounds[self.tp_idx + 1])

    def _attend(self, block, x, positions, chunks, seqs, layer_idx: int) -> np.ndarray:
        if seqs:
            x = x + self._attention(block, x, positions, chunks, seqs, layer_idx)
        return x

    def _attention(self, block, x, positions, chunks, seqs, layer_idx: int) -> np.ndarray:
        """MLA's three stages: x [share, hidden] -> [share, hidden] (before the residual)."""
        attn, pricer, is_moe = block.attn, self.pricer, block.is_moe
        n, me = sum(num for _, num in seqs), self.tp_idx
        bounds = row_bounds(n, self.tp)
        share = bounds[me + 1] - bounds[me]
        event = self.events.event_id(self.num_iterations, layer_idx)
        q_lora, c_kv, k_rope = self._down(block, x, positions, bounds, event, layer_idx)
        # Stage 2 (TP): this die's heads over every row; each die gets its rows of them.
        per_die = attn.num_heads // self.tp
        heads = slice(me * per_die, (me + 1) * per_die)
        cache = self.cache
        o = attn.attend_latents(q_lora, c_kv, k_rope, positions, chunks, cache, layer_idx, heads)
        pricer.mla_heads(seqs, is_moe=is_moe)
        outgoing = [o[bounds[j] : bounds[j + 1]] for j in range(self.tp)]
        shapes = [(share, per_die, o.shape[2])] * self.tp  # our rows of each die's heads
        got = self.gather.exchange(outgoing, shapes, event, f"MLA heads layer {layer_idx}")
        pricer.exchanged(pricer.heads_values(n - share), got.sent_ns, is_moe=is_moe)
        # Stage 3 (SP): the whole W_o over this die's rows, every head.
        out = attn.project_out(np.concatenate(got.pieces, axis=1))  # [share, H, c] -> hidden
        pricer.mla_out(share, is_moe=is_moe)
        return out

    def _down(self, block, x, positions, bounds, event: int, layer_idx: int):
        """Stage 1 (SP): this die's rows x [share, hidden] down-projected, then every row's:
        (q_lora [n, q_lora_rank], c_kv [n, kv_lora_rank], k_rope [n, qk_rope_dim])."""
        attn, pricer, is_moe = block.attn, self.pricer, block.is_moe
        lo, hi = bounds[self.tp_idx], bounds[self.tp_idx + 1]
        h = block.attn_norm(x)
        c_kv, k_rope = attn.project_latent(h, positions[lo:hi])
        down = np.concatenate([attn.q_down(h), c_kv, k_rope], axis=1)  # [share, q + c + rope]
        pricer.mla_down(hi - lo, is_moe=is_moe)
        shapes = [(bounds[i + 1] - bounds[i], down.shape[1]) for i in range(self.tp)]
        got = self.gather.all_gather(down, shapes, event, f"MLA down layer {layer_idx}")
        pricer.exchanged(pricer.down_values(hi - lo), got.sent_ns, is_moe=is_moe)
        every = np.concatenate(got.pieces)  # [n, q + c + rope]
        q_width = down.shape[1] - c_kv.shape[1] - k_rope.shape[1]
        cuts = [q_width, q_width + c_kv.shape[1]]
        return tuple(np.ascontiguousarray(a) for a in np.split(every, cuts, axis=1))

    def _all_rows(self, x: np.ndarray, num_rows: int, layer_idx: int, meter) -> np.ndarray:
        """Every row of the batch on every die of the group: [num_rows, hidden]."""
        bounds = row_bounds(num_rows, self.tp)
        with meter("xccl", "tp gather", layer=layer_idx):
            shapes = [(bounds[i + 1] - bounds[i], x.shape[1]) for i in range(self.tp)]
            event = self.events.event_id(self.num_iterations, layer_idx)
            got = self.gather.all_gather(x, shapes, event, f"rows after layer {layer_idx}")
            self.pricer.exchanged(self.pricer.rows_values(len(x)), got.sent_ns, is_moe=None)
        return np.concatenate(got.pieces)
