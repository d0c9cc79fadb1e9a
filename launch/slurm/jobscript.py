"""The Slurm job script of a deployment: rank layout over nodes, sweep elements, the launch line.

Pure functions (no Slurm needed): `xds-mpi submit` (launch/slurm/submit.py) fills the template
hpc/xds-mpi.sbatch.in with them, and `--dry-run` prints the result.
"""

from __future__ import annotations

import math
import re
import shlex
import string
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from launch.job.memory_guard import RANK_FLOOR_MIB, gib
from launch.job.mpiexec import MpiCommand, mpi_command, mpi_flavor, rank_program
from xds_mpi.config.paths import REPO_ROOT
from xds_mpi.config.schema import ConfigError
from xds_mpi.plan.topology import Topology

TEMPLATE = REPO_ROOT / "hpc" / "xds-mpi.sbatch.in"
# Slurm's limit covers more than MPIEXEC_TIMEOUT: starting the ranks and writing the run file.
TIME_LIMIT_GRACE_S = 60
Launcher = Literal["mpiexec", "srun"]


@dataclass(frozen=True, kw_only=True)
class NodeLayout:
    """tasks_per_node[i]: how many consecutive ranks node i of the allocation runs."""

    tasks_per_node: tuple[int, ...]
    why: str  # one line for the script's header

    @property
    def num_nodes(self) -> int:
        return len(self.tasks_per_node)


@dataclass(frozen=True, kw_only=True)
class World:
    """The ranks a job launches. world_size = num_host_ranks + num_dies (+ EMS pool ranks), where
    a cluster's host ranks are its JE, each TE's TE-shell and each PD pair's JE and decode
    TE-shell; summary: one line for the job script's header; window_bytes: [world_size] bytes
    of each rank's window, in world-rank order (0 for the JE and the TE-shells)."""

    world_size: int
    num_host_ranks: int
    num_dies: int
    summary: str
    window_bytes: tuple[int, ...]


def node_layout(topo: Topology, num_nodes: int | None = None) -> NodeLayout:
    """By default one node per server (a server's dies together, host ranks on the first node);
    with `num_nodes` whole servers are spread over that many nodes, or, with more nodes than
    servers, ranks are split evenly and servers span nodes."""
    dies_on = Counter(info.server for info in topo.ranks if info.is_die)
    servers = [dies_on[s] for s in sorted(dies_on)] or [0]  # [num_servers] dies on each
    if num_nodes is None:
        num_nodes = len(servers)
    if num_nodes < 1 or num_nodes > topo.world_size:
        raise ConfigError(
            f"--nodes must be between 1 and the {topo.world_size} ranks of the "
            f"deployment, got {num_nodes}"
        )
    if num_nodes > len(servers):
        base, extra = divmod(topo.world_size, num_nodes)
        tasks = [base + (i < extra) for i in range(num_nodes)]
        why = (
            f"{num_nodes} nodes > {len(servers)} server(s): ranks split evenly, "
            "a server's dies span nodes"
        )
        return NodeLayout(tasks_per_node=tuple(tasks), why=why)
    base, extra = divmod(len(servers), num_nodes)
    tasks, first = [], 0
    for i in range(num_nodes):
        count = base + (i < extra)
        tasks.append(sum(servers[first : first + count]))
        first += count
    tasks[0] += topo.num_host_ranks
    num_pool = len(topo.ranks_with_role("pool"))  # EMS pool ranks come last: the last node
    tasks[-1] += num_pool
    why = (
        f"{len(servers)} server(s) of dies {servers}, whole servers per node, "
        f"{topo.num_host_ranks} host rank(s) on the first"
    ) + (f", {num_pool} EMS pool rank(s) on the last" if num_pool else "")
    return NodeLayout(tasks_per_node=tuple(tasks), why=why)


def window_mib_per_node(layout: NodeLayout, window_bytes: Sequence[int]) -> tuple[int, ...]:
    """The windows (bytes per rank, in rank order) of the ranks each node runs, in MiB rounded
    up: node i runs the next layout.tasks_per_node[i] ranks."""
    sums, first = [], 0
    for count in layout.tasks_per_node:
        sums.append(-(-sum(window_bytes[first : first + count]) // (1 << 20)))
        first += count
    return tuple(sums)


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """`--sweep section.key=v1,v2,...`: one array element per value."""

    key: str
    values: tuple[str, ...]

    def override(self, idx: int) -> str:
        return f"{self.key}={self.values[idx]}"


def parse_sweep(text: str) -> Sweep:
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise ConfigError(f"--sweep expects section.key=v1,v2,..., got {text!r}")
    values = tuple(v.strip() for v in raw.split(","))
    empty = [i for i, v in enumerate(values) if not v]
    if empty:
        raise ConfigError(f"--sweep {text!r}: value {empty[0]} of {len(values)} is empty")
    if key.strip() == "run.name":
        raise ConfigError("--sweep run.name: each element already gets its own run.name")
    return Sweep(key=key.strip(), values=values)


def default_time_limit(timeout_s: float) -> str:
    """run.timeout_s plus the grace, rounded up to whole minutes, as Slurm's [D-]HH:MM:SS."""
    minutes = math.ceil((timeout_s + TIME_LIMIT_GRACE_S) / 60)
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    return (f"{days}-" if days else "") + f"{hours:02d}:{minutes:02d}:00"


def check_mem(text: str) -> str:
    """Slurm's --mem: a size in MB, or with a K, M, G or T suffix (0: all of a node's)."""
    if not re.fullmatch(r"\d+[KMGTkmgt]?", text):
        raise ConfigError(f"--mem expects Slurm's size, e.g. 24G or 16000M, got {text!r}")
    return text


def check_time_limit(text: str) -> str:
    if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", text):
        raise ConfigError(f"--time expects Slurm's MM, HH:MM:SS or D-HH:MM:SS, got {text!r}")
    return text


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything the job script says. run_names has one entry per array element (1 if no sweep)."""

    config_path: Path
    overrides: tuple[str, ...]
    world: World
    layout: NodeLayout
    job_name: str
    job_dir: Path
    workdir: Path  # --chdir: where relative run.output_dir paths resolve
    output_dir: str  # run.output_dir as the ranks see it (relative to workdir)
    run_names: tuple[str, ...]
    sweep: Sweep | None
    time_limit: str
    timeout_s: float  # MPIEXEC_TIMEOUT: the largest run.timeout_s of the sweep
    partition: str | None
    mem: str | None  # --mem per node; None: the site's default
    cpus_per_node: int | None  # None: unknown, ask for --overcommit to be safe
    launcher: Launcher
    mpiexec: str | None
    # Per node: the windows of its ranks in MiB (the largest over a sweep's elements), which the
    # check before launch weighs with the ranks (launch/job/memory_guard.py).
    window_mib_per_node: tuple[int, ...]

    @property
    def script_path(self) -> Path:
        return self.job_dir / "job.sbatch"

    def element_overrides(self, idx: int) -> list[str]:
        """The --set values the script adds for array element idx: its sweep value, its run name."""
        sweep = [self.sweep.override(idx)] if self.sweep else []
        return [*sweep, f"run.name={self.run_names[idx]}"]

    def run_file(self, idx: int) -> Path:
        return self.workdir / self.output_dir / f"{self.run_names[idx]}.h5"


class _Template(string.Template):
    delimiter = "@"  # bash owns `$`


def render(spec: JobSpec, resolved: Sequence[Path] = ()) -> str:
    """The job script; resolved: each element's config resolved for its ranks
    (xds_mpi/plan/resolved.py), named on its line with --resolved (none on a dry run)."""
    program = rank_program(spec.config_path, spec.overrides)
    command = mpi_command(
        spec.world.world_size, program, timeout_s=spec.timeout_s, mpiexec=spec.mpiexec
    )
    fields = {**_header_fields(spec), **_launch_fields(spec, command, program, resolved)}
    text = _Template(TEMPLATE.read_text()).safe_substitute(fields)
    leftover = re.findall(r"@\{\w+\}", text)
    assert not leftover, f"template fields not filled: {leftover}"
    return text


def _header_fields(spec: JobSpec) -> dict:
    """The script's comment header: config, deployment, node layout, run files, sweep."""
    world, layout = spec.world, spec.layout
    names = [str(spec.run_file(i)) for i in range(len(spec.run_names))]
    return dict(
        script=spec.script_path,
        config=spec.config_path,
        overrides=" ".join(shlex.quote(o) for o in spec.overrides) or "(none)",
        world_size=world.world_size,
        num_host_ranks=world.num_host_ranks,
        num_dies=world.num_dies,
        summary=world.summary,
        num_nodes=layout.num_nodes,
        tasks_per_node=" ".join(map(str, layout.tasks_per_node)),
        layout_why=layout.why,
        launcher=spec.launcher,
        run_files=", ".join(names)
        if len(names) <= 4
        else f"{names[0]} ... {names[-1]} ({len(names)})",
        sweep=(
            f"{spec.sweep.key} = {', '.join(spec.sweep.values)}: "
            f"{len(spec.sweep.values)} array elements"
        )
        if spec.sweep
        else "(none)",
    )


def _launch_fields(
    spec: JobSpec, command: MpiCommand, program: list[str], resolved: Sequence[Path]
) -> dict:
    """The #SBATCH lines, the sweep's case, the environment, the hostfile and the launch line."""
    prefix, loop, extra, env = _launcher_parts(
        spec, command.argv[: len(command.argv) - len(program)]
    )
    launch = " \\\n    ".join([shlex.join(prefix) + extra, shlex.join(program), '"${RUN_ARGS[@]}"'])
    return dict(
        sbatch_lines="\n".join(_sbatch_lines(spec)),
        run_args=_run_args(spec, resolved),
        env_lines="\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(command.env.items())),
        job_dir=shlex.quote(str(spec.job_dir)),
        hostfile_loop=loop,
        hostfile_env=env,
        launch_line=launch,
        python=shlex.quote(sys.executable),
        window_mib=" ".join(map(str, spec.window_mib_per_node)),
    )


def _sbatch_lines(spec: JobSpec) -> list[str]:
    layout = spec.layout
    most = max(layout.tasks_per_node)
    lines = [
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={layout.num_nodes}",
        f"#SBATCH --ntasks={spec.world.world_size}",
    ]
    if layout.num_nodes > 1:
        lines.append(f"#SBATCH --ntasks-per-node={most}")
    if spec.cpus_per_node is None or most > spec.cpus_per_node:
        cpus = "an unknown number of" if spec.cpus_per_node is None else spec.cpus_per_node
        lines += [
            f"# {most} tasks on a node with {cpus} CPUs: ranks share cores (without this the "
            "job stays pending)",
            "#SBATCH --overcommit",
        ]
    why = (
        "as given by --time"
        if spec.time_limit != default_time_limit(spec.timeout_s)
        else f"run.timeout_s({spec.timeout_s:g}) + {TIME_LIMIT_GRACE_S} s to start and report"
    )
    lines += [f"# Wall-clock limit: {why}", f"#SBATCH --time={spec.time_limit}"]
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    lines.append(_memory_line(spec))
    if spec.mem:
        lines.append(f"#SBATCH --mem={spec.mem}")
    output = "slurm-%j.out"
    if spec.sweep:
        lines += [
            f"# One array element per value of {spec.sweep.key}",
            f"#SBATCH --array=0-{len(spec.sweep.values) - 1}",
        ]
        output = "slurm-%A_%a.out"
    lines += [
        "# Relative paths (run.output_dir) resolve from where `xds-mpi submit` ran",
        f"#SBATCH --chdir={spec.workdir}",
        f"#SBATCH --output={spec.job_dir / output}",
    ]
    return lines


def _memory_line(spec: JobSpec) -> str:
    """What the fullest node's ranks need (memory_guard's numbers), and where its memory comes
    from: --mem, or the site's default."""
    need = [
        (tasks * RANK_FLOOR_MIB, tasks * RANK_FLOOR_MIB + window)
        for tasks, window in zip(spec.layout.tasks_per_node, spec.window_mib_per_node)
    ]
    least, most = max(need, key=lambda pair: pair[1])
    source = "as given by --mem" if spec.mem else "the site's default (xds-mpi submit --mem asks)"
    return (
        f"# Memory per node: {source}; the fullest node's ranks need {gib(least)} at least, "
        f"{gib(most)} with every window page touched (checked on each node before launch)"
    )


def _run_args(spec: JobSpec, resolved: Sequence[Path]) -> str:
    def args(idx: int) -> str:
        sets = [f"--set {shlex.quote(text)}" for text in spec.element_overrides(idx)]
        more = [f"--resolved {shlex.quote(str(resolved[idx]))}"] if resolved else []
        return f"RUN_ARGS=({' '.join(sets + more)})"

    if not spec.sweep:
        return args(0)
    cases = [f"    {i}) {args(i)} ;;" for i in range(len(spec.run_names))]
    return "\n".join(
        [
            'case "${SLURM_ARRAY_TASK_ID:-0}" in',
            *cases,
            '    *) echo "xds-mpi job: no sweep value for array element '
            '$SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;',
            "esac",
        ]
    )


def _launcher_parts(spec: JobSpec, prefix: tuple[str, ...]) -> tuple[list[str], str, str, str]:
    """(launcher argv before the program, hostfile loop body, hostfile flags, extra env lines)."""
    one_per_task = '    for ((k = 0; k < TASKS_PER_NODE[i]; k++)); do echo "${NODES[i]}"; done'
    if spec.launcher == "srun":
        # Slurm's pmi2 plugin wires up MPICH; `arbitrary` puts rank r on line r of the hostfile.
        argv = ["srun", "--mpi=pmi2", "--distribution=arbitrary", "-n", str(spec.world.world_size)]
        return argv, one_per_task, "", "export SLURM_HOSTFILE=$HOSTFILE"
    flavor = mpi_flavor(prefix[0])
    if flavor == "openmpi":
        loop = '    echo "${NODES[i]} slots=${TASKS_PER_NODE[i]}"'
        return list(prefix), loop, ' --hostfile "$HOSTFILE" --map-by slot', ""
    loop = '    echo "${NODES[i]}:${TASKS_PER_NODE[i]}"'
    if flavor == "mpich":
        # Hydra starts its proxies through srun and fills hosts in file order.
        return list(prefix), loop, ' -f "$HOSTFILE"', ""
    return (
        list(prefix),
        loop,
        "",
        (
            "# Unknown MPI: the hostfile is written but not passed; the "
            "launcher's own placement applies."
        ),
    )
