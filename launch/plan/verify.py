"""`xds-mpi plan --verify N`: the top N candidates run by emulation at a reduced width that keeps
their structure, on the virtual clock, beside what the planner prices for that same reduced
deployment and workload (docs/planning.md, "Verify few").

Reduced: a colocated EP group to 2 dies (configs/colocated.yaml's tiny model); PD to 2 decode
dies and the prefill TEs' dies scaled by the same factor (at least one TP group); afd to one
attention die per DP domain, as many expert dies, and one prefill die (configs/pd_afd.yaml).
The window's first requests arrive at the rate x the factor (decode DP groups reduced / full),
their lengths x --verify-length-scale (the tiny model serves them at those lengths, which the
dies' clocks price). Each row: goodput planned and emulated (goal: within GOODPUT_GOAL), and
the latency distributions' agreement (xds_mpi/planning/agreement.py: TTFT and TPOT p50 and p99,
the requests whose SLO verdict flips)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from launch.report.tables import format_table
from launch.serve.bench import run_launcher
from xds_mpi.planning.agreement import FLIP_GOAL, PERCENTILE_GOAL, Quantile, agreement
from xds_mpi.planning.candidates import Candidate
from xds_mpi.planning.costs import base_config
from xds_mpi.planning.frontier import Outcome, outcome
from xds_mpi.planning.prefill_batches import PrefillRule
from xds_mpi.planning.queue import Served
from xds_mpi.planning.search import Planner, Priced
from xds_mpi.planning.workload import PlanWorkload

DECODE_DIES = 2
CHUNK_TOKENS = 256  # the reduced runs' prefill chunk, planned and emulated alike
KV_BLOCK_TOKENS = 16
GOODPUT_GOAL = 0.10  # issue 63: planned goodput within 10 % of the emulated


def reduced(c: Candidate) -> tuple[Candidate, str, float]:
    """(the reduced candidate, the config it goes over, the width factor)."""
    r, base, factor = _reduced(c)
    pre = f" + {r.prefill_dies}P tp{r.prefill_tp}" if r.prefill_dies else ""
    return replace(r, label=f"{r.decode_dies}D{pre} ({base}) x{factor:.3g}"), base, factor


def _reduced(c: Candidate) -> tuple[Candidate, str, float]:
    common = [
        f"scheduler.mtp_depth={c.mtp_depth}",
        f"scheduler.kv_int8={str(c.kv_int8).lower()}",
        f"scheduler.max_batch_per_die={c.max_batch}",
    ]
    if c.kind == "afd":
        get = dict(s.split("=", 1) for s in c.sets)
        domains = min(2, int(get["deployment.num_dp_domains"]))
        groups = int(get["deployment.num_dp_domains"]) * int(get["deployment.dp_groups_per_domain"])
        sets = [
            f"deployment.num_dp_domains={domains}",
            "deployment.dp_groups_per_domain=1",
            f"deployment.num_expert_dies={domains}",
            "deployment.num_prefill_dies=1",
            "deployment.prefill_tp=1",
            *common,
        ]
        r = replace(
            c,
            decode_dies=2 * domains,
            prefill_dies=1,
            num_prefill_tes=1,
            prefill_tp=1,
            sets=tuple(sets),
        )
        return r, "pd_afd", domains / groups
    factor = DECODE_DIES / c.decode_dies
    sets = [f"deployment.dp_groups_per_domain={DECODE_DIES}", *common]
    if not c.prefill_dies:
        sets += ["deployment.shared_experts=every_die", "deployment.num_shared_expert_dies=0"]
        return replace(c, decode_dies=DECODE_DIES, sets=tuple(sets)), "colocated", factor
    tp = c.prefill_tp
    prefill = max(tp, round(c.prefill_dies * factor / tp) * tp)
    sets += [f"deployment.num_prefill_dies={prefill}", f"deployment.prefill_tp={tp}"]
    r = replace(
        c, decode_dies=DECODE_DIES, prefill_dies=prefill, num_prefill_tes=1, sets=tuple(sets)
    )
    return r, "pd", factor


def reduced_workload(w: PlanWorkload, num: int, factor: float, scale: float) -> PlanWorkload:
    first = PlanWorkload(
        arrival_s=w.arrival_s[:num],
        prompt_len=w.prompt_len[:num],
        output_len=w.output_len[:num],
        duration_s=w.duration_s,
        source=f"first {num} of {w.source}",
    )
    span = float(first.arrival_s[-1] - first.arrival_s[0]) if num > 1 else 0.0
    first = replace(first, duration_s=max(span, 1e-3) * (num / max(num - 1, 1)))
    return first.scaled(rate_factor=factor, length_scale=scale)


def write_trace(path: Path, w: PlanWorkload) -> None:
    """The workload as a Mooncake trace: ms timestamps, distinct hash ids per request."""
    next_id, lines = 0, []
    for a, p, o in zip(w.arrival_s, w.prompt_len, w.output_len):
        blocks = math.ceil(int(p) / 512)
        ids = list(range(next_id, next_id + blocks))
        next_id += blocks
        lines.append(
            json.dumps(
                {
                    "timestamp": round(float(a) * 1e3, 3),
                    "input_length": int(p),
                    "output_length": int(o),
                    "hash_ids": ids,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")


@dataclass(frozen=True, kw_only=True)
class Emulated:
    """One emulation's requests on the virtual clock and the MTP acceptance its dies saw (the
    tiny model's drafts: the planner re-prices the reduced deployment at it)."""

    served: Served
    accept: float | None  # None: no MTP
    tokens_per_step: np.ndarray | None  # [n] each request's 1 + depth x its own acceptance


def pass_tokens(r: Candidate, w: PlanWorkload) -> tuple[int, int]:
    """(scheduler.prefill_chunk_tokens, xccl.max_tokens_per_die) of a reduced run: a prefill die
    may prefill the longest prompt in one pass; a colocated die in CHUNK_TOKENS chunks, as the
    planner prices those."""
    chunk = CHUNK_TOKENS if not r.prefill_dies else int(w.prompt_len.max())
    return chunk, max(chunk, r.max_batch * (1 + r.mtp_depth))


def emulated_prefill_rule(w: PlanWorkload, base: str, profile: str):
    """A reduced candidate's prefill batching as its emulation is configured (`emulate`)."""

    def rule(r: Candidate) -> PrefillRule:
        chunk, max_tokens = pass_tokens(r, w)
        cfg = base_config(r.sets, profile, base)
        return PrefillRule(
            step_tokens=max_tokens,
            chunk_tokens=chunk,
            long_prompt_tokens=cfg.pd.long_prompt_tokens,
            max_batch=r.max_batch,
            mtp_depth=r.mtp_depth,
        )

    return rule


def emulate(args, r: Candidate, base: str, w: PlanWorkload, out: Path, name: str) -> Emulated:
    trace = out / f"{name}.jsonl"
    write_trace(trace, w)
    longest = int((w.prompt_len + w.output_len).max()) + 8
    blocks = math.ceil(r.max_batch * longest / KV_BLOCK_TOKENS) + 64
    chunk, max_tokens = pass_tokens(r, w)
    sets = [
        *r.sets,
        "workload.source=trace",
        f"trace.path={trace}",
        "trace.length_scale=1",
        "trace.output_scale=1",
        "workload.ignore_eos=true",
        "run.clock=virtual",
        "run.trace=false",
        "health.enabled=false",
        f"scheduler.num_kv_blocks_per_die={blocks}",
        f"scheduler.prefill_chunk_tokens={chunk}",
        f"xccl.max_tokens_per_die={max_tokens}",
        f"model.max_seq_len={max(4096, longest)}",
        f"run.output_dir={out}",
        f"run.name={name}",
    ]
    command = [sys.executable, "-m", "launch.cli.main", "run", base]
    command += [a for s in sets for a in ("--set", s)]
    done = run_launcher(command, cwd=Path.cwd(), env=None, timeout_s=args.timeout)
    path = out / f"{name}.h5"
    if done.returncode or not path.exists():
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
        raise RuntimeError(f"{name}: exit code {done.returncode}\n{tail}")
    return read_served(path, w)


def read_served(path: Path, w: PlanWorkload) -> Emulated:
    import h5py  # here: a measured start-up cost of every command (launch/cli imports this)

    with h5py.File(path, "r") as f:
        summary = f["summary"].attrs
        depth = int(summary.get("mtp_depth", 0))
        accept = float(summary["mtp_acceptance"]) if depth else None
        tps = np.full(w.num_requests, 1.0 + depth * (accept or 0.0))
        r = f["requests"]
        for req, drafts, accepted in zip(
            r["req_id"][:], r["step_num_drafts"][:], r["step_num_accepted"][:]
        ):
            if depth and np.sum(drafts):
                tps[req] = 1.0 + depth * float(np.sum(accepted)) / float(np.sum(drafts))
        v = f["virtual"]
        ids = v["req_id"][:]
        first, finish = np.full(w.num_requests, np.nan), np.full(w.num_requests, np.nan)
        first[ids], finish[ids] = v["first_token_s"][:], v["finish_s"][:]
        arrival = np.full(w.num_requests, np.nan)
        arrival[ids] = v["arrival_s"][:]
    outputs = w.output_len
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(outputs > 1, (finish - first) / (outputs - 1), np.nan)
    served = Served(first_s=first, finish_s=finish, ttft_s=first - arrival, tpot_s=tpot)
    return Emulated(served=served, accept=accept, tokens_per_step=tps if depth else None)


def verify(args: argparse.Namespace, planner: Planner, top: list[Priced], out: Path) -> None:
    rows = []
    for n, p in enumerate(top, start=1):
        r, base, factor = reduced(p.candidate)
        w = reduced_workload(planner.w, args.verify_requests, factor, args.verify_length_scale)
        print(
            f"plan: verify {n}/{len(top)}: {p.candidate.label} reduced to {r.num_dies} dies "
            f"({base}), {w.num_requests} requests at {w.rate:.2f}/s",
            flush=True,
        )
        try:
            run = emulate(args, r, base, w, out, f"verify_{n}")
        except (RuntimeError, OSError, KeyError) as exc:
            print(f"plan: verify {n}: emulation failed: {exc}")
            planned = _small(planner, w, base, planner.accept).price(r)[1]
            rows.append(_row(n, p, r, planned, None, None))
            continue
        # like with like: the tiny model's dies accept fewer drafts than the pod's --accept,
        # and each request its own share (its tokens decide how many steps it takes)
        accept = planner.accept if run.accept is None else run.accept
        planned_served, planned = _small(planner, w, base, accept).price(r, run.tokens_per_step)
        chips = r.chips(planner.dies_per_chip)
        emulated = outcome(
            run.served,
            output_len=w.output_len,
            duration_s=w.duration_s,
            chips=chips,
            slo=planner.slo,
        )
        a = agreement(planned_served, run.served, planner.slo)
        rows.append(_row(n, p, r, planned, emulated, a))
    print("\nplanned vs emulated at the reduced width (virtual clock):")
    print(format_table(HEADER, rows))
    print(
        f"goodput: MISS beyond {GOODPUT_GOAL:.0%}; distributions (TTFT, TPOT p50 and p99: "
        f"planned / emulated - 1; verdict flips: requests met in one and missed in the other): "
        f"MISS beyond {PERCENTILE_GOAL:.0%} or {FLIP_GOAL:.0%} flipped"
    )


def _small(planner: Planner, w: PlanWorkload, base: str, accept: float) -> Planner:
    """The planner for the reduced deployment: the same SLO and profile, the reduced workload
    and base config, the reduced runs' prefill chunk and batching."""
    return Planner(
        w,
        planner.slo,
        profile=planner.profile,
        accept=accept,
        base=base,
        chunk_tokens=CHUNK_TOKENS,
        prefill_rule=emulated_prefill_rule(w, base, planner.profile),
    )


HEADER = [
    "#",
    "candidate",
    "reduced",
    "goodput planned / emulated",
    "error",
    "TTFT p50 | p99 s planned / emulated (error)",
    "TPOT p50 | p99 ms planned / emulated (error)",
    "verdict flips",
    "distributions",
]


def _row(n, p: Priced, r: Candidate, planned: Outcome, emulated: Outcome | None, a):
    if emulated is None:
        failed = [f"{planned.goodput_per_chip:.4f} / failed"] + [""] * (len(HEADER) - 4)
        return [str(n), p.candidate.label, r.label, *failed]
    err = (
        planned.goodput_per_chip / emulated.goodput_per_chip - 1
        if emulated.goodput_per_chip
        else float("nan")
    )
    miss = "" if abs(err) <= GOODPUT_GOAL else " MISS"
    return [
        str(n),
        p.candidate.label,
        r.label,
        f"{planned.goodput_per_chip:.4f} / {emulated.goodput_per_chip:.4f}",
        f"{err:+.0%}{miss}",
        f"{_pair(a.ttft_p50, '.3f', 1)} | {_pair(a.ttft_p99, '.3f', 1)}",
        f"{_pair(a.tpot_p50, '.1f', 1e3)} | {_pair(a.tpot_p99, '.1f', 1e3)}",
        f"{a.num_flips}/{a.num_requests} ({a.flip_share:.0%})",
        "agree" if a.is_met else "MISS",
    ]


def _pair(q: Quantile, fmt: str, unit: float) -> str:
    """'planned / emulated (error)' in seconds x unit."""
    return f"{q.planned * unit:{fmt}} / {q.emulated * unit:{fmt}} ({q.error:+.0%})"
