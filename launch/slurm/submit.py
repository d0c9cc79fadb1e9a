"""`xds-mpi submit`: run a deployment as a Slurm batch job (an array job for a --sweep).

The job script (launch/slurm/jobscript.py, template hpc/xds-mpi.sbatch.in) goes into a per-job
directory run.output_dir/jobs/<name>/ beside Slurm's output; `sbatch --parsable` submits it.
`--wait` polls squeue itself (every 0.5 s; `sbatch --wait` first looks after 2 s, then after 10 s
and 42 s) and then reads each job's final state from `scontrol show job`: anything but COMPLETED
is an error.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from launch.job.prepare import compile_rank_code, resolve_for_ranks, unpack_weights
from launch.slurm.jobscript import (
    JobSpec,
    Sweep,
    check_mem,
    check_time_limit,
    default_time_limit,
    parse_sweep,
    render,
    window_mib_per_node,
)
from launch.slurm.world import world_layout, world_of
from xds_mpi.config.paths import DEFAULT_CONFIG, available_configs, resolve_config
from xds_mpi.config.schema import Config, ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan

POLL_S = 0.5
# squeue failing this many polls in a row means the controller is gone, not a hiccup.
MAX_POLL_FAILURES = 40
TIMEOUT_EXIT = 124  # like `xds-mpi run` when a job outlives its limit


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "submit",
        help="submit a deployment to Slurm (sbatch)",
        description="Write a Slurm job script for the deployment (one task per rank, nodes from "
        "the server layout) into run.output_dir/jobs/NAME/ and submit it with sbatch. "
        "Exit 2 with a one-line error on bad input or when sbatch is missing. The job checks "
        "each node's memory against its ranks before they start (a node that cannot hold them "
        "fails the job with both numbers) and removes the MPI shared memory they leave in "
        "/dev/shm, however they end (docs/hpc.md).",
    )
    _add_deployment_options(p)
    _add_slurm_options(p)
    _add_launch_options(p)
    p.set_defaults(func=cmd_submit)


def _add_deployment_options(p: argparse.ArgumentParser) -> None:
    """What runs: the config and its overrides."""
    p.add_argument(
        "config",
        nargs="?",
        default=DEFAULT_CONFIG,
        help=f"YAML file or name in configs/ (default: {DEFAULT_CONFIG}; "
        f"known: {', '.join(available_configs())})",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable)",
    )


def _add_slurm_options(p: argparse.ArgumentParser) -> None:
    """What Slurm is asked for: nodes, partition, time limit, an array for a sweep."""
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="nodes to use (default: one per server of 16 dies; a cluster: one per TE, whole "
        "TEs per node)",
    )
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's)")
    p.add_argument(
        "--mem",
        default=None,
        help="memory per node, as Slurm's --mem, e.g. 24G (default: the site's; the script "
        "says what the fullest node's ranks need, and each node is checked before launch)",
    )
    p.add_argument(
        "--time",
        default=None,
        help="Slurm time limit, e.g. 00:30:00 (default: run.timeout_s + 60 s)",
    )
    p.add_argument(
        "--sweep",
        default=None,
        metavar="SECTION.KEY=V1,V2,...",
        help="an array job: element i runs with --set SECTION.KEY=Vi",
    )


def _add_launch_options(p: argparse.ArgumentParser) -> None:
    """How the ranks start, and whether to submit or wait."""
    p.add_argument(
        "--launcher",
        choices=["mpiexec", "srun"],
        default="mpiexec",
        help="mpiexec (default; hydra starts through srun) or srun --mpi=pmi2",
    )
    p.add_argument(
        "--mpiexec",
        default=None,
        help="mpiexec to use (default: $XDS_MPIEXEC, the venv's, then PATH)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the job script, do not submit")
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait for the job; exit non-zero unless every element COMPLETED",
    )


def cmd_submit(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    if args.dry_run:
        print(render(spec), end="")  # without --resolved: a dry run writes nothing
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise FileNotFoundError(
            "sbatch not found on PATH: load your site's Slurm (e.g. `module "
            "load slurm`), or start a local one with hpc/local_slurm.sh start"
        )
    spec.job_dir.mkdir(parents=True)
    compile_rank_code()  # on the shared tree, once: not once per rank on the compute nodes
    model = load_config(spec.config_path, spec.overrides).model  # a sweep's first
    unpack_weights(model, str(spec.workdir / spec.output_dir))
    spec.script_path.write_text(render(spec, resolve_elements(spec)))
    out = subprocess.run(
        [sbatch, "--parsable", str(spec.script_path)], capture_output=True, text=True
    )
    if out.returncode != 0:
        why = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        print(f"xds-mpi: error: sbatch refused {spec.script_path}: {why}", file=sys.stderr)
        return 1
    job_id = out.stdout.strip().split(";")[0]
    (spec.job_dir / "job_id").write_text(job_id + "\n")
    kind = f"array job of {len(spec.run_names)} elements" if spec.sweep else "job"
    print(
        f"submitted {kind} {job_id}: {spec.world.world_size} ranks on "
        f"{spec.layout.num_nodes} node(s); script {spec.script_path}",
        flush=True,
    )
    if not args.wait:
        return 0
    return report(spec, job_id, wait_for_job(job_id))


def build_spec(args: argparse.Namespace) -> JobSpec:
    path = resolve_config(args.config)
    cfg = load_config(path, args.set)
    sweep = parse_sweep(args.sweep) if args.sweep else None
    plans = plan_elements(path, cfg, args.set, sweep)
    workdir = Path.cwd()
    job_dir = new_job_dir(
        workdir / cfg.run.output_dir / "jobs",
        cfg.run.name or f"{path.stem}-{datetime.now():%Y%m%d-%H%M%S}",
    )
    base = job_dir.name
    names = tuple(f"{base}-{i}" for i in range(len(plans))) if sweep else (base,)
    timeout_s = max(plan.cfg.run.timeout_s for plan in plans)
    worlds = [world_of(plan) for plan in plans]  # a cluster: the JE and every TE
    layout = world_layout(plans[0], args.nodes)
    windows = [window_mib_per_node(layout, world.window_bytes) for world in worlds]
    return JobSpec(
        config_path=path,
        overrides=tuple(args.set),
        world=worlds[0],
        layout=layout,
        job_name=f"xds-{path.stem}",
        job_dir=job_dir,
        workdir=workdir,
        output_dir=cfg.run.output_dir,
        run_names=names,
        sweep=sweep,
        time_limit=check_time_limit(args.time) if args.time else default_time_limit(timeout_s),
        timeout_s=timeout_s,
        partition=args.partition,
        mem=check_mem(args.mem) if args.mem else None,
        cpus_per_node=cpus_per_node(args.partition),
        launcher=args.launcher,
        mpiexec=args.mpiexec,
        window_mib_per_node=tuple(max(per_node) for per_node in zip(*windows)),
    )


def plan_elements(
    path: Path, cfg: Config, overrides: list[str], sweep: Sweep | None
) -> list[DeploymentPlan]:
    """One plan per array element (one without a sweep), all of the same world size (a
    cluster's: its JE and every TE)."""
    plans = (
        [plan_sweep_element(path, overrides, sweep, i) for i in range(len(sweep.values))]
        if sweep
        else [DeploymentPlan.build(cfg)]
    )
    sizes = sorted({plan.world_size for plan in plans})
    if len(sizes) > 1:
        raise ConfigError(
            f"--sweep {sweep.key}: elements need different world sizes {sizes}; an "
            "array job has one shape, submit them separately"
        )
    return plans


def resolve_elements(spec: JobSpec) -> list[Path]:
    """Each array element's config and --set values resolved for its ranks, which then read no
    YAML (xds_mpi/plan/resolved.py); none when one cannot be written (the ranks read the YAML)."""
    resolved = []
    for idx in range(len(spec.run_names)):
        overrides = [*spec.overrides, *spec.element_overrides(idx)]
        cfg = load_config(spec.config_path, overrides)
        path = resolve_for_ranks(spec.config_path, overrides, cfg, spec.workdir)
        if path is None:
            return []
        resolved.append(path)
    return resolved


def new_job_dir(jobs_dir: Path, base: str) -> Path:
    """jobs_dir/base, or base-2, base-3, ...: a second submit in the same second gets its own."""
    job_dir, suffix = jobs_dir / base, 1
    while job_dir.exists():
        suffix += 1
        job_dir = jobs_dir / f"{base}-{suffix}"
    return job_dir


def plan_sweep_element(path: Path, overrides: list[str], sweep: Sweep, idx: int) -> DeploymentPlan:
    """Element idx of a sweep, refused (naming the element) like `xds-mpi validate` would."""
    try:
        return DeploymentPlan.build(load_config(path, [*overrides, sweep.override(idx)]))
    except ConfigError as exc:
        raise ConfigError(f"--sweep element {idx} ({sweep.override(idx)}): {exc}") from None


def cpus_per_node(partition: str | None) -> int | None:
    """The smallest CPU count of the partition's nodes, from sinfo; None when Slurm is not here."""
    argv = ["sinfo", "-h", "-o", "%c"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    counts = [int(m) for m in re.findall(r"^(\d+)", out.stdout, re.M)]
    return min(counts) if out.returncode == 0 and counts else None


def wait_for_job(job_id: str) -> list[dict[str, str]]:
    """Poll squeue until the job (every element of an array) left the queue, then return each
    job's `scontrol show job` fields."""
    failures = 0
    while True:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%i"], capture_output=True, text=True
        )
        if out.returncode == 0 and not out.stdout.strip():
            break
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:  # already purged from the controller's memory
                break
            failures += 1
            if failures >= MAX_POLL_FAILURES:
                raise RuntimeError(
                    f"squeue failed {failures} times in a row while waiting for "
                    f"job {job_id}: {out.stderr.strip()}"
                )
        else:
            failures = 0
        time.sleep(POLL_S)
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    return [
        dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.stdout.splitlines() if line.strip()
    ]


def report(spec: JobSpec, job_id: str, jobs: list[dict[str, str]]) -> int:
    """One line per job (array element) with its final state; exit 0 only if all COMPLETED."""
    if not jobs:
        print(
            f"xds-mpi: error: job {job_id} finished but Slurm no longer knows its state",
            file=sys.stderr,
        )
        return 1
    bad = []
    for job in sorted(jobs, key=lambda j: int(j.get("ArrayTaskId", "0") or 0)):
        idx = int(job.get("ArrayTaskId", "0") or 0) if spec.sweep else 0
        name = f"{job_id}_{idx}" if spec.sweep else job_id
        state = job.get("JobState", "UNKNOWN")
        line = f"job {name}: {state} (exit {job.get('ExitCode', '?')}, ran {job.get('RunTime')})"
        run_file = spec.run_file(idx)
        if state == "COMPLETED":
            line += f"; run file {run_file}" if run_file.exists() else "; NO run file written"
        elif state == "TIMEOUT":
            line += f": over its time limit {job.get('TimeLimit')}"
        if state != "COMPLETED" or not run_file.exists():
            bad.append((name, state))
        print(line + ("" if state == "COMPLETED" else f"; output {job.get('StdOut')}"))
        if state != "COMPLETED":
            for said in _script_errors(job.get("StdOut")):  # e.g. a node without the memory
                print(f"  {said}")
    if not bad:
        return 0
    listed = ", ".join(f"{name} {state}" for name, state in bad)
    print(
        f"xds-mpi: error: {len(bad)} of {len(jobs)} job(s) did not complete: {listed}",
        file=sys.stderr,
    )
    return TIMEOUT_EXIT if all(state == "TIMEOUT" for _, state in bad) else 1


def _script_errors(output: str | None) -> list[str]:
    """The job script's own error lines (`xds-mpi job: error: ...`) in the job's output."""
    try:
        text = Path(output).read_text(errors="replace") if output else ""
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith("xds-mpi job: error:")]
