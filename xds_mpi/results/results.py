"""What a serving run produced: per-request records, the summary, the reference check, and their
groups in the run file (/requests, /dies, /summary attributes). What the dies report about
themselves (projection, MTP acceptance, recovery) is summed up in
`xds_mpi.results.die_summaries`."""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import h5py
import numpy as np

from xds_mpi.config.schema import Config
from xds_mpi.workload.requests import Request

if TYPE_CHECKING:  # the reference builds the model; the check loads it lazily
    from xds_mpi.model.reference import RequestOutput


@dataclass(kw_only=True)
class RequestRecord:
    req: Request
    rejected: str = ""  # the reason, for a rejected request
    lost: str = ""  # the reason, for a request a failure ended (its KV lost to a memory fault)
    # the reason, for a request ended early (serve: its client went away, a stop string,
    # shutdown): its tokens are the reference's first ones
    cancelled: str = ""
    die_rank: int = -1
    dispatched_at: float = 0.0  # wall clock (time.time())
    dispatched_vtime: float = 0.0  # its die's virtual clock (seconds) then, as last reported
    # run.clock virtual: arrival_s is a virtual time; on the wall clock the request arrived
    # when the TE-shell handed it to a die (time.time(); 0: the wall clock drives serving)
    wall_arrival: float = 0.0
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    token_vtimes: list[float] = field(default_factory=list)  # the die's virtual clock, seconds
    finished_at: float = 0.0
    # With MTP, per decode step (the first verifies the prefill's MTP drafts): the drafts it
    # verified and how many the main model accepted, before the cut at max_new_tokens or EOS.
    step_drafts: list[tuple[int, ...]] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)

    def compact(self) -> None:
        """A finished request's times as arrays of doubles (8 bytes a token each, against 32 in
        a list of floats), so that a served run's records cost ~1 KB a request, not ~2.3 KB
        (tokens stay a list of ints below 257: Python's shared small ints, 8 bytes a token;
        --check needs every one). Appending after it still works."""
        self.token_times = array("d", self.token_times)
        self.token_vtimes = array("d", self.token_vtimes)

    def add_token(self, token: int, wall_time: float, vtime: float = float("nan")) -> None:
        self.tokens.append(token)
        self.token_times.append(wall_time)
        self.token_vtimes.append(vtime)

    def projected_ttft_s(self) -> float:
        """Dispatch to first token on its die's 910C virtual clock (nan before one)."""
        return self.token_vtimes[0] - self.dispatched_vtime if self.token_vtimes else float("nan")

    def projected_tpot_s(self) -> float:
        if len(self.token_vtimes) < 2:
            return float("nan")
        return (self.token_vtimes[-1] - self.token_vtimes[0]) / (len(self.token_vtimes) - 1)

    def add_step(self, drafts: tuple[int, ...], num_accepted: int) -> None:
        self.step_drafts.append(tuple(drafts))
        self.step_accepted.append(num_accepted)

    def ttft_s(self, arrival_wall: float) -> float:
        arrival_wall = self.wall_arrival or arrival_wall
        return self.token_times[0] - arrival_wall if self.token_times else float("nan")

    def tpot_s(self) -> float:
        if len(self.token_times) < 2:
            return float("nan")
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def summarize(records: dict[int, RequestRecord], started: float, ended: float) -> dict:
    served = [r for r in records.values() if not r.rejected]
    ttft = np.array([r.ttft_s(started + r.req.arrival_s) for r in served]) * 1e3
    tpot = np.array([r.tpot_s() for r in served]) * 1e3
    num_tokens = sum(len(r.tokens) for r in served)
    wall = ended - started
    summary = {
        "num_requests": len(records),
        "num_served": len(served),
        "num_rejected": len(records) - len(served),
        "num_tokens": num_tokens,
        "wall_s": wall,
        "tokens_per_s": num_tokens / wall if wall > 0 else 0.0,
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        values = values[~np.isnan(values)]
        for q in (50, 90, 99):
            summary[f"{name}_p{q}"] = float(np.percentile(values, q)) if len(values) else 0.0
    return summary


def format_summary(s: dict) -> str:
    return (
        f"summary: {s['num_served']} requests served, {s['num_rejected']} rejected, "
        f"{s['num_tokens']} tokens in {s['wall_s']:.2f} s = {s['tokens_per_s']:.1f} tok/s; "
        f"TTFT p50/p90/p99 {s['ttft_ms_p50']:.1f}/{s['ttft_ms_p90']:.1f}/"
        f"{s['ttft_ms_p99']:.1f} ms; TPOT p50/p90/p99 {s['tpot_ms_p50']:.1f}/"
        f"{s['tpot_ms_p90']:.1f}/{s['tpot_ms_p99']:.1f} ms"
    )


def check_against_reference(
    cfg: Config, records: dict[int, RequestRecord], model=None
) -> tuple[int, int, list[str]]:
    """Re-run the single-process reference, with the run's MTP depth and XCCL's wire format,
    on the served requests (grouped by max_new_tokens) and compare tokens and, with MTP, every
    decode step's drafts and accepted count. Returns (requests, tokens, mismatch descriptions).
    `model`: the reference model built once by a caller that checks again and again (a
    served run's checker process), else built here."""
    # start-up: the reference model only in a --check run's host (docs/design.md, Layers)
    from xds_mpi.model.moe import Wire
    from xds_mpi.model.reference import GenerateOptions, ReferenceGenerator
    from xds_mpi.model.weights import build_model

    model = build_model(cfg.model) if model is None else model
    by_length: dict[tuple[int, bool], list[RequestRecord]] = defaultdict(list)
    for record in records.values():
        if not record.rejected and not record.lost:  # the lost are counted apart, by name
            ignore_eos = cfg.workload.ignore_eos or record.req.ignore_eos
            by_length[record.req.max_new_tokens, ignore_eos].append(record)
    mismatches, num_requests, num_tokens = [], 0, 0
    wire = Wire.for_config(cfg)
    for (max_new, ignore_eos), group in sorted(by_length.items()):
        options = GenerateOptions(
            max_new_tokens=max_new,
            mtp_depth=cfg.scheduler.mtp_depth,
            use_int8=cfg.xccl.use_int8,
            ignore_eos=ignore_eos,
            block_tokens=cfg.scheduler.kv_block_tokens,
            kv_int8=cfg.scheduler.kv_int8,
            row_dtype=wire.row_dtype,
            shared_path=wire.shared,
        )
        outputs = ReferenceGenerator(model, options).generate([list(r.req.prompt) for r in group])
        for record, out in zip(group, outputs):
            num_requests += 1
            if record.cancelled:  # ended early: its tokens are the reference's first ones
                out = out.cut(len(record.tokens), len(record.step_drafts))
            num_tokens += len(out.tokens)
            found = (
                token_mismatch(record, out),
                draft_mismatch(record, out) if options.mtp_depth else "",
            )
            mismatches += [m for m in found if m]
    return num_requests, num_tokens, mismatches


def token_mismatch(record: RequestRecord, out: RequestOutput) -> str:
    """The first token the request served differently from the reference's `out`, or ""."""
    if tuple(record.tokens) == tuple(out.tokens):
        return ""
    first = next(
        (i for i, (a, b) in enumerate(zip(record.tokens, out.tokens)) if a != b),
        min(len(record.tokens), len(out.tokens)),
    )
    return (
        f"request {record.req.req_id}: token {first} differs ({len(record.tokens)} tokens "
        f"served, {len(out.tokens)} in the reference)"
    )


def draft_mismatch(record: RequestRecord, out: RequestOutput) -> str:
    """The first decode step (0: the one after prefill, verifying the prefill's MTP drafts) whose
    drafts or accepted count differ from the reference's `out`, or a differing step count; ""
    when every step agrees. Greedy MTP serves the greedy tokens whatever it drafts, so only this
    shows a drafting error."""
    served = list(zip(record.step_drafts, record.step_accepted))
    reference = list(zip(out.step_drafts, out.step_accepted))
    req_id = record.req.req_id
    for step_idx, ((drafts, accepted), (ref_drafts, ref_accepted)) in enumerate(
        zip(served, reference)
    ):
        if (tuple(drafts), accepted) != (tuple(ref_drafts), ref_accepted):
            return (
                f"request {req_id}: step {step_idx} drafted {list(drafts)} and accepted "
                f"{accepted}, the reference drafted {list(ref_drafts)} and accepted "
                f"{ref_accepted}"
            )
    if len(served) != len(reference):
        return (
            f"request {req_id}: {len(served)} decode steps served, {len(reference)} in the "
            "reference"
        )
    return ""


def write_serving(
    f: h5py.File,
    records: dict[int, RequestRecord],
    started: float,
    summary: dict,
    die_timings: dict[int, dict[str, list]],
    die_recovery: dict[int, dict] | None = None,
) -> None:
    """Add /requests (one row per request), /dies/<rank> (per-iteration timings; recovery
    counters as attributes) and the summary as attributes of /summary."""
    ordered = [records[i] for i in sorted(records)]
    group = f.create_group("requests")
    group["req_id"] = np.array([r.req.req_id for r in ordered], np.int64)
    group["status"] = np.array(
        [request_status(r) for r in ordered],
        dtype=h5py.string_dtype(),
    )
    group["reason"] = np.array(
        [r.rejected or r.lost or r.cancelled for r in ordered], dtype=h5py.string_dtype()
    )
    group["arrival_s"] = np.array([r.req.arrival_s for r in ordered])  # after the run's start
    group["die_rank"] = np.array([r.die_rank for r in ordered], np.int64)
    group["prompt_len"] = np.array([len(r.req.prompt) for r in ordered], np.int64)
    group["num_tokens"] = np.array([len(r.tokens) for r in ordered], np.int64)
    group["ttft_s"] = np.array([r.ttft_s(started + r.req.arrival_s) for r in ordered])
    group["tpot_s"] = np.array([r.tpot_s() for r in ordered])
    write_vlen(group, "tokens", [r.tokens for r in ordered])
    # With MTP one entry per decode step (none without): every step's drafts concatenated, how
    # many each step verified, how many of them were accepted.
    write_vlen(group, "step_drafts", [[t for d in r.step_drafts for t in d] for r in ordered])
    write_vlen(group, "step_num_drafts", [[len(d) for d in r.step_drafts] for r in ordered])
    write_vlen(group, "step_num_accepted", [r.step_accepted for r in ordered])
    dies = f.create_group("dies")
    for rank, timings in sorted(die_timings.items()):
        die = dies.create_group(str(rank))
        for name, values in timings.items():
            die[name] = np.asarray(values)
        die.attrs.update((die_recovery or {}).get(rank, {}))
    f.create_group("summary").attrs.update(summary)


def request_status(r: RequestRecord) -> str:
    if r.rejected:
        return "rejected"
    return "lost" if r.lost else "cancelled" if r.cancelled else "done"


def write_vlen(group: h5py.Group, name: str, rows: list[list[int]]) -> None:
    """One variable-length int64 row per request."""
    data = group.create_dataset(name, (len(rows),), dtype=h5py.vlen_dtype(np.int64))
    for i, row in enumerate(rows):
        data[i] = np.array(row, np.int64)
