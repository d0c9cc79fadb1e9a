"""Execution on a colocated die: one iteration's batch through every layer (xDeepServe Fig. 10).

Per layer: MLA on this die's own requests; for a MoE layer then the gate, XCCL dispatch to the
dies hosting the chosen experts, this die's experts over the rows it received, XCCL combine, and
the shared expert locally. The model pieces are the ones the single-process reference runs, so
the only difference from the reference is where each expert's rows are computed.
"""
from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch

from xccl.ep import EpBuffer
from xds_mpi.engine.pricing import Pricer
from xds_mpi.engine.scheduler import Entry
from xds_mpi.engine.timing import IterationTiming
from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.sampling import sample
from xds_mpi.model.transformer import DeepSeekModel


class ColocatedExecutor:
    def __init__(self, model: DeepSeekModel, ep: EpBuffer, *, phy2log: tuple[int, ...],
                 log2phy: tuple[tuple[int, ...], ...], table: BlockTable, cache: LatentCache,
                 pricer: Pricer) -> None:
        self.model, self.ep, self.table, self.cache = model, ep, table, cache
        self.phy2log, self.log2phy, self.pricer = phy2log, log2phy, pricer
        self.num_iterations = 0

    def _inputs(self, entries: list[Entry]):
        chunks = [AttnChunk(start_pos=e.start_pos, num_tokens=len(e.input_ids),
                            slots=torch.tensor(self.table.slots(e.req_id, 0, e.start_pos +
                                                                len(e.input_ids))))
                  for e in entries]
        tokens = torch.tensor([t for e in entries for t in e.input_ids], dtype=torch.int64)
        positions = torch.tensor([e.start_pos + i for e in entries
                                  for i in range(len(e.input_ids))], dtype=torch.int64)
        return tokens, positions, chunks

    def forward(self, entries: list[Entry]) -> tuple[dict[int, int], IterationTiming]:
        """Run the batch (possibly empty: the die still joins every dispatch and combine);
        returns the greedy token of every sampled entry and the iteration's timing."""
        started, vstart = time.perf_counter(), self.ep.clock.now_ns
        spent = defaultdict(float)
        tokens, positions, chunks = self._inputs(entries)
        self.num_iterations += 1
        with torch.inference_mode():
            x = self.model.embed(tokens)                                  # [n, hidden]
            for layer_idx, layer in enumerate(self.model.layers):
                t0 = time.perf_counter()
                if entries:
                    x = layer.attention_part(x, positions, chunks, self.cache, layer_idx)
                self.pricer.attention(entries, is_moe=layer.is_moe)
                spent["attention"] += time.perf_counter() - t0
                if layer.is_moe:
                    x = x + self._moe(layer, layer.ffn_norm(x), layer_idx, spent)
                elif entries:
                    x = layer.ffn_part(x)
                    self.pricer.dense_ffn(len(tokens))
            sampled = self._sample(entries, x)
        self.pricer.finish(len(sampled))
        timing = IterationTiming(num_rows=len(tokens), num_sampled=len(sampled),
                                 attention_s=spent["attention"], xccl_s=spent["xccl"],
                                 experts_s=spent["experts"], total_s=time.perf_counter() - started,
                                 vtime_s=(self.ep.clock.now_ns - vstart) / 1e9)
        return sampled, timing

    def _moe(self, layer, h: torch.Tensor, layer_idx: int, spent) -> torch.Tensor:
        """h: [n, hidden] normalized rows -> [n, hidden] routed + shared expert output."""
        moe, pricer, clock = layer.ffn, self.pricer, self.ep.clock
        t0 = time.perf_counter()
        routing = moe.gate(h)
        pricer.gate(len(h))
        t1 = time.perf_counter()
        event = self.num_iterations * len(self.model.layers) + layer_idx
        before = clock.now_ns
        recv_x, info, handle = self.ep.dispatch(
            h.numpy(), routing.topk_idx.numpy(), routing.topk_weight.numpy(), event,
            log2phy=self.log2phy)
        pricer.waited("dispatch", before)
        pricer.dispatch(len(recv_x))
        t2 = time.perf_counter()
        expert_out = np.empty_like(recv_x)
        row = 0
        for slot, num_rows in zip(info.local_slots, info.num_rows_per_slot):
            if num_rows:
                rows = torch.from_numpy(recv_x[row:row + num_rows])
                expert_out[row:row + num_rows] = moe.expert_forward(self.phy2log[slot], rows).numpy()
                row += num_rows
        pricer.experts(len(recv_x), len(h))
        t3 = time.perf_counter()
        before = clock.now_ns
        routed = torch.from_numpy(self.ep.combine(expert_out, handle))
        pricer.waited("combine", before)
        pricer.combine(len(h))
        t4 = time.perf_counter()
        shared = moe.shared_forward(h)
        t5 = time.perf_counter()
        spent["experts"] += (t1 - t0) + (t3 - t2) + (t5 - t4)
        spent["xccl"] += (t2 - t1) + (t4 - t3)
        return shared + routed

    def _sample(self, entries: list[Entry], x: torch.Tensor) -> dict[int, int]:
        last_rows, req_ids, row = [], [], 0
        for e in entries:
            row += len(e.input_ids)
            if e.is_sampled:
                last_rows.append(row - 1)
                req_ids.append(e.req_id)
        if not last_rows:
            return {}
        logits = self.model.logits(x[last_rows])                          # [m, vocab]
        return {req_id: sample(logits[i], temperature=0.0, generator=None)
                for i, req_id in enumerate(req_ids)}
