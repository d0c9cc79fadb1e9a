"""Requests as the TE-shell receives them, and the checks that reject bad ones with a reason."""

from __future__ import annotations

from dataclasses import dataclass

from xds_mpi.config.schema import Config


@dataclass(frozen=True, kw_only=True)
class Request:
    req_id: int
    prompt: tuple[int, ...]  # token ids
    max_new_tokens: int
    arrival_s: float = 0.0  # seconds after the run starts
    problem: str = ""  # set when the request could not even be read
    ignore_eos: bool = False  # generate max_new_tokens even past EOS (vLLM's extension)
    # A trace replay's request (xds_mpi/workload/trace_replay.py; 0 and () otherwise): the trace's
    # own lengths, which the projection prices, the served ones being scaled down; its line; the
    # trace's id of each prompt block (equal ids: equal blocks, so a shared prefix).
    trace_prompt_len: int = 0
    trace_output_len: int = 0
    trace_line: int = 0
    block_ids: tuple[int, ...] = ()

    @property
    def priced_prompt_len(self) -> int:
        """The prompt length the projection prices: the trace's, else the served one."""
        return self.trace_prompt_len or len(self.prompt)

    @property
    def priced_output_len(self) -> int:
        return self.trace_output_len or self.max_new_tokens


def kv_tokens_needed(req: Request, mtp_depth: int = 0) -> int:
    """KV entries a request may hold at its longest: prompt + every generated token, plus the
    drafts an MTP verify step appends past the last one."""
    return len(req.prompt) + req.max_new_tokens + mtp_depth


def rejection(req: Request, cfg: Config) -> str:
    """Why `req` cannot be served by this deployment ("" when it can)."""
    if req.problem:
        return req.problem
    if not req.prompt:
        return "empty prompt"
    if req.max_new_tokens < 1:
        return f"max_new_tokens({req.max_new_tokens}) < 1"
    vocab = cfg.model.vocab_size
    bad = [t for t in req.prompt if not 0 <= t < vocab]
    if bad:
        return f"token id {bad[0]} outside the vocabulary [0, {vocab})"
    depth = cfg.scheduler.mtp_depth
    total = kv_tokens_needed(req, depth)
    drafts = f" + mtp_depth({depth})" if depth else ""
    if total > cfg.model.max_seq_len:
        return (
            f"prompt({len(req.prompt)}) + max_new_tokens({req.max_new_tokens}){drafts} = "
            f"{total} > model.max_seq_len({cfg.model.max_seq_len})"
        )
    sched = cfg.scheduler
    capacity = sched.num_kv_blocks_per_die * sched.kv_block_tokens
    if total > capacity:
        return (
            f"prompt({len(req.prompt)}) + max_new_tokens({req.max_new_tokens}){drafts} = "
            f"{total} tokens > a die's KV capacity {sched.num_kv_blocks_per_die} blocks x "
            f"{sched.kv_block_tokens} = {capacity}"
        )
    return ""
