"""What `xds-mpi report` reads from one run: the run file (summary, per-die iterations, requests,
the failure records of /failures) and, when it sits beside it, the run's trace (per-iteration
breakdown on the 910C clock, expert load per layer and expert, faults and recoveries on the wall
clock)."""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from xds_mpi.report.trace_writer import VIRTUAL_PID, WALL_PID, trace_path

# The breakdown's parts (Figure 20's kernels): leaf spans on the virtual clock; a wait is shown
# apart from the rest of its operation.
BREAKDOWN = (
    "attention",
    "gate",
    "dispatch wait",
    "dispatch",
    "experts",
    "combine wait",
    "combine",
    "sampling",
)
RECOVERY_SPANS = ("fault", "rollback", "recompute")


@dataclass(frozen=True, kw_only=True)
class RunData:
    """One run for the report. breakdown: part -> [iterations] projected ms, mean over the dies
    (from the trace; empty without one); expert_load: [moe layers, experts] rows received, with
    load_layers the layer index of each row; recovery: (name, wall s since serving started,
    duration s); failures: the run file's /failures records (xds_mpi/results/failures.py), one
    dict of its fields each (times in wall seconds since serving started, virtual seconds on the
    die's clock, -1 for never)."""

    name: str
    attrs: dict
    summary: dict
    dies: dict[int, dict[str, np.ndarray]]
    requests: dict[str, np.ndarray]
    has_trace: bool = False
    breakdown: dict[str, np.ndarray] = field(default_factory=dict)
    expert_load: np.ndarray | None = None
    load_layers: tuple[int, ...] = ()
    recovery: list[tuple[str, float, float]] = field(default_factory=list)
    eplb_loads: dict[str, np.ndarray] = field(default_factory=dict)  # EPLB before/after below
    failures: list[dict] = field(default_factory=list)
    cluster: dict = field(default_factory=dict)  # a cluster's routing (`cluster_data`)


def eplb_loads(f: h5py.File) -> dict[str, np.ndarray]:
    """EPLB's measured die load per placement version with steady iterations ("v0" = the static
    placement before any swap, "after" = every later version pooled): [MoE layers, dies] routed
    rows per iteration each; {} without EPLB."""
    if "eplb" not in f:
        return {}
    return {
        name: group["die_rows"][()] / max(1, int(group.attrs["num_iterations"]))
        for name, group in f["eplb"].items()
        if isinstance(group, h5py.Group)
    }


def cluster_data(f: h5py.File) -> dict:
    """A cluster's run file (docs/cluster.md): per request (by req_id) its TE, first TE, routing
    time and virtual JCT; per TE its kind, group and loss time; the scale events; the pool's
    turns; the run's last finish; the decision log's regret per routed request. {} for one
    TE's run."""
    if "cluster" not in f or "virtual" not in f:
        return {}
    group, virtual = f["cluster"], f["virtual"]
    jct = dict(zip(virtual["req_id"][()], virtual["finish_s"][()] - virtual["arrival_s"][()]))
    ttft = virtual["first_token_s"][()] - virtual["arrival_s"][()]
    ids = group["req_id"][()]
    out = {
        "policy": str(group.attrs["policy"]),
        "te": group["te"][()],
        "first_te": group["first_te"][()] if "first_te" in group else group["te"][()],
        "routed_s": group["routed_s"][()],
        "jct_s": np.array([jct.get(r, np.nan) for r in ids]),
        "arrival_s": virtual["arrival_s"][()],  # per request that produced a token
        "ttft_s": ttft,
        "te_standby": group["te_standby"][()] if "te_standby" in group else np.array([]),
        "te_kind": [k.decode() for k in group["te_kind"][()]] if "te_kind" in group else [],
        "te_group": [k.decode() for k in group["te_group"][()]] if "te_group" in group else [],
        "te_lost_s": group["te_lost_s"][()] if "te_lost_s" in group else np.array([]),
        "scaling": {k: v[()] for k, v in group["scaling"].items()} if "scaling" in group else {},
        # the pool of ranks' turns (docs/cluster.md "A pool of ranks"): te, rank, die, taken_s,
        # given_back_s per row; {} without a pool
        "pool": {k: v[()] for k, v in group["pool"].items()} if "pool" in group else {},
        "end_s": float(np.nanmax(virtual["finish_s"][()], initial=0.0)),  # the last finish
        "regret_s": (
            group["decisions"]["regret_s"][()]
            if "decisions" in group and "regret_s" in group["decisions"]
            else np.array([])
        ),
    }
    if out["scaling"]:
        out["scaling"]["kind"] = [k.decode() for k in out["scaling"]["kind"]]
        names = out["scaling"].get("step_name", np.array([], dtype=object))
        out["scaling"]["step_name"] = [n.decode() if isinstance(n, bytes) else n for n in names]
    return out


def failures(f: h5py.File) -> list[dict]:
    """The /failures group (one dataset per field, one entry per failure) as one dict per
    failure; [] without one. Read by field name, not through xds_mpi/results/failures.py (a
    layer above this one): a field added there shows up here as it is."""
    if "failures" not in f:
        return []
    columns = {name: data[()] for name, data in f["failures"].items()}
    count = len(next(iter(columns.values()), ()))
    return [
        {name: _plain_value(column[i]) for name, column in columns.items()} for i in range(count)
    ]


def _plain_value(value):
    """One entry of a /failures column: bytes as str, numpy scalars as Python numbers, a
    variable-length id list as a tuple."""
    if isinstance(value, np.ndarray):
        return tuple(int(v) for v in value)
    return _plain(value)


def load_run(path: str | Path) -> RunData:
    path = Path(path)
    with h5py.File(path, "r") as f:
        parts = dict(
            name=path.stem,
            attrs={k: _plain(v) for k, v in f.attrs.items()},
            summary={k: _plain(v) for k, v in f["summary"].attrs.items()} if "summary" in f else {},
            dies={
                int(rank): {name: group[name][()] for name in group}
                for rank, group in f.get("dies", {}).items()
            },
            requests={name: f["requests"][name][()] for name in ("ttft_s", "tpot_s", "die_rank")},
            eplb_loads=eplb_loads(f),
            failures=failures(f),
            cluster=cluster_data(f),
        )
    traced = trace_path(path)
    if traced.exists():
        parts.update(_from_trace(json.loads(traced.read_text())["traceEvents"]))
    return RunData(**parts)


def _from_trace(events: list[dict]) -> dict:
    """RunData's fields that come from the trace."""
    layers, load = expert_load(events)
    # The trace counts from its first event, the failure records from the TE-shell's "serve"
    # span (serving started): the recovery panel shows both from the latter.
    start_us = min((e["ts"] for e in events if e["name"] == "serve" and e["pid"] == WALL_PID),
                   default=0.0)  # fmt: skip
    return dict(
        has_trace=True,
        breakdown=breakdown(events),
        expert_load=load,
        load_layers=layers,
        recovery=[
            (e["name"], (e["ts"] - start_us) / 1e6, e.get("dur", 0.0) / 1e6)
            for e in events
            if e["pid"] == WALL_PID and e["name"] in RECOVERY_SPANS
        ],
    )


def breakdown(events: list[dict]) -> dict[str, np.ndarray]:
    """part -> [iterations] projected ms per iteration, the mean over the dies; "other" is the
    iteration's time outside every part (embedding, dense FFN, MTP heads, the bubble)."""
    spans = defaultdict(list)  # die -> its spans on the virtual clock, in time order
    for e in events:
        if e["pid"] == VIRTUAL_PID and e["ph"] == "X":
            spans[e["tid"]].append(e)
    per_die = [_die_breakdown(sorted(s, key=lambda e: e["ts"])) for s in spans.values()]
    per_die = [b for b in per_die if b]
    if not per_die:
        return {}
    num = min(len(b["iteration"]) for b in per_die)
    parts = (*BREAKDOWN, "other")
    return {p: np.mean([b[p][:num] for b in per_die], axis=0) / 1e3 for p in parts}


def _die_breakdown(spans: list[dict]) -> dict[str, np.ndarray]:
    """One die's virtual microseconds per part and iteration ({} for a die without iterations)."""
    iterations = [e for e in spans if e["name"] == "iteration"]
    if not iterations:
        return {}
    starts = [e["ts"] for e in iterations]
    out = {p: np.zeros(len(iterations)) for p in (*BREAKDOWN, "iteration")}
    out["iteration"] = np.array([e["dur"] for e in iterations], float)
    for e in spans:
        if e["name"] in BREAKDOWN:
            out[e["name"]][bisect.bisect_right(starts, e["ts"]) - 1] += e["dur"]
    for op in ("dispatch", "combine"):  # the operation's own time, its wait apart
        out[op] -= out[f"{op} wait"]
    out["other"] = np.maximum(out["iteration"] - sum(out[p] for p in BREAKDOWN), 0.0)
    return out


def expert_load(events: list[dict]) -> tuple[tuple[int, ...], np.ndarray | None]:
    """(layers, [layers, experts] rows each routed expert received), from the "experts" spans'
    arguments on the wall clock (rolled-back attempts left out)."""
    rows: dict[tuple[int, int], int] = defaultdict(int)
    for e in events:
        args = e.get("args", {})
        if e["pid"] == WALL_PID and e["name"] == "experts" and "experts" in args:
            if not args.get("rolled_back"):
                for expert, num in zip(args["experts"], args["rows"]):
                    if expert >= 0:
                        rows[args["layer"], expert] += num
    if not rows:
        return (), None
    layers = tuple(sorted({layer for layer, _ in rows}))
    load = np.zeros((len(layers), max(e for _, e in rows) + 1), np.int64)
    for (layer, expert), num in rows.items():
        load[layers.index(layer), expert] += num
    return layers, load


def _plain(value):
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value
