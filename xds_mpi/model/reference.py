"""The single-process reference generator every distributed deployment is checked against.

A batch of requests with different prompt lengths is prefilled together, then decoded step by
step. With MTP depth D each step is FlowServe's loop (xDeepServe §4.6): (1) the MTP modules draft
D tokens, (2) greedily, (3) the main model verifies [last token, drafts] in one forward, (4) samples
from its logits, (5) keeps the agreeing prefix plus one main-model token and rolls the KV back.

MTP bookkeeping: module k's cache entry at position i needs h^{k-1}_i and token t_{i+k}. With
tokens t_0..t_m committed (t_m not yet in the main cache), entries i <= m - k use committed tokens
only and are kept; entries past that were drafted from drafts and are recomputed next step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from xds_mpi.model.kv_blocks import BlockTable
from xds_mpi.model.mla import AttnChunk, LatentCache
from xds_mpi.model.moe import Wire
from xds_mpi.model.sampling import sample, verify_drafts
from xds_mpi.model.tokenizer import EOS_ID
from xds_mpi.model.transformer import DeepSeekModel


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    max_new_tokens: int = 16
    mtp_depth: int = 0  # draft tokens per step; 0 = plain decoding
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0  # request r samples from a generator seeded with seed + r
    use_int8: bool = False  # INT8 quantize-dequantize the MoE dispatch input
    ignore_eos: bool = False  # keep generating past EOS (fixed-length benchmarks)
    block_tokens: int = 16  # paged KV block size
    kv_int8: bool = False  # the latent KV's non-RoPE part in INT8 (mla.LatentCache)
    record_logits: bool = False  # keep the main-model logits each token was chosen from
    row_dtype: str = "float64"  # XCCL's row dtype: rows not in INT8 and expert outputs round
    shared_path: str = "local"  # the shared expert's rows: local, routed or rows (moe.Wire)

    @property
    def wire(self) -> Wire:
        return Wire(use_int8=self.use_int8, row_dtype=self.row_dtype, shared=self.shared_path)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.mtp_depth < 0 or self.temperature < 0:
            raise ValueError(
                f"need max_new_tokens >= 1, mtp_depth >= 0, temperature >= 0; got "
                f"max_new_tokens={self.max_new_tokens}, mtp_depth={self.mtp_depth}, "
                f"temperature={self.temperature}"
            )
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]  # generated tokens (ends at EOS unless ignore_eos)
    num_steps: int  # decode iterations after prefill
    num_drafted: int  # MTP draft tokens proposed
    num_accepted: int  # MTP draft tokens accepted
    logits: np.ndarray | None = None  # [len(tokens), vocab] when record_logits
    # Per decode step (the first verifies the drafts of the MTP pass after prefill): the drafts
    # it verified and how many were accepted, before the cut at max_new_tokens or EOS.
    step_drafts: tuple[tuple[int, ...], ...] = ()
    step_accepted: tuple[int, ...] = ()

    def cut(self, num_tokens: int, num_steps: int) -> RequestOutput:
        """The output as if it had ended after `num_tokens` tokens and `num_steps` decode
        steps (a request cancelled part way: serve's client gone, a stop string)."""
        return dataclasses.replace(
            self,
            tokens=self.tokens[:num_tokens],
            step_drafts=self.step_drafts[:num_steps],
            step_accepted=self.step_accepted[:num_steps],
        )


@dataclass(kw_only=True)
class _Seq:
    """One request's mutable decode state (seq_id doubles as its KV block table key)."""

    seq_id: int
    tokens: list[int]  # prompt + committed generated tokens
    num_prompt: int
    generator: np.random.Generator
    hiddens: list[list[np.ndarray]]  # [depth][position] committed h^depth rows, depth < D
    mtp_len: list[int]  # [depth - 1] committed cache entries of MTP depth
    logit_rows: list[np.ndarray] = field(default_factory=list)
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    step_drafts: list[tuple[int, ...]] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)
    is_done: bool = False

    @property
    def last_pos(self) -> int:
        return len(self.tokens) - 1


class ReferenceGenerator:
    def __init__(self, model: DeepSeekModel, options: GenerateOptions = GenerateOptions()) -> None:
        if options.mtp_depth and not model.cfg.num_mtp_modules:
            raise ValueError(
                f"mtp_depth={options.mtp_depth} needs a model with MTP modules "
                f"(model.num_mtp_modules=0)"
            )
        self.model = model
        self.opts = options

    def generate(self, prompts: list[list[int]]) -> list[RequestOutput]:
        seqs = [self._new_seq(seq_id, prompt) for seq_id, prompt in enumerate(prompts)]
        self._new_cache(seqs)
        self._prefill(seqs)
        active = [s for s in seqs if not s.is_done]
        while active:
            drafts = self._draft(active) if self.opts.mtp_depth else {}
            self._verify(active, drafts)
            active = [s for s in active if not s.is_done]
        return [self._output(s) for s in seqs]

    def _new_seq(self, seq_id: int, prompt: list[int]) -> _Seq:
        cfg, depth = self.model.cfg, self.opts.mtp_depth
        if not prompt:
            raise ValueError(f"request {seq_id} has an empty prompt")
        if any(not 0 <= t < cfg.vocab_size for t in prompt):
            raise ValueError(f"request {seq_id}: token ids must lie in [0, {cfg.vocab_size})")
        max_pos = len(prompt) + self.opts.max_new_tokens + depth
        if max_pos > cfg.max_seq_len:
            raise ValueError(
                f"request {seq_id}: prompt({len(prompt)}) + max_new_tokens"
                f"({self.opts.max_new_tokens}) + mtp_depth({depth}) exceeds "
                f"model.max_seq_len({cfg.max_seq_len})"
            )
        return _Seq(
            seq_id=seq_id,
            tokens=list(prompt),
            num_prompt=len(prompt),
            generator=np.random.default_rng(self.opts.seed + seq_id),
            hiddens=[[] for _ in range(depth)],
            mtp_len=[0] * depth,
        )

    def _new_cache(self, seqs: list[_Seq]) -> None:
        block_tokens = self.opts.block_tokens
        num_blocks = sum(
            -(-(s.num_prompt + self.opts.max_new_tokens + self.opts.mtp_depth + 1) // block_tokens)
            for s in seqs
        )
        self.table = BlockTable(num_blocks=num_blocks, block_tokens=block_tokens)
        cfg = self.model.cfg
        self.cache = LatentCache(
            num_layers=self.model.num_cache_layers(self.opts.mtp_depth),
            num_slots=num_blocks * block_tokens,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_dim,
            dtype=self.model.dtype,
            latent_int8=self.opts.kv_int8,
        )

    def _chunk(self, seq_id: int, start_pos: int, num_tokens: int) -> AttnChunk:
        slots = self.table.slots(seq_id, 0, start_pos + num_tokens)
        return AttnChunk(
            start_pos=start_pos, num_tokens=num_tokens, slots=np.array(slots, dtype=np.int64)
        )

    def _run_main(self, seqs: list[_Seq], inputs: list[list[int]], starts: list[int]):
        """Main model over each seq's `inputs` at positions start.. -> per seq (hidden, logits)."""
        chunks = [
            self._chunk(s.seq_id, start, len(ids)) for s, ids, start in zip(seqs, inputs, starts)
        ]
        tokens = np.array([t for ids in inputs for t in ids], dtype=np.int64)
        positions = np.concatenate(
            [np.arange(start, start + len(ids)) for ids, start in zip(inputs, starts)]
        )
        hidden = self.model(tokens, positions, chunks, self.cache, wire=self.opts.wire)
        bounds = np.cumsum([len(ids) for ids in inputs])[:-1]
        return list(zip(np.split(hidden, bounds), np.split(self.model.logits(hidden), bounds)))

    def _prefill(self, seqs: list[_Seq]) -> None:
        for s in seqs:
            self.table.allocate(s.seq_id, s.num_prompt)
        results = self._run_main(seqs, [s.tokens for s in seqs], [0] * len(seqs))
        for s, (hidden, logits) in zip(seqs, results):
            token = sample(logits[-1], temperature=self.opts.temperature, generator=s.generator)
            self._commit(s, [token], hidden, logits[-1:])

    def _verify(self, seqs: list[_Seq], drafts: dict[int, list[int]]) -> None:
        inputs = [[s.tokens[-1], *drafts.get(s.seq_id, [])] for s in seqs]
        starts = [s.last_pos for s in seqs]
        for s, ids in zip(seqs, inputs):
            self.table.append(s.seq_id, len(ids))
        for s, (hidden, logits) in zip(seqs, self._run_main(seqs, inputs, starts)):
            seq_drafts = drafts.get(s.seq_id, [])
            new_tokens = verify_drafts(
                logits, seq_drafts, temperature=self.opts.temperature, generator=s.generator
            )
            # Step 5: keep t_m and the accepted drafts in the KV cache, drop the rejected ones.
            self.table.truncate(s.seq_id, s.last_pos + len(new_tokens))
            s.num_steps += 1
            s.num_drafted += len(seq_drafts)
            s.num_accepted += len(new_tokens) - 1
            s.step_drafts.append(tuple(seq_drafts))
            s.step_accepted.append(len(new_tokens) - 1)
            self._commit(s, new_tokens, hidden[: len(new_tokens)], logits[: len(new_tokens)])

    def _commit(
        self, s: _Seq, new_tokens: list[int], hidden: np.ndarray, logits: np.ndarray
    ) -> None:
        """Append tokens chosen from `logits` [n, vocab]; `hidden` [h, hidden] holds the main
        model's h^0 of the positions now in the main cache (the prompt, or t_m + accepted)."""
        if self.opts.mtp_depth:
            s.hiddens[0].extend(hidden)
        num_generated = len(s.tokens) - s.num_prompt
        new_tokens = new_tokens[: self.opts.max_new_tokens - num_generated]
        if not self.opts.ignore_eos and EOS_ID in new_tokens:
            new_tokens = new_tokens[: new_tokens.index(EOS_ID) + 1]
            s.is_done = True
        s.tokens.extend(new_tokens)
        if self.opts.record_logits:
            s.logit_rows.extend(logits[: len(new_tokens)])
        if len(s.tokens) - s.num_prompt >= self.opts.max_new_tokens:
            s.is_done = True
        if s.is_done:
            self.table.free(s.seq_id)

    def _draft(self, seqs: list[_Seq]) -> dict[int, list[int]]:
        """Steps 1-2: MTP depth 1..D, chained, each drafting one token greedily per sequence."""
        drafts: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
        speculative: dict[tuple[int, int, int], np.ndarray] = {}  # (seq, depth, pos) -> h row
        for depth in range(1, self.opts.mtp_depth + 1):
            prev, next_tokens, positions, chunks = [], [], [], []
            for s in seqs:
                start, stop = s.mtp_len[depth - 1], s.last_pos  # positions [start, stop)
                extended = s.tokens + drafts[s.seq_id]
                for pos in range(start, stop):
                    is_committed = pos < len(s.hiddens[depth - 1])
                    prev.append(
                        s.hiddens[depth - 1][pos]
                        if is_committed
                        else speculative[s.seq_id, depth - 1, pos]
                    )
                    next_tokens.append(extended[pos + depth])
                positions.append(np.arange(start, stop))
                chunks.append(self._chunk(s.seq_id, start, stop - start))
            hidden = self.model.mtp_forward(
                depth,
                np.stack(prev),
                np.array(next_tokens, dtype=np.int64),
                np.concatenate(positions),
                chunks,
                self.cache,
                wire=self.opts.wire,
            )
            rows = np.split(hidden, np.cumsum([c.num_tokens for c in chunks])[:-1])
            last_rows = np.stack([r[-1] for r in rows])
            for s, token in zip(seqs, self.model.mtp_logits(depth, last_rows).argmax(-1).tolist()):
                drafts[s.seq_id].append(token)
            for s, seq_rows in zip(seqs, rows):
                self._keep_committed(s, depth, seq_rows, speculative)
        return drafts

    def _keep_committed(
        self,
        s: _Seq,
        depth: int,
        rows: np.ndarray,
        speculative: dict[tuple[int, int, int], np.ndarray],
    ) -> None:
        """rows: [n, hidden] h^depth at positions [mtp_len, last_pos); entries that used a draft
        token (pos > last_pos - depth) are recomputed next step."""
        start, num_committed = s.mtp_len[depth - 1], s.last_pos - depth + 1
        s.mtp_len[depth - 1] = num_committed
        if depth == self.opts.mtp_depth:
            return
        for pos, row in enumerate(rows, start=start):
            if pos < num_committed:
                s.hiddens[depth].append(row)
            else:
                speculative[s.seq_id, depth, pos] = row

    def _output(self, s: _Seq) -> RequestOutput:
        return RequestOutput(
            prompt=tuple(s.tokens[: s.num_prompt]),
            tokens=tuple(s.tokens[s.num_prompt :]),
            num_steps=s.num_steps,
            num_drafted=s.num_drafted,
            num_accepted=s.num_accepted,
            step_drafts=tuple(s.step_drafts),
            step_accepted=tuple(s.step_accepted),
            logits=np.stack(s.logit_rows) if self.opts.record_logits else None,
        )
