"""`xds-mpi`: validate a deployment, launch it under MPI.

CONFIG is a YAML file or the name of one in configs/ (default: colocated). Every command accepts
`--set section.key=value` (repeatable) to override a config value, typed and checked like the file.
"""
from __future__ import annotations

import argparse
import sys

from launch.mpiexec import mpi_command, rank_program, run_job
from launch.paths import DEFAULT_CONFIG, available_configs, resolve_config
from launch.report import rank_map
from xds_mpi.config import ConfigError, load_config
from xds_mpi.topology import Topology

# How long the launcher waits beyond run.timeout_s (MPIEXEC_TIMEOUT) before killing the group.
LAUNCH_GRACE_S = 30


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                        help=f"YAML file or name in configs/ (default: {DEFAULT_CONFIG}; "
                             f"known: {', '.join(available_configs())})")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, e.g. --set deployment.dp_groups_per_domain=8")
    parser.add_argument("--np", type=int, default=None,
                        help="number of MPI ranks (default: what the config needs)")


def _load(args: argparse.Namespace):
    path = resolve_config(args.config)
    cfg = load_config(path, args.set)
    topo = Topology.from_config(cfg, args.np)
    return path, cfg, topo


def cmd_validate(args: argparse.Namespace) -> int:
    path, cfg, topo = _load(args)
    print(f"{path}: valid")
    print(f"{cfg.deployment.kind} deployment, {topo.summary()}")
    if not args.brief:
        print(rank_map(topo))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    path, cfg, topo = _load(args)
    command = mpi_command(topo.world_size, rank_program(path, args.set),
                          timeout_s=cfg.run.timeout_s, mpiexec=args.mpiexec)
    if args.dry_run:
        print(command.shell_line())
        return 0
    print(f"xds-mpi: launching {topo.world_size} ranks ({topo.summary()})", flush=True)
    result = run_job(command, timeout_s=cfg.run.timeout_s + LAUNCH_GRACE_S)
    if result.timed_out:
        print(f"xds-mpi: error: job exceeded run.timeout_s({cfg.run.timeout_s:g}) and was killed",
              file=sys.stderr)
        return 124
    if result.returncode != 0:
        print(f"xds-mpi: error: job failed with exit code {result.returncode}", file=sys.stderr)
    return result.returncode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xds-mpi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check a config and print its rank map",
                       description="Check a deployment config and print which rank plays which "
                                   "die. Exit 0 when valid, 2 with a one-line error otherwise.")
    _add_config_args(p)
    p.add_argument("--brief", action="store_true", help="print the summary line only")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("run", help="launch a deployment with mpiexec",
                       description="Launch `mpiexec -n N python -m mpi4py -m launch.rank CONFIG` "
                                   "with the environment the detected MPI needs. The job is "
                                   "killed after run.timeout_s.")
    _add_config_args(p)
    p.add_argument("--mpiexec", default=None,
                   help="mpiexec to use (default: $XDS_MPIEXEC, the venv's, then PATH)")
    p.add_argument("--dry-run", action="store_true", help="print the command line, do not launch")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"xds-mpi: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
