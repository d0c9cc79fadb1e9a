"""What the dies reported, summed over a serving run, and each sum's log line: the 910C
projection from their virtual clocks, MTP acceptance per DP group, and token recomputation.
The TE-shell adds these to the run's summary (the /summary attributes of the run file)."""

from __future__ import annotations

import numpy as np


def projected_summary(die_reports: dict, num_chips: float, num_cost_moe_layers: int) -> dict:
    """The 910C projection of a run from the dies' virtual clocks: decode-only iterations (no
    prompt rows on any die) give the iteration time, TPOT and tokens/s per chip; the virtual time
    each die spent per operation gives the breakdown (Figure 20) and the per-call latency of
    dispatch and combine (one call per cost-shape MoE layer)."""
    timings = [r.timings for r in die_reports.values()]
    if not timings or not timings[0]["vtime_s"]:
        return {}
    vtime = np.array([t["vtime_s"] for t in timings])  # [dies, iterations]
    rows = np.array([t["num_rows"] for t in timings])
    steps = np.array([t["num_sampled"] for t in timings])
    sampled = np.array([t["num_tokens"] for t in timings])
    drafted = np.array([t["num_drafted"] for t in timings])
    decode = (rows == steps + drafted).all(axis=0) & (rows.sum(axis=0) > 0)
    if not decode.any():
        decode = rows.sum(axis=0) > 0
    iteration = vtime.max(axis=0)[decode]
    out = {
        "projected_iteration_ms": float(iteration.mean() * 1e3),
        "projected_tpot_ms": float(
            iteration.mean()
            * 1e3
            * steps.sum(axis=0)[decode].sum()
            / max(sampled.sum(axis=0)[decode].sum(), 1)
        ),
        "projected_tokens_per_s_per_chip": float(
            (sampled.sum(axis=0)[decode] / iteration).mean() / num_chips
        ),
    }
    num_iterations = vtime.shape[1]
    ops = sorted({op for r in die_reports.values() for op in r.virtual_spent})
    for op in ops:
        mean = np.mean([r.virtual_spent.get(op, 0.0) for r in die_reports.values()])
        out[f"projected_ms_{op}"] = float(mean / num_iterations * 1e3)
    for op in ("dispatch", "combine", "A2E (overlapped)", "E2A"):
        if f"projected_ms_{op}" in out:
            out[f"projected_us_per_{op}"] = out[f"projected_ms_{op}"] * 1e3 / num_cost_moe_layers
    return out


def mtp_summary(depth: int, die_timings: dict[int, dict[str, list]]) -> dict:
    """MTP acceptance (accepted / drafted drafts) and tokens per decode step, overall and per DP
    group (die), from the dies' per-iteration counts."""
    if not depth or not die_timings:
        return {}
    ranks = sorted(die_timings)
    drafted = np.array([sum(die_timings[r]["num_drafted"]) for r in ranks])
    accepted = np.array([sum(die_timings[r]["num_accepted"]) for r in ranks])
    steps = np.array([sum(die_timings[r]["num_sampled"]) for r in ranks])
    tokens = np.array([sum(die_timings[r]["num_tokens"]) for r in ranks])
    return {
        "mtp_depth": depth,
        "mtp_drafted": int(drafted.sum()),
        "mtp_accepted": int(accepted.sum()),
        "mtp_acceptance": float(accepted.sum() / max(drafted.sum(), 1)),
        "tokens_per_step": float(tokens.sum() / max(steps.sum(), 1)),
        "mtp_group_ranks": np.array(ranks, np.int64),
        "mtp_group_acceptance": accepted / np.maximum(drafted, 1),
        "mtp_group_tokens_per_step": tokens / np.maximum(steps, 1),
    }


def recovery_summary(die_recovery: dict[int, dict]) -> dict:
    """Token recomputation over the run: faults injected (each die reports the total over all
    dies), rollbacks and recomputed iterations (every die rolls back together), wall and
    virtual time lost (the slowest die's)."""
    counters = [c for c in die_recovery.values() if c]
    if not counters:
        return {}
    return {
        "faults_injected": max(c["faults_injected"] for c in counters),
        "rollbacks": max(c["rollbacks"] for c in counters),
        "recomputed_iterations": max(c["recomputed_iterations"] for c in counters),
        "wall_lost_s": max(c["wall_lost_s"] for c in counters),
        "vtime_lost_s": max(c["vtime_lost_s"] for c in counters),
        "xccl_timeouts": max(c.get("timeouts", 0) for c in counters),
    }


def format_recovery(r: dict) -> str:
    return (
        f"recovery: {r['faults_injected']} faults injected, {r['rollbacks']} rollbacks, "
        f"{r['recomputed_iterations']} iterations recomputed, "
        f"{r.get('xccl_timeouts', 0)} after an XCCL timeout; lost {r['wall_lost_s']:.2f} s "
        f"wall, {r['vtime_lost_s'] * 1e3:.2f} ms virtual"
    )


def format_mtp(m: dict) -> str:
    groups = ", ".join(
        f"r{r} {a:.0%}" for r, a in zip(m["mtp_group_ranks"], m["mtp_group_acceptance"])
    )
    return (
        f"MTP depth {m['mtp_depth']}: acceptance {m['mtp_acceptance']:.1%} "
        f"({m['mtp_accepted']}/{m['mtp_drafted']} drafts), {m['tokens_per_step']:.2f} tokens "
        f"per step; per DP group: {groups}"
    )


def format_projection(p: dict) -> str:
    if "projected_iteration_ms" not in p:  # no die iterated (a TE given no request)
        return "projection: no iterations"
    ops = ", ".join(
        f"{k.removeprefix('projected_ms_')} {v:.2f}"
        for k, v in p.items()
        if k.startswith("projected_ms_")
    )
    primitives = ("A2E (overlapped)", "E2A") if "projected_ms_E2A" in p else ("dispatch", "combine")
    calls = ", ".join(f"{op} {p.get(f'projected_us_per_{op}', 0):.1f} us" for op in primitives)
    return (
        f"projected on 910C: iteration {p['projected_iteration_ms']:.2f} ms, TPOT "
        f"{p['projected_tpot_ms']:.2f} ms, {p['projected_tokens_per_s_per_chip']:.0f} tokens/s "
        f"per chip; per iteration (ms): {ops}; {calls} per call"
    )
