"""What `xds-mpi bench serve` reads from a served run: the trace's per-die MoE layers and waits,
the ranks' MPI time (launch/job/rank.py write_rank_stats) and the TE-shell's summary line.

Per die, a MoE layer's wall time is the sum of its spans (gate, dispatch, experts, combine:
the executor's meter, xds_mpi/execution/executor.py); its waiting is the "dispatch wait" and
"combine wait" spans inside them (xccl's WaitLog); its MPI time is the rank's MPI window calls
outside waits (xccl/wake.py) spread over its MoE layers; Python is the rest.
The jitter sample is each die's wait in the first dispatch of each iteration.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LAYER_SPANS = ("gate", "dispatch", "experts", "combine")
WAIT_SPANS = ("dispatch wait", "combine wait")
SUMMARY = re.compile(r"(\d+) tokens in ([\d.]+) s = ([\d.]+) tok/s")
TRACE = re.compile(r"INFO trace (\S+\.trace\.json)")
# ranks/core/ready.py's start-up line and the projection's line (absent from older checkouts).
STARTUP = re.compile(
    r"start-up: all \d+ ranks ready in ([\d.]+) s; CPU per rank median ([\d.]+) s, max [\d.]+ s"
    r"(?:; PSS per rank median (\d+) MiB, max \d+ MiB, ([\d.]+) GiB in all)?"
)
PROJECTED = re.compile(r"projected on \S+: iteration ([\d.]+) ms")


@dataclass(frozen=True, kw_only=True)
class ServeStats:
    tokens_per_s: float
    iteration_ms: float  # median wall time of an iteration, over dies and iterations
    moe_layer_ms: float  # wall per MoE layer per die (mean)
    wait_ms: float  # of which waiting for peers
    mpi_ms: float  # of which MPI window calls outside waits (nan: not timed)
    python_ms: float  # the rest
    first_dispatch_wait_ms: tuple[float, ...]  # one per die and iteration
    startup_s: float  # launch of the TE-shell to every rank built (nan: not reported)
    cpu_per_rank_s: float  # median CPU seconds of a rank until built
    pss_per_rank_mib: float  # median PSS of a rank once built
    pss_total_gib: float  # all ranks' PSS once built
    projected_iteration_ms: float  # the projection's iteration on the pod
    serving_s: float  # the summary's serving time
    wall_s: float  # the whole `xds-mpi run`, launch to exit


def parse_output(output: str) -> tuple[float, Path | None]:
    """tokens/s and the trace file from the TE-shell's log."""
    summary = SUMMARY.search(output)
    if summary is None:
        raise ValueError(f"no summary line in the run's output:\n{output[-3000:]}")
    trace = TRACE.search(output)
    return float(summary.group(3)), Path(trace.group(1)) if trace else None


def die_events(trace_path: Path) -> dict[int, list[dict]]:
    """Wall-clock spans of every die rank ("X" events), by trace thread (= rank)."""
    data = json.loads(trace_path.read_text())
    events = data["traceEvents"]
    wall = next(
        e["pid"]
        for e in events
        if e["name"] == "process_name" and e["args"]["name"] == "wall clock"
    )
    dies = {
        e["tid"]
        for e in events
        if e["name"] == "thread_name" and e["pid"] == wall and " die " in e["args"]["name"]
    }
    by_die = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["pid"] == wall and e["tid"] in dies:
            by_die[e["tid"]].append(e)
    return by_die


def first_dispatch_waits(events: list[dict]) -> list[float]:
    """ms: the first "dispatch wait" inside each "iteration" span of one die."""
    waits = sorted((e for e in events if e["name"] == "dispatch wait"), key=lambda e: e["ts"])
    starts = np.array([e["ts"] for e in waits])
    out = []
    for it in (e for e in events if e["name"] == "iteration"):
        i = int(np.searchsorted(starts, it["ts"]))
        if i < len(waits) and waits[i]["ts"] <= it["ts"] + it["dur"]:
            out.append(waits[i]["dur"] / 1e3)
    return out


def _floats(pattern: re.Pattern, output: str, count: int) -> list[float]:
    """The pattern's groups as floats (nan for a group or a line that is missing)."""
    found = pattern.search(output)
    groups = found.groups() if found else (None,) * count
    return [float(g) if g is not None else float("nan") for g in groups]


def summarize(output: str, stats_dir: Path | None, wall_s: float = float("nan")) -> ServeStats:
    """The run's numbers (see the module docstring)."""
    tokens_per_s, trace_path = parse_output(output)
    if trace_path is None:
        raise ValueError("bench serve needs the run's trace (run.trace: true)")
    by_die = die_events(trace_path)
    layers = walls = waits = 0.0
    iterations, jitter = [], []
    for events in by_die.values():
        layers += sum(e["name"] == "gate" for e in events)  # one gate span per MoE layer run
        walls += sum(e["dur"] for e in events if e["name"] in LAYER_SPANS)
        waits += sum(e["dur"] for e in events if e["name"] in WAIT_SPANS)
        iterations += [e["dur"] for e in events if e["name"] == "iteration"]
        jitter += first_dispatch_waits(events)
    mpi_s = _mpi_work_s(stats_dir, set(by_die))
    layers = max(layers, 1)
    wall_ms, wait_ms = walls / layers / 1e3, waits / layers / 1e3
    mpi_ms = mpi_s * 1e3 / layers if mpi_s is not None else float("nan")
    python_ms = wall_ms - wait_ms - (0.0 if mpi_s is None else mpi_ms)
    return ServeStats(
        tokens_per_s=tokens_per_s,
        iteration_ms=float(np.median(iterations)) / 1e3 if iterations else float("nan"),
        moe_layer_ms=wall_ms,
        wait_ms=wait_ms,
        mpi_ms=mpi_ms,
        python_ms=python_ms,
        first_dispatch_wait_ms=tuple(jitter),
        **dict(
            zip(
                ("startup_s", "cpu_per_rank_s", "pss_per_rank_mib", "pss_total_gib"),
                _floats(STARTUP, output, 4),
            )
        ),
        projected_iteration_ms=_floats(PROJECTED, output, 1)[0],
        serving_s=float(SUMMARY.search(output).group(2)),
        wall_s=wall_s,
    )


def _mpi_work_s(stats_dir: Path | None, ranks: set[int]) -> float | None:
    """The die ranks' MPI time outside waits, summed; None when the ranks wrote none."""
    if stats_dir is None:
        return None
    files = [stats_dir / f"rank{r}.json" for r in ranks]
    if not all(f.exists() for f in files):
        return None
    return sum(json.loads(f.read_text())["mpi_work_s"] for f in files)
