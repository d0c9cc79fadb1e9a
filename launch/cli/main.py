"""`xds-mpi`: validate a deployment, launch it under MPI.

CONFIG is a YAML file or the name of one in configs/ (default: colocated). Every command accepts
`--set section.key=value` (repeatable) to override a config value, typed and checked like the file.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from functools import partial

from launch.bench import afd_command as bench_afd
from launch.bench import command as bench_cli
from launch.bench import load as bench_load
from launch.cluster import heatmap, predict
from launch.job import hosts, memory_guard
from launch.job.mpiexec import LAUNCH_GRACE_S, mpi_command, rank_program, run_job
from launch.job.prepare import compile_rank_code, resolve_for_ranks, unpack_weights
from launch.job.startup import StartupWatch
from launch.model import generate, quantize, train
from launch.plan import command as plan
from launch.project import command as project
from launch.report import run_page
from launch.report.tables import rank_map
from launch.serve import bench as bench_serve
from launch.serve import bench_endpoint, soak
from launch.serve import command as serve
from launch.slurm import submit
from launch.slurm.world import world_of
from xds_mpi.cluster.policies import check_policy
from xds_mpi.config.paths import DEFAULT_CONFIG, available_configs, resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.execution import fault_rates
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.plan.ems import describe_ems
from xds_mpi.plan.fabric import format_bytes
from xds_mpi.plan.failures.rates import judge
from xds_mpi.plan.kv_memory import describe_kv
from xds_mpi.plan.pd import describe_pd
from xds_mpi.report.progress import PROGRESS_ENV, progress_mode


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default=DEFAULT_CONFIG,
        help=f"YAML file or name in configs/ (default: {DEFAULT_CONFIG}; "
        f"known: {', '.join(available_configs())})",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set deployment.dp_groups_per_domain=8",
    )
    parser.add_argument(
        "--np", type=int, default=None, help="number of MPI ranks (default: what the config needs)"
    )


def _load(args: argparse.Namespace):
    """The config file's path and the deployment plan: every refusal happens here."""
    path = resolve_config(args.config)
    plan = DeploymentPlan.build(load_config(path, args.set), args.np)
    if plan.cluster is not None:  # the routing policy and what it reads (a heatmap, ...)
        check_policy(plan.cfg)
    warning = judge_fault_rate(plan)
    if warning:
        print(f"xds-mpi: warning: {warning}", file=sys.stderr, flush=True)
    return path, plan


def judge_fault_rate(plan: DeploymentPlan) -> str:
    """faults.rate's risk in any unit (the plan judged a rate per call or iteration; a rate per
    die-hour needs the projection): refused more likely than not to exhaust faults.max_retries,
    else the warning's text ("" when none)."""
    if plan.cfg.faults.rate == 0:
        return ""
    return judge(fault_rates.resolve(plan.cfg, plan.topo))


def describe_memory_path(path: str) -> str:
    """validate's line on how dies reach each other's windows (xccl/gmem_paths.py)."""
    if path == "rma":
        return "memory path: rma (forced): every die reaches every peer with Put/Get/atomics"
    return (
        "memory path: auto: load/store into the windows of dies on the same node "
        "(where MPI's Shared_query exposes them), Put/Get/atomics across nodes"
    )


def describe_wait(mode: str) -> str:
    """validate's line on how dies wait for their peers' doorbells (xccl/wake.py)."""
    return {
        "auto": (
            "waits: auto (the default): sleep on a futex when a node runs more ranks than "
            "cores, else spin"
        ),
        "sleep": "waits: sleep (forced) on a futex, woken by the last die to meet or the writer",
        "spin": "waits: spin, yielding the CPU between polls",
    }[mode]


def cmd_validate(args: argparse.Namespace) -> int:
    path, plan = _load(args)
    cfg, topo, windows = plan.cfg, plan.topo, plan.window_bytes
    print(f"{path}: valid")
    print(
        f"{cfg.deployment.kind} deployment, {topo.summary()}; largest die window "
        f"{format_bytes(max(windows[r] for r in topo.die_ranks))} "
        f"(xccl.p2p_pairs: {cfg.xccl.p2p_pairs})"
    )
    print(describe_memory_path(cfg.xccl.memory_path))
    print(describe_wait(cfg.xccl.wait))
    print(describe_kv(cfg, cost_shape()))
    if plan.pd is not None:
        print(describe_pd(plan))
    if plan.ems is not None:
        print(describe_ems(plan.ems))
    if plan.cluster is not None:  # every TE has the rank map below, at its own world ranks
        print(plan.cluster.describe())
    if cfg.faults.rate > 0:
        print(fault_rates.resolve(cfg, topo).describe())
    if not args.brief:
        print(rank_map(topo, {"window": [format_bytes(n) for n in windows]}))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.check:
        args.set = [*args.set, "run.check=true"]
    path, plan = _load(args)
    cfg, topo = plan.cfg, plan.topo
    world_size = plan.world_size  # a cluster: the JE and every TE (xds_mpi/plan/cluster.py)
    command_for = partial(
        mpi_command,
        world_size,
        timeout_s=cfg.run.timeout_s,
        mpiexec=args.mpiexec,
        placement=hosts.placement_flags(args.hosts, plan, args.mpiexec, dry_run=args.dry_run),
        can_fail_over=any(e.kind in ("stuck", "dead") for e in cfg.faults.events),
    )
    if args.dry_run:  # the line without --resolved: a dry run writes nothing
        print(command_for(rank_program(path, args.set)).shell_line())
        return 0
    if not args.hosts and args.memory_check:  # with --hosts the ranks' nodes are elsewhere
        memory_guard.check_node(world_size, sum(world_of(plan).window_bytes))
    if plan.cluster is not None:  # the TEs' lines (validate prints each one's world ranks)
        print(f"xds-mpi: {plan.cluster.describe().splitlines()[0]}")
        print(f"xds-mpi: launching {world_size} ranks (TE 0: {topo.summary()})")
    else:
        print(f"xds-mpi: launching {world_size} ranks ({topo.summary()})")
    print(f"xds-mpi: {train.describe_weights(cfg.model)}", flush=True)
    compile_rank_code()  # once here, not once per rank
    unpack_weights(cfg.model, cfg.run.output_dir)
    resolved = resolve_for_ranks(path, args.set, cfg)  # the ranks read it without PyYAML
    command = command_for(rank_program(path, args.set, resolved))
    os.environ[PROGRESS_ENV] = progress_mode()  # the ranks' stdout is a pipe: tell them
    startup = StartupWatch(world_size)  # the ranks' imports: silent before the TE-shell
    os.environ.update(startup.env)
    memory = memory_guard.MemoryWatch(stops=args.memory_check)

    def while_waiting() -> None:
        startup.poll()
        memory.poll()

    try:
        result = run_job(
            command, timeout_s=cfg.run.timeout_s + LAUNCH_GRACE_S, while_waiting=while_waiting
        )
    except memory_guard.NodeOutOfMemory as low:  # run_job has ended mpiexec and its ranks
        print(f"xds-mpi: error: {low}", file=sys.stderr)
        return memory_guard.EXIT_OUT_OF_MEMORY
    finally:
        startup.close()
    if result.stopped_by is not None:
        name = signal.Signals(result.stopped_by).name
        print(f"xds-mpi: stopped by {name}", file=sys.stderr)
        return result.returncode
    if result.timed_out:
        print(
            f"xds-mpi: error: job exceeded run.timeout_s({cfg.run.timeout_s:g}) and was killed",
            file=sys.stderr,
        )
        return 124
    if result.returncode != 0:
        print(f"xds-mpi: error: job failed with exit code {result.returncode}", file=sys.stderr)
        killed = memory.after()
        if killed:
            print(killed, file=sys.stderr)
    return result.returncode


def _add_validate(sub) -> None:
    p = sub.add_parser(
        "validate",
        help="check a config and print its rank map",
        description="Check a deployment config and print which rank plays which "
        "die. Exit 0 when valid, 2 with a one-line error otherwise.",
    )
    _add_config_args(p)
    p.add_argument("--brief", action="store_true", help="print the summary line only")
    p.set_defaults(func=cmd_validate)


def _add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="launch a deployment with mpiexec",
        description="Launch `mpiexec -n N python -m mpi4py -m launch.job.rank CONFIG` "
        "with the environment the detected MPI needs. A colocated or "
        "afd deployment serves the workload: the TE-shell prints "
        "progress and a summary and writes a run file (HDF5) under "
        "run.output_dir. The job is killed after run.timeout_s. "
        "--set scheduler.mtp_depth=1|2 decodes with MTP drafts; the "
        "faults section (faults.table, faults.rate) injects transient "
        "XCCL errors that every die rolls back and recomputes (see "
        "docs/serving.md and docs/failures.md).",
    )
    _add_config_args(p)
    p.add_argument(
        "--mpiexec",
        default=None,
        help="mpiexec to use (default: $XDS_MPIEXEC, the venv's, then PATH)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command line, do not launch")
    p.add_argument(
        "--hosts",
        default=None,
        metavar="H1,H2,...",
        help="run on these hosts: one per server by default (host ranks on the first), "
        "whole servers spread when fewer; writes a hostfile under run.output_dir/hosts. The "
        "MPI reaches the hosts its own way (ssh; hydra: $HYDRA_LAUNCHER_EXEC)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="re-run the single-process reference on the same requests; exit non-zero "
        "on any token mismatch (same as --set run.check=true)",
    )
    p.add_argument(
        "--no-memory-check",
        dest="memory_check",
        action="store_false",
        help="launch even when the ranks cannot fit in this node's available memory, and do "
        "not stop the job when the node runs low (by default: refused before launch, exit 2; "
        f"stopped while running, exit {memory_guard.EXIT_OUT_OF_MEMORY}; "
        "launch/job/memory_guard.py)",
    )
    p.set_defaults(func=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xds-mpi", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_validate(sub)
    _add_run(sub)
    serve.add_parser(sub, _add_config_args)
    bench = sub.add_parser("bench", help="benchmarks (ratios against raw MPI in the same run)")
    kinds = bench.add_subparsers(dest="kind", required=True, metavar="KIND")
    bench_cli.add_parsers(kinds)
    bench_afd.add_parser(kinds)
    bench_serve.add_parser(kinds)
    bench_load.add_parser(kinds)
    bench_endpoint.add_parser(kinds)
    soak.add_parser(kinds)
    submit.add_parser(sub)
    generate.add_parser(sub)
    project.add_parser(sub)
    train.add_parser(sub)
    quantize.add_parser(sub)
    run_page.add_parser(sub)
    predict.add_parser(sub)
    heatmap.add_parser(sub)
    plan.add_parser(sub)
    return parser


# torch is the `train` extra (pyproject.toml): train-tiny, stats and quantize's corpus need it.
MISSING_TORCH = (
    "`xds-mpi {command}` needs torch, which is not installed (the dies and `xds-mpi run` do "
    "not use it): pip install -e '.[train]' in a checkout, or pip install 'xds-mpi[train]'"
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"xds-mpi: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print(f"xds-mpi: error: {MISSING_TORCH.format(command=args.command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # run_job has ended mpiexec and its ranks already
        print("xds-mpi: stopped by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
