"""Execution on a colocated die: one iteration's batch through every layer (xDeepServe Fig. 10).

Per layer: MLA on this die's own requests; for a MoE layer then the gate, XCCL dispatch to the
dies hosting the chosen experts, this die's experts over the rows it received, XCCL combine, and
the shared expert locally. The model pieces are the ones the single-process reference runs, so
the only difference from the reference is where each expert's rows are computed.

With MTP depth D (§4.6) the main pass verifies each decoding request's drafts, and then the D MTP
modules (each one MoE block: its own dispatch and combine) draft the next step's tokens over the
positions just committed (xds_mpi/execution/mtp.py). Every die joins all L + D MoE calls of an
iteration, with or without rows; event id = iteration x (L + D) + layer, MTP depth k being layer
L + k - 1 (the cache layer numbering of the model).

Nothing the iteration computes is kept until the die commits it (`commit`); a failed iteration is
re-run from `checkpoint` (token recomputation, §6.2).
"""

from __future__ import annotations

import numpy as np

from xccl.ep.buffer import EpBuffer
from xds_mpi.eplb.expert_map import ExpertMap
from xds_mpi.execution import emulator_runtime
from xds_mpi.execution.faults import LayerEvents
from xds_mpi.execution.mtp import MtpBook, MtpWork
from xds_mpi.execution.pricing import IterationTiming, Meter, Pricer, iteration_timing
from xds_mpi.execution.slots import ExpertSlots
from xds_mpi.execution.two_streams import TwoStreamPass, split_cores
from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.sampling import verify_drafts
from xds_mpi.model.transformer import DeepSeekModel
from xds_mpi.report import trace
from xds_mpi.scheduling.scheduler import Entry, Sampled


class ColocatedExecutor:
    def __init__(
        self,
        model: DeepSeekModel,
        ep: EpBuffer,
        *,
        phy2log: tuple[int, ...],
        log2phy: tuple[tuple[int, ...], ...],
        table: BlockTable,
        cache: LatentCache,
        pricer: Pricer,
        slots: ExpertSlots,
        shared_slots: tuple[int, ...] = (),
        mtp_depth: int = 0,
        expert_map: ExpertMap | None = None,
        lanes: tuple[EpBuffer, ...] = (),
        stream_costs: tuple | None = None,
    ) -> None:
        """lanes: one EP buffer per microbatch of the two-stream decode (the first is `ep`,
        which the MTP blocks use); none: one stream. stream_costs: the (stream 0, stream 1)
        cost models, by default §4.2.3's core split of the pricer's (two_streams.py)."""
        self.model, self.ep, self.table, self.cache = model, ep, table, cache
        self.lanes = lanes
        if lanes and stream_costs is None:
            stream_costs = split_cores(pricer.cost)
        self.stream_costs = stream_costs
        self.clock = pricer.clock  # the die's virtual clock
        self.phy2log, self.log2phy, self.pricer = phy2log, log2phy, pricer
        # Dedicated shared-expert dies (EP288: 256 routed + 32 shared): the shared expert is one
        # more dispatch column to those slots; otherwise every die computes it for its rows.
        self.slots, self.shared_slots = slots, shared_slots
        self.mtp_depth = mtp_depth
        self.mtp = MtpBook(mtp_depth)
        self.num_layers = len(model.layers)
        self.events = LayerEvents(events_per_iteration=self.num_layers + mtp_depth)
        self.num_iterations = 0
        # Per-layer log2phy, redundant slots' weights, the gate's counts (§4.5; xds_mpi/eplb).
        self.expert_map = expert_map or ExpertMap.static(phy2log, self.moe_layers())

    def build_hosted_experts(self) -> None:
        """Make the routed experts this die's slots compute with now (the die calls it at
        start-up). The model makes an expert when it is first used (xds_mpi/model/params.py),
        which put 4-5 ms of weight building per die into the main job's first iteration, its
        first token's time, while the other dies waited for the slowest in the combine."""
        routed = [slot for slot in self.ep.local_slots if self.slots.is_routed(slot)]
        for layer_idx in self.moe_layers():
            moe = self.model.moe_of(layer_idx)
            for expert in self.expert_map.hosted(layer_idx, routed):
                moe.experts[expert]  # noqa: B018 (made on first access, kept)

    def use_buffer(self, ep: EpBuffer) -> None:
        """Dispatch/combine through `ep` from now on (the survivors' buffer after a failover,
        ranks/recovery/scale_down.py)."""
        self.ep = ep

    def moe_layers(self) -> tuple[int, ...]:
        """Layer index of every MoE call of an iteration: main MoE layers, then MTP depths."""
        main = tuple(i for i, layer in enumerate(self.model.layers) if layer.is_moe)
        return main + tuple(self.num_layers + k for k in range(self.mtp_depth))

    # -- one iteration --------------------------------------------------------------------------
    def _inputs(self, entries: list[Entry]):
        chunks = [
            AttnChunk(
                start_pos=e.start_pos,
                num_tokens=len(e.input_ids),
                slots=np.array(self.table.slots(e.req_id, 0, e.start_pos + len(e.input_ids))),
            )
            for e in entries
        ]
        tokens = np.array([t for e in entries for t in e.input_ids], dtype=np.int64)
        positions = np.array(
            [e.start_pos + i for e in entries for i in range(len(e.input_ids))], dtype=np.int64
        )
        return tokens, positions, chunks

    def forward(self, entries: list[Entry]) -> tuple[dict[int, Sampled], IterationTiming]:
        """Run the batch (possibly empty: the die still joins every dispatch and combine);
        returns what every sampled entry produced and the iteration's timing."""
        emulator_runtime.between_iterations()  # the GC's point: no dispatch/combine running
        meter = Meter(self.clock)
        tokens, positions, chunks = self._inputs(entries)
        self.num_iterations += 1
        self.expert_map.start_iteration(
            has_prefill=any(len(e.input_ids) > 1 + e.num_drafts for e in entries)
        )
        if self.lanes:  # two microbatches on two streams (xds_mpi/execution/two_streams.py)
            x = TwoStreamPass(self, meter, self.stream_costs).run(entries)
            sampled, works = self._sample_and_draft(entries, x, meter)
            return self.results(sampled, works), iteration_timing(entries, sampled, meter)
        x = self._main_layers(entries, tokens, positions, chunks, meter)
        sampled, works = self._sample_and_draft(entries, x, meter)
        return self.results(sampled, works), iteration_timing(entries, sampled, meter)

    def _main_layers(self, entries, tokens, positions, chunks, meter: Meter) -> np.ndarray:
        """The main layers over the batch: the last layer's rows [n, hidden]."""
        seqs = [(e.start_pos + len(e.input_ids), len(e.input_ids)) for e in entries]
        x = self.model.embed(tokens[self._own_rows(len(tokens))])  # [rows here, hidden]
        for layer_idx, layer in enumerate(self.model.layers):
            with meter("attention", layer=layer_idx):
                x = self._attend(layer, x, positions, chunks, seqs, layer_idx)
            if layer.is_moe:
                x = x + self._moe(layer.ffn, layer.ffn_norm(x), layer_idx, meter)
            elif entries:
                x = layer.ffn_part(x)
                self.pricer.dense_ffn(len(x))
        return self._all_rows(x, len(tokens), len(self.model.layers) - 1, meter)

    # A prefill TP group's die holds a share of the rows between its layers and splits MLA over
    # the group (xds_mpi/execution/prefill_tp.py); here a die holds every row of its batch.
    def _own_rows(self, num_rows: int) -> slice:
        """Which of the batch's rows this die carries through the layers."""
        return slice(0, num_rows)

    def _attend(self, block, x, positions, chunks, seqs, layer_idx: int) -> np.ndarray:
        """A block's attention over this die's rows x, priced (seqs: (KV length, new rows) per
        sequence of the batch): x after the attention residual."""
        if seqs:
            x = block.attention_part(x, positions, chunks, self.cache, layer_idx)
        self.pricer.attention_rows(seqs, is_moe=block.is_moe)
        return x

    def _all_rows(self, x: np.ndarray, num_rows: int, layer_idx: int, meter: Meter) -> np.ndarray:
        """Every row of the batch [num_rows, hidden] from this die's rows x."""
        return x

    def _sample_and_draft(self, entries: list[Entry], x: np.ndarray, meter: Meter):
        """The main model's tokens (verifying drafts), then with MTP the next drafts; x: the last
        layer's rows [n, hidden]. Returns (sampled, works) of `_verify`."""
        with trace.span("sampling"):
            sampled, works = self._verify(entries, x)
            self.pricer.finish(sum(len(e.input_ids) for e in entries if e.is_sampled))
        if self.mtp_depth:
            with trace.span("MTP", depth=self.mtp_depth):
                self._draft(works, meter)
        return sampled, works

    @staticmethod
    def results(sampled: dict[int, list[int]], works: dict[int, MtpWork]) -> dict[int, Sampled]:
        """Each sampled entry's tokens with its drafts for the next step."""
        return {
            r: Sampled(tokens=tuple(tokens), drafts=tuple(works[r].drafts) if r in works else ())
            for r, tokens in sampled.items()
        }

    def _moe(self, moe, h: np.ndarray, layer_idx: int, meter: Meter) -> np.ndarray:
        """h: [n, hidden] normalized rows -> [n, hidden] routed + shared expert output."""
        pricer = self.pricer
        with meter("experts", "gate", layer=layer_idx):
            routing = moe.gate(h)
            pricer.gate(len(h))
        topk_idx = routing.topk_idx
        with meter("xccl", "dispatch", layer=layer_idx):
            with pricer.waiting("dispatch"):
                recv_x, info, handle = self.ep.dispatch(
                    h,
                    topk_idx,
                    routing.topk_weight,
                    self.events.event_id(self.num_iterations, layer_idx),
                    log2phy=self.expert_map.log2phy(layer_idx),
                    shared_slots=self.shared_slots,
                )
            pricer.dispatch(len(recv_x))
        self.expert_map.collect(layer_idx, topk_idx, len(recv_x))
        with meter("experts", layer=layer_idx, **self._load(info, layer_idx)):
            expert_out = self._experts(moe, recv_x, info, layer_idx)
            pricer.experts(len(recv_x), 0 if self.shared_slots else len(h))
        with meter("xccl", "combine", layer=layer_idx):
            with pricer.waiting("combine"):
                routed = self.ep.combine(expert_out, handle)
            pricer.combine(len(h))
        with meter("experts", layer=layer_idx, shared=True):
            shared = 0.0 if self.shared_slots else moe.shared_forward(h)
        return shared + routed

    def _load(self, info, layer_idx: int) -> dict:
        """The trace's expert load: rows per local slot, by logical expert (-1: shared)."""
        if not trace.is_enabled():
            return {}
        phy2log = self.expert_map.phy2log(layer_idx)
        experts = [phy2log[s] if self.slots.is_routed(s) else -1 for s in info.local_slots]
        return {"experts": experts, "rows": info.num_rows_per_slot.tolist()}

    def _experts(self, moe, recv_x: np.ndarray, info, layer_idx: int) -> np.ndarray:
        """This die's slots over the rows they received: recv_x [R, hidden] in the wire's row
        dtype -> [R, hidden] model dtype, computed in the model's dtype."""
        expert_out = np.empty(recv_x.shape, np.float64)
        row = 0
        for slot, num_rows in zip(info.local_slots, info.num_rows_per_slot):
            if num_rows:
                rows = recv_x[row : row + num_rows].astype(self.model.dtype, copy=False)
                if self.slots.is_routed(slot):
                    out = self.expert_map.expert_forward(moe, layer_idx, slot, rows)
                else:
                    out = moe.shared_forward(rows)
                expert_out[row : row + num_rows] = out
                row += num_rows
        return expert_out

    # -- sampling and MTP -----------------------------------------------------------------------
    def _verify(
        self, entries: list[Entry], x: np.ndarray
    ) -> tuple[dict[int, list[int]], dict[int, MtpWork]]:
        """Greedy tokens of every sampled entry (its drafts checked against the main model, as
        the reference's verify step), and with MTP each entry's drafting work."""
        rows = np.split(x, np.cumsum([len(e.input_ids) for e in entries])[:-1]) if entries else ()
        steps = [(e, r) for e, r in zip(entries, rows) if e.is_sampled]
        sampled: dict[int, list[int]] = {}
        if steps:
            # Verify rows: [last token, drafts] of a decode step, the last prompt row otherwise.
            picked = [r[-1 - e.num_drafts :] for e, r in steps]
            logits = self.model.logits(np.concatenate(picked))
            logits = np.split(logits, np.cumsum([len(p) for p in picked])[:-1])
            for (e, _), row_logits in zip(steps, logits):
                drafts = list(e.input_ids[len(e.input_ids) - e.num_drafts :])
                sampled[e.req_id] = verify_drafts(
                    row_logits, drafts, temperature=0.0, generator=None
                )
        works: dict[int, MtpWork] = {}
        if self.mtp_depth:
            for e, r in zip(entries, rows):
                new = sampled.get(e.req_id, [])
                is_decode = e.is_sampled and e.start_pos == len(e.context) - 1
                # h^0 now committed: t_m and the accepted drafts, or the whole prompt chunk.
                works[e.req_id] = self.mtp.start(
                    e.req_id,
                    list(e.context) + new,
                    r[: len(new)] if is_decode else r,
                    is_drafting=e.is_sampled,
                )
        return sampled, works

    def _draft(self, works: dict[int, MtpWork], meter: Meter) -> None:
        """The D MTP passes: depth k runs module k over each request's rows, then drafts one
        token per decoding request greedily from its last row."""
        model = self.model
        for depth in range(1, self.mtp_depth + 1):
            active = [w for w in works.values() if w.plan(depth) > 0]
            inputs = [w.inputs(depth) for w in active]
            with self.pricer.mtp_layer():
                hidden = self._mtp_block(depth, active, inputs, meter)  # [rows, hidden]
                bounds = np.cumsum([w.stop - w.start for w in active])[:-1]
                out = dict(zip((w.req_id for w in active), np.split(hidden, bounds)))
                drafting = [w for w in active if w.is_drafting]
                if drafting:
                    last = np.stack([out[w.req_id][-1] for w in drafting])
                    for w, token in zip(
                        drafting, model.mtp_logits(depth, last).argmax(-1).tolist()
                    ):
                        w.drafts.append(token)
                self.pricer.mtp_head(len(drafting))
            for w in works.values():
                w.keep(depth, out.get(w.req_id), self.mtp_depth)

    def _mtp_rows(self, depth: int, active: list[MtpWork], inputs) -> tuple:
        """MTP depth's block input h' [rows, hidden], positions [rows], attention chunks."""
        model = self.model
        prev = [row for rows, _ in inputs for row in rows]
        next_ids = np.array([t for _, ids in inputs for t in ids], dtype=np.int64)
        prev = np.stack(prev) if prev else np.empty((0, model.cfg.hidden), model.dtype)
        x = model.mtp_module(depth).project(prev, model.embed(next_ids))
        positions = np.array([p for w in active for p in range(w.start, w.stop)], dtype=np.int64)
        chunks = [
            AttnChunk(
                start_pos=w.start,
                num_tokens=w.stop - w.start,
                slots=np.array(self.table.slots(w.req_id, 0, w.stop)),
            )
            for w in active
        ]
        return x, positions, chunks

    def _mtp_block(self, depth: int, active: list[MtpWork], inputs, meter: Meter) -> np.ndarray:
        """MTP module `depth`'s block over this die's rows: attention, then its MoE through
        dispatch / combine like a main layer's. Returns h^depth [rows, hidden]."""
        block, layer_idx = self.model.mtp_module(depth).block, self.num_layers + depth - 1
        with meter("attention", layer=layer_idx):
            x, positions, chunks = self._mtp_rows(depth, active, inputs)
            self.pricer.mtp_projection(len(x))
            num_rows, x = len(x), x[self._own_rows(len(x))]
            seqs = [(w.stop, w.stop - w.start) for w in active]
            x = self._attend(block, x, positions, chunks, seqs, layer_idx)
        x = x + self._moe(block.ffn, block.ffn_norm(x), layer_idx, meter)
        return self._all_rows(x, num_rows, layer_idx, meter)

    # -- commit / rollback ----------------------------------------------------------------------
    def commit(self, finished: set[int]) -> None:
        """The iteration stands: keep its MTP state; forget finished requests."""
        self.mtp.commit(finished)

    def checkpoint(self) -> int:
        return self.num_iterations

    def restore(self, checkpoint: int) -> None:
        """Back to the start of the iteration: its MTP updates dropped, the same event ids next
        time (the die's recomputer puts the virtual clock back)."""
        self.num_iterations = checkpoint
        self.mtp.discard()
