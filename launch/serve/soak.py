"""`xds-mpi bench soak`: `xds-mpi serve --check` driven at steady concurrency for minutes while
a schedule of faults strikes its dies; what the clients saw, what the run file says was
injected and recovered, each rank's RSS after warm-up and at the end, the check, and the
processes left behind (docs/serve.md, "A soak under faults").

The schedule (`fault_schedule`) places its rows at fractions of the run after warm-up, in
iterations at the expected `--iterations-per-s`: two dies lost (one dead, one stuck for good;
ring replicas keep every expert), stuck dies that come back before detection (flaps), and
transient XCCL faults at `--fault-rate` per die per iteration throughout. A row whose iteration
the run never reaches does not fire; the report counts the failures the run file recorded, not
the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from launch.bench.results import report
from launch.serve.bench_endpoint import free_port, wait_ready
from launch.serve.soak_clients import MARKER_ENV, Outcomes, drive, job_processes, job_ranks, rss_mib
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.workload.stream import synthetic_requests

CHECK = re.compile(r"check: (\d+) requests, (\d+) tokens, (\d+) mismatches")
RUN_FILE = re.compile(r"run file (\S+\.h5)")
DROPPED = re.compile(r"records: let (\d+) finished requests")
# Failover settings the schedule needs: heartbeats that find a silent die in seconds, and ring
# replicas so that two non-neighbouring dies lost keep a replica of every expert.
FAILOVER_SETS = [
    "health.timeout_s=4",
    "health.dp_interval_s=0.2",
    "deployment.redundant_slots_per_die=4",
    "health.replicas=ring",
]
# (fraction of the run, row): `die` is the rank; a die takes one row at most. Ranks 1 and 3 are
# lost; rank 2 keeps rank 3's experts and rank 4 rank 1's (the ring), so ranks 2 and 4 serve to
# the end, each stuck once for less than health.timeout_s before (a flap: nobody is lost).
SCHEDULE = (
    (0.15, "{kind: stuck, die: 2, duration_s: 1.5}"),
    (0.30, "{kind: dead, die: 1}"),
    (0.50, "{kind: stuck, die: 4, duration_s: 1.0}"),
    (0.70, "{kind: stuck, die: 3, duration_s: 0}"),
)


@dataclass(frozen=True, kw_only=True)
class SoakResult:
    """requests: replies the clients got, by kind (soak_clients.Outcomes); errors: those a
    client cannot retry; faults: the run file's failure records (kind, die, verdict, recovery)
    and the summary's transient counts; rss_*: MiB per rank after warm-up and at the end;
    samples: [(seconds since serving was ready, {rank: MiB})], every --sample-s;
    left: processes of the job alive after the launcher ended."""

    minutes: float
    streams: int
    requests: dict
    errors: int
    tokens: int
    failures: list
    faults_injected: int
    rollbacks: int
    checked: int
    mismatches: int
    records_dropped: int
    rss_start: dict
    rss_end: dict
    samples: list
    left: list
    run_file: str
    log: str


def fault_schedule(warmup_s: float, duration_s: float, iterations_per_s: float) -> str:
    """The `faults.events` list: each SCHEDULE row at its fraction of the `duration_s` that
    follows `warmup_s` (iterations count from serving's start)."""
    rows = []
    for fraction, row in SCHEDULE:
        iteration = max(1, round((warmup_s + fraction * duration_s) * iterations_per_s))
        rows.append(row.replace("{", f"{{iteration: {iteration}, ", 1))
    return "[" + ", ".join(rows) + "]"


def serve_sets(args, duration_s: float) -> list[str]:
    sets = [
        f"run.output_dir={args.dir}",
        f"run.timeout_s={duration_s + args.warmup_s + 900:.0f}",
        "workload.ignore_eos=true",
    ]
    if args.faults:
        sets += FAILOVER_SETS + [
            f"faults.events={fault_schedule(args.warmup_s, duration_s, args.iterations_per_s)}",
            f"faults.rate={args.fault_rate}",
            "faults.rate_unit=iteration",
            "faults.max_retries=8",
        ]
    return sets + args.set


class RssWatch:
    """Samples every rank's RSS every `every_s` seconds in a thread; `samples` is
    [(seconds since start, {rank: MiB})]."""

    def __init__(self, marker: str, every_s: float) -> None:
        self.marker, self.every_s = marker, every_s
        self.samples: list[tuple[float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            ranks = job_ranks(self.marker)
            rss = {rank: rss_mib(pid) for rank, pid in sorted(ranks.items())}
            self.samples.append((time.monotonic() - self._started, rss))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, seconds: float) -> dict[int, float]:
        """The first sample at or after `seconds` (the last one if none)."""
        later = [rss for t, rss in self.samples if t >= seconds]
        return later[0] if later else (self.samples[-1][1] if self.samples else {})


def soak(args) -> SoakResult:
    duration_s = args.minutes * 60
    cfg = load_config(args.config, [f"workload.prompt_len={args.prompt_len}"])
    prompts = [list(r.prompt) for r in synthetic_requests(cfg.workload)]
    port, marker = free_port(), uuid.uuid4().hex
    command = [sys.executable, "-m", "launch.cli", "serve", str(args.config), "--check"]
    command += ["--port", str(port), "--max-records", str(args.max_records)]
    command += ["--trace-max-events", str(args.trace_max_events)]
    for text in serve_sets(args, duration_s):
        command += ["--set", text]
    log = Path(args.dir, "serve.log")
    env = {**os.environ, MARKER_ENV: marker}
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_ready(url, args.timeout, proc))
            watch = RssWatch(marker, args.sample_s)
            until = time.monotonic() + args.warmup_s + duration_s
            outcomes = asyncio.run(drive(url, prompts, args.output_len, args.streams, until))
            watch.stop()
        finally:
            _stop(proc, args.timeout)
    time.sleep(1.0)  # mpiexec's proxies end a moment after it
    return _result(args, outcomes, watch, log, job_processes(marker))


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM: the TE-shell drains, checks and writes the run file; a second one ends all."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.wait()


def _result(args, outcomes: Outcomes, watch: RssWatch, log: Path, left: list[int]):
    import h5py  # here: a measured start-up cost of every command

    from xds_mpi.results.failures import read_failures

    output = log.read_text()
    checked = CHECK.search(output)
    found = RUN_FILE.search(output)
    failures, summary = [], {}
    if found:
        with h5py.File(found.group(1), "r") as f:
            failures = [r.describe() for r in read_failures(f)]
            summary = dict(f["summary"].attrs) if "summary" in f else {}
    return SoakResult(
        minutes=args.minutes,
        streams=args.streams,
        requests=dict(outcomes.kinds),
        errors=outcomes.num_errors,
        tokens=outcomes.tokens,
        failures=failures,
        faults_injected=int(summary.get("faults_injected", 0)),
        rollbacks=int(summary.get("rollbacks", 0)),
        checked=int(checked.group(1)) if checked else -1,
        mismatches=int(checked.group(3)) if checked else -1,
        records_dropped=int(dropped.group(1)) if (dropped := DROPPED.search(output)) else 0,
        rss_start=watch.at(args.warmup_s),
        rss_end=watch.samples[-1][1] if watch.samples else {},
        samples=[(round(t, 1), rss) for t, rss in watch.samples],
        left=left,
        run_file=found.group(1) if found else "",
        log=str(log),
    )


def rows(result: SoakResult) -> list[dict]:
    """One row per rank: RSS after warm-up, at the end, and the growth."""
    return [
        {
            "rank": rank,
            "rss_start_mib": start,
            "rss_end_mib": result.rss_end.get(rank, float("nan")),
            "growth_mib": result.rss_end.get(rank, float("nan")) - start,
        }
        for rank, start in sorted(result.rss_start.items())
    ]


def cmd_bench_soak(args: argparse.Namespace) -> int:
    args.config = resolve_config(args.config)
    if args.minutes <= 0 or args.streams < 1:
        raise ConfigError("bench soak: --minutes must be > 0 and --streams >= 1")
    if not args.dir:
        args.dir = Path.cwd() / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    result = soak(args)
    Path(args.dir, "soak.json").write_text(json.dumps(asdict(result), indent=1))
    print(f"requests by kind: {result.requests}; {result.errors} errors; {result.tokens} tokens")
    print(f"faults: {result.faults_injected} transient injected, {result.rollbacks} rollbacks")
    for line in result.failures:
        print(f"  {line}")
    print(
        f"check: {result.checked} requests, {result.mismatches} mismatches; "
        f"{result.records_dropped} records checked and let go while serving"
    )
    print(f"processes left after: {len(result.left)} {result.left}")
    title = f"xds-mpi bench soak: {args.minutes:g} min, {args.streams} streams ({args.dir})"
    legend = "RSS per rank (MiB) after --warmup-s and at the end; rank 0 is the TE-shell."
    report(rows(result), ["rank", "rss_start_mib", "rss_end_mib", "growth_mib"], args,
           title=title, legend=legend)  # fmt: skip
    is_clean = result.errors == 0 and result.mismatches == 0 and not result.left
    return 0 if is_clean else 1


def add_parser(kinds) -> None:
    p = kinds.add_parser(
        "soak",
        help="xds-mpi serve --check under steady load and a fault schedule, RSS per rank",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--config", default="colocated", help="a colocated config (default colocated)")
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load after warm-up")
    p.add_argument("--warmup-s", type=float, default=30.0, help="load before RSS is taken")
    p.add_argument("--streams", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--no-faults", dest="faults", action="store_false", help="no schedule")
    p.add_argument(
        "--iterations-per-s",
        type=float,
        default=20.0,
        help="expected iterations per second, to place the schedule's rows (default 20: the "
        "2-core workstation at 16 streams, 20-27 on 4 dies)",
    )
    p.add_argument(
        "--fault-rate", type=float, default=0.01, help="transient faults per die per iteration"
    )
    p.add_argument(
        "--max-records",
        type=int,
        default=1000,
        help="xds-mpi serve --max-records: finished records the TE-shell keeps (default "
        "%(default)d: a soak lets records go and checks them as they go)",
    )
    p.add_argument(
        "--trace-max-events",
        type=int,
        default=20_000,
        help="xds-mpi serve --trace-max-events (default %(default)d)",
    )
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--dir", default="", help="the run's folder (log, run file, soak.json)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", default="", help="write the RSS table to FILE.csv or FILE.h5")
    p.add_argument("--timeout", type=float, default=600, help="seconds to start and to stop")
    p.add_argument("--profile", default="ascend910c", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench_soak)
