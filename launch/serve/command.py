"""`xds-mpi serve [CONFIG]`: launch the deployment with an OpenAI-compatible endpoint on the
TE-shell (ranks/shell/endpoint.py; a cluster's on its JE, ranks/cluster/served_je.py) instead
of the workload section's requests.

The job runs until SIGINT or SIGTERM to this launcher: the first one goes to the TE-shell alone,
which stops taking requests, drains or cancels the open ones (serve.on_shutdown), stops every
die, checks (with --check) and writes the run file; a second one, or a job that has not ended
serve.drain_timeout_s + STOP_WAIT_S later, ends mpiexec and every rank at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.job.memory_guard import (
    EXIT_OUT_OF_MEMORY,
    MemoryWatch,
    NodeOutOfMemory,
    check_node,
)
from launch.job.mpiexec import LAUNCH_GRACE_S, mpi_command, rank_program, stop_job
from launch.job.prepare import compile_rank_code, resolve_for_ranks, unpack_weights
from launch.job.shm_leftovers import ShmLeftovers
from launch.serve.prelaunch import expert_loss_warning
from launch.slurm.world import world_of
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.report.progress import PROGRESS_ENV
from xds_mpi.report.trace import MAX_EVENTS_ENV
from xds_mpi.results.record_cap import MAX_ITERATIONS_ENV, MAX_RECORDS_ENV

PID_FILE_ENV = "XDS_SERVE_PID_FILE"  # the TE-shell writes its pid there (the signal's target)
API_KEY_ENV = "XDS_SERVE_API_KEY"  # never on the mpiexec line: `ps` would show it
STOP_WAIT_S = 60.0  # after the drain: the check against the reference and the run file
# The trace events each rank keeps, the newest: a die's are ~600 bytes each with their
# arguments (docs/serve.md), so ~12 MiB a die; a served run's trace buffer would otherwise grow
# with every iteration until the stop.
TRACE_MAX_EVENTS = 20_000
# Finished request records the TE-shell keeps, the newest: ~1.7 KB each with a 30-token prompt
# and 24 tokens (docs/serve.md), so ~17 MiB; past it the oldest quarter is checked and let go.
MAX_RECORDS = 10_000
MAX_ITERATIONS = 100_000  # ~80 bytes each: ~8 MiB a die


def cmd_serve(args: argparse.Namespace) -> int:
    sets = [*args.set, "serve.enabled=true"]
    flags = {"host": args.host, "port": args.port, "model": args.model}
    flags |= {"max_queued": args.max_queued, "on_shutdown": args.on_shutdown}
    sets += [f"serve.{key}={value}" for key, value in flags.items() if value is not None]
    if args.check:
        sets.append("run.check=true")
    path = resolve_config(args.config)
    plan = DeploymentPlan.build(load_config(path, sets), args.np)
    cfg = plan.cfg
    _check_address(cfg.serve.host, cfg.serve.port)
    world = world_of(plan)  # a cluster: the JE and every TE, the endpoint on the JE
    if args.memory_check:
        check_node(world.world_size, sum(world.window_bytes))
    if plan.cluster is not None:
        print(f"xds-mpi: {plan.cluster.describe().splitlines()[0]}; the endpoint on the JE")
    print(
        f"xds-mpi: serving {cfg.serve.model} on {world.world_size} ranks "
        f"({'TE 0: ' if plan.cluster else ''}{plan.topo.summary()}) until SIGINT/SIGTERM",
        flush=True,
    )
    if warning := expert_loss_warning(plan):
        print(f"xds-mpi: warning: {warning}", file=sys.stderr, flush=True)
    compile_rank_code()  # once here, not once per rank
    unpack_weights(cfg.model, cfg.run.output_dir)
    command = mpi_command(
        world.world_size,
        rank_program(path, sets, resolve_for_ranks(path, sets, cfg)),  # read without PyYAML
        timeout_s=cfg.run.timeout_s,
        mpiexec=args.mpiexec,
        can_fail_over=any(e.kind in ("stuck", "dead") for e in cfg.faults.events),
    )
    with tempfile.TemporaryDirectory(prefix="xds-serve-") as tmp:
        env = {**os.environ, **command.env, PID_FILE_ENV: str(Path(tmp, "te_shell.pid"))}
        env[PROGRESS_ENV] = "off"  # a served job has no end to show progress towards
        env[MAX_EVENTS_ENV] = str(args.trace_max_events)
        env[MAX_RECORDS_ENV] = str(args.max_records)
        env[MAX_ITERATIONS_ENV] = str(args.max_iterations)
        if args.api_key:
            env[API_KEY_ENV] = args.api_key
        stop_after_s = cfg.serve.drain_timeout_s + STOP_WAIT_S
        watch = MemoryWatch(stops=args.memory_check)
        pid_file = Path(env[PID_FILE_ENV])
        return _run(command.argv, env, pid_file, cfg.run.timeout_s, stop_after_s, watch)


def _check_address(host: str, port: int) -> None:
    """Refuse before launch an address the TE-shell could not listen on."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ConfigError(
            f"serve: cannot listen on {host}:{port} (serve.host, serve.port): {exc.strerror}"
        ) from None


def _run(argv, env, pid_file: Path, timeout_s: float, stop_after_s: float, watch) -> int:
    """Run the job; the first signal goes to the TE-shell, a second (or a job still alive
    `stop_after_s` after the first, or past its timeout) ends it all, as does the node running
    out of memory (`watch`, a MemoryWatch, looked at every second)."""
    leftovers = ShmLeftovers()  # a job stopped or failed may leave its windows in /dev/shm
    try:
        return _until_stopped(argv, env, pid_file, timeout_s, stop_after_s, watch)
    finally:
        leftovers.remove_and_say()


def _until_stopped(argv, env, pid_file: Path, timeout_s: float, stop_after_s: float, watch):
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    signals: list[int] = []

    def on_signal(signo, _frame) -> None:
        signals.append(signo)
        if len(signals) == 1 and _signal_te_shell(pid_file):
            print(f"xds-mpi: {signal.Signals(signo).name}: shutting down", file=sys.stderr)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signo: signal.signal(signo, on_signal) for signo in handled}
    deadline = time.monotonic() + timeout_s + LAUNCH_GRACE_S
    looked = time.monotonic()
    try:
        while proc.poll() is None:
            if signals:
                deadline = min(deadline, time.monotonic() + stop_after_s)
            if len(signals) > 1 or time.monotonic() > deadline or not pid_file.parent.exists():
                stop_job(proc)
                print("xds-mpi: job stopped", file=sys.stderr)
                return 128 + (signals[-1] if signals else signal.SIGKILL)
            if time.monotonic() - looked >= 1.0:
                looked = time.monotonic()
                watch.poll()
            time.sleep(0.1)
    except NodeOutOfMemory as low:
        stop_job(proc)
        print(f"xds-mpi: error: {low}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except BaseException:
        stop_job(proc)
        raise
    finally:
        for signo, handler in previous.items():
            signal.signal(signo, handler)
    if proc.returncode != 0:
        print(f"xds-mpi: error: job failed with exit code {proc.returncode}", file=sys.stderr)
        killed = watch.after()
        if killed:
            print(killed, file=sys.stderr)
    return proc.returncode


def _signal_te_shell(pid_file: Path) -> bool:
    """SIGTERM to the TE-shell alone (it ends the dies itself); False before it is up."""
    try:
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        return True
    except (OSError, ValueError):
        return False


def _count(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"a count (0: all), got {value!r}")
    return int(value)


def add_parser(sub, add_config_args) -> None:
    """`add_config_args`: launch/cli/main.py's CONFIG, --set and --np."""
    p = sub.add_parser(
        "serve",
        help="serve the deployment over an OpenAI-compatible HTTP endpoint",
        description="Launch the deployment and serve POST /v1/completions, "
        "/v1/chat/completions, GET /v1/models, /health and /metrics from the TE-shell until "
        "SIGINT/SIGTERM (docs/serve.md). The workload section is not served. At shutdown the "
        "run file holds every request with its arrival time; --check compares each with the "
        "single-process reference.",
    )
    add_config_args(p)
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; 0: any free)")
    p.add_argument("--model", default=None, help="served model name (default xds-tiny)")
    p.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/ routes"
    )
    p.add_argument(
        "--max-queued", type=int, default=None, help="open requests before 429 (default 256)"
    )
    p.add_argument(
        "--on-shutdown",
        choices=("drain", "cancel"),
        default=None,
        help="finish (drain, the default) or cancel the requests open at shutdown",
    )
    p.add_argument(
        "--trace-max-events",
        type=_count,
        default=TRACE_MAX_EVENTS,
        help="trace events each rank keeps, the newest (default %(default)d, about 12 MiB a "
        "die; 0: all, a buffer that grows with every iteration served); run.trace=false: none",
    )
    p.add_argument(
        "--max-records",
        type=_count,
        default=MAX_RECORDS,
        help="finished requests whose records the TE-shell keeps, the newest (default "
        "%(default)d, about 17 MiB; past it the oldest quarter goes, checked first with --check; "
        "the run file's /requests holds the kept ones); 0: all",
    )
    p.add_argument(
        "--max-iterations",
        type=_count,
        default=MAX_ITERATIONS,
        help="per-iteration timings each die keeps, the newest (default %(default)d, about 8 MiB "
        "a die; past it the oldest half goes; the run file's /dies and the per-iteration "
        "summaries cover the kept ones); 0: all",
    )
    p.add_argument("--mpiexec", default=None, help="mpiexec to use (as for run)")
    p.add_argument(
        "--check",
        action="store_true",
        help="at shutdown compare every completed request with the single-process reference; "
        "exit non-zero on a mismatch",
    )
    p.add_argument(
        "--no-memory-check",
        dest="memory_check",
        action="store_false",
        help="launch even when the ranks cannot fit in this node's available memory, and do "
        "not stop the job when the node runs low (as for run)",
    )
    p.set_defaults(func=cmd_serve)
