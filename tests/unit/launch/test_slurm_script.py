"""`xds-mpi submit` without Slurm: node layout, sweep and time-limit parsing, refusals of bad
input, and the job script `--dry-run` prints. tests/e2e/slurm/test_slurm.py submits real jobs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO_ROOT

from launch.job.memory_guard import RANK_FLOOR_MIB, gib
from launch.slurm.jobscript import default_time_limit, node_layout, parse_sweep
from xds_mpi.config.schema import ConfigError, config_from_dict, load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.plan.topology import Topology

XDS_MPI = Path(sys.executable).parent / "xds-mpi"
COLOCATED = REPO_ROOT / "configs" / "colocated.yaml"


def xds_mpi(*args: str, cwd: Path, timeout: float = 120, env: dict | None = None):
    return subprocess.run(
        [str(XDS_MPI), *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env
    )


def topology(**deployment) -> Topology:
    # 64 routed experts so that up to 64 colocated dies each host one.
    return Topology.from_config(
        config_from_dict({"deployment": deployment, "model": {"num_routed_experts": 64}})
    )


@pytest.mark.parametrize(
    "deployment, nodes, expected",
    [
        ({}, None, (5,)),  # colocated: 1 host + 4 dies, 1 server
        ({"dp_groups_per_domain": 16}, None, (17,)),  # exactly one server
        ({"dp_groups_per_domain": 20}, None, (17, 4)),  # server 0 + host, server 1's 4 dies
        ({"dp_groups_per_domain": 40}, 2, (33, 8)),  # servers [16,16,8]: 2 on node 0
        ({"dp_groups_per_domain": 20}, 1, (21,)),  # everything on one node
        ({}, 2, (3, 2)),  # more nodes than servers: split
    ],
)
def test_tasks_per_node_follow_the_server_layout(deployment, nodes, expected):
    assert node_layout(topology(**deployment), nodes).tasks_per_node == expected


def test_the_full_pod_takes_one_node_per_server():
    topo = Topology.from_config(load_config(REPO_ROOT / "configs" / "afd_pod.yaml"))
    layout = node_layout(topo)
    assert layout.num_nodes == 48
    assert layout.tasks_per_node == (16 + topo.num_host_ranks,) + (16,) * 47
    assert sum(layout.tasks_per_node) == topo.world_size


@pytest.mark.parametrize("nodes", [0, 6])
def test_nodes_outside_one_to_world_size_are_refused(nodes):
    with pytest.raises(ConfigError, match=f"between 1 and the 5 ranks .* got {nodes}"):
        node_layout(topology(), nodes)


def test_sweep_parses_key_and_values():
    sweep = parse_sweep("xccl.ring_slots=4, 8,16")
    assert (sweep.key, sweep.values) == ("xccl.ring_slots", ("4", "8", "16"))
    assert sweep.override(2) == "xccl.ring_slots=16"


@pytest.mark.parametrize(
    "text, message",
    [
        ("xccl.ring_slots", "--sweep expects section.key=v1,v2,..., got 'xccl.ring_slots'"),
        ("ring_slots=4,8", "--sweep expects section.key=v1,v2,..., got 'ring_slots=4,8'"),
        ("xccl.ring_slots=4,,8", "value 1 of 3 is empty"),
        ("run.name=a,b", "each element already gets its own run.name"),
    ],
)
def test_malformed_sweeps_are_refused(text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_sweep(text)


def test_default_time_limit_is_run_timeout_plus_a_minute_rounded_up():
    assert default_time_limit(600) == "00:11:00"
    assert default_time_limit(61) == "00:03:00"
    assert default_time_limit(86400) == "1-00:01:00"


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-config"], "config 'no-such-config' is neither a file nor a name in configs/"),
        (["--sweep", "xccl.ring_slots"], "--sweep expects section.key=v1,v2,..."),
        (["--sweep", "xccl.ring_slot=4,8"], "--sweep element 0 (xccl.ring_slot=4): "),
        (["--sweep", "xccl.ring_slots=4,x"], "xccl.ring_slots must be int, got 'x'"),
        (
            ["--sweep", "deployment.dp_groups_per_domain=2,4"],
            "elements need different world sizes [3, 5]",
        ),
        (["--time", "ten"], "--time expects Slurm's MM, HH:MM:SS or D-HH:MM:SS, got 'ten'"),
        (["--mem", "24 GB"], "--mem expects Slurm's size, e.g. 24G or 16000M, got '24 GB'"),
        (["--nodes", "9"], "--nodes must be between 1 and the 5 ranks of the deployment, got 9"),
    ],
)
def test_bad_submit_input_is_one_line_and_exit_2(tmp_path, args, message):
    result = xds_mpi("submit", *args, "--dry-run", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_submit_without_sbatch_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    result = xds_mpi("submit", cwd=tmp_path, env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "sbatch not found on PATH" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_dry_run_names_config_ranks_nodes_and_launch_line(tmp_path):
    result = xds_mpi(
        "submit", "--dry-run", "--time", "00:05:00", "--partition", "debug", "--mem", "24G",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert f"#   config     {COLOCATED}\n" in script
    assert "#   ranks      5 = 1 host rank(s) + 4 dies" in script
    assert "#   nodes      1, tasks per node: 5 " in script
    for line in [
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=5",
        "#SBATCH --time=00:05:00",
        "#SBATCH --partition=debug",
        "#SBATCH --mem=24G",
        f"#SBATCH --chdir={tmp_path}",
        "export MPIR_CVAR_CH4_RMA_ENABLE_DYNAMIC_AM_PROGRESS=1",
        "export MPIEXEC_TIMEOUT=600",
        "TASKS_PER_NODE=(5)",
    ]:
        assert line + "\n" in script, line
    launch = script[script.index("# Launch every rank") :]
    assert re.search(
        r"/mpiexec -n 5 -f \"\$HOSTFILE\" \\\n +\S+python\S* -m mpi4py -m "
        rf"launch.job.rank {re.escape(str(COLOCATED))} \\\n +\"\$\{{RUN_ARGS\[@\]\}}\"",
        launch,
    ), launch
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_without_mem_the_script_asks_slurm_for_none_and_says_what_the_ranks_need(tmp_path):
    """Two nodes of 17 and 4 ranks: the fullest node's need, at least its ranks' floor
    (launch/job/memory_guard.py RANK_FLOOR_MIB) and at most that plus its ranks' windows."""
    args = ["--set", "deployment.dp_groups_per_domain=20", "--set", "model.num_routed_experts=64"]
    args += ["--set", "model.weights=random"]
    result = xds_mpi("submit", "--dry-run", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --mem" not in result.stdout
    plan = DeploymentPlan.build(load_config(COLOCATED, args[1::2]))
    least = 17 * RANK_FLOOR_MIB
    most = least + -(-sum(plan.window_bytes[:17]) // (1 << 20))
    line = (
        "# Memory per node: the site's default (xds-mpi submit --mem asks); the fullest node's "
        f"ranks need {gib(least)} at least, {gib(most)} with every window page touched"
    )
    assert line in result.stdout, result.stdout


def test_the_script_checks_each_nodes_memory_before_launch_and_cleans_up_after(tmp_path):
    """Two nodes of a 64-die deployment: the check step names each node's ranks and windows
    (launch/job/memory_guard.py), the leftovers' trap is set before the launch line."""
    args = ["--set", "deployment.dp_groups_per_domain=20", "--set", "model.num_routed_experts=64"]
    args += ["--set", "model.weights=random"]
    result = xds_mpi("submit", "--dry-run", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    script = result.stdout
    plan = DeploymentPlan.build(load_config(COLOCATED, args[1::2]))
    windows = [sum(plan.window_bytes[:17]), sum(plan.window_bytes[17:])]  # (17, 4) ranks
    expected = " ".join(str(-(-w // (1 << 20))) for w in windows)
    check = script.index('--ranks-per-node "${TASKS_PER_NODE[*]}"')
    assert f'--window-mib-per-node "{expected}"' in script[check:]
    assert "TASKS_PER_NODE=(17 4)\n" in script
    trap = script.index("trap remove_leftovers EXIT")
    assert check < trap < script.index("# Launch every rank")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_the_memory_check_step_refuses_a_node_that_cannot_hold_its_ranks():
    """`python -m launch.job.memory_guard` as the job script runs it on each node: SLURM_NODEID
    picks the node's entry; its ranks against what the node has (a million ranks fit nowhere)."""

    def check(node_id: str, ranks: str, windows: str):
        env = {**os.environ, "SLURM_NODEID": node_id}
        return subprocess.run(
            [sys.executable, "-m", "launch.job.memory_guard", "--ranks-per-node", ranks,
             "--window-mib-per-node", windows],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip

    fits = check("0", "5 1000000", "3 1")  # node 0: 5 ranks
    assert fits.returncode == 0 and not fits.stderr, fits.stderr
    refused = check("1", "5 1000000", "3 1")  # node 1: a million
    assert refused.returncode == 2, refused.stderr
    assert re.search(
        r"^xds-mpi job: error: 1000000 ranks need at least 31250\.0 GiB on node \S+ .* and it "
        r"has [\d.]+ GiB available of [\d.]+ GiB .*: nothing was launched\. Spread the ranks",
        refused.stderr,
    ), refused.stderr
    tight = check("0", "5", "100000000")  # 5 ranks fit, not with 95 TiB of windows touched
    assert tight.returncode == 0, tight.stderr
    assert tight.stderr.startswith("xds-mpi job: warning: 5 ranks need 0.2 GiB to ")
    assert tight.stderr.rstrip().endswith("; the job's cgroup ends a rank if they are")
    bad = check("2", "5 1000000", "3 1")  # no entry for node 2
    assert bad.returncode == 2 and "one entry per node" in bad.stderr


def test_dry_run_of_a_sweep_with_srun(tmp_path):
    result = xds_mpi(
        "submit",
        "--dry-run",
        "--launcher",
        "srun",
        "--set",
        "run.name=s",
        "--sweep",
        "xccl.ring_slots=4,8,16",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert "#SBATCH --array=0-2\n" in script
    for i, slots in enumerate([4, 8, 16]):
        assert (
            f"    {i}) RUN_ARGS=(--set xccl.ring_slots={slots} --set run.name=s-{i}) ;;" in script
        )
    assert "srun --mpi=pmi2 --distribution=arbitrary -n 5 \\\n" in script
    assert "export SLURM_HOSTFILE=$HOSTFILE\n" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_each_element_names_its_resolved_config_which_its_ranks_read(tmp_path, monkeypatch):
    """A submitted (not dry-run) script: each element's line ends with --resolved FILE, made of
    the config and exactly the --set values that line gives, so its ranks read no YAML."""
    import shlex

    from launch.cli.main import build_parser
    from launch.job.rank import parse_args, read_config
    from launch.slurm import submit
    from launch.slurm.jobscript import render
    from xds_mpi.plan.resolved import read_resolved

    monkeypatch.chdir(tmp_path)
    argv = ["submit", "--set", "run.name=s", "--sweep", "xccl.ring_slots=4,8"]
    spec = submit.build_spec(build_parser().parse_args(argv))
    resolved = submit.resolve_elements(spec)
    assert len(resolved) == 2 and all(p.is_relative_to(tmp_path / "runs") for p in resolved)
    script = render(spec, resolved)
    program = shlex.split(re.search(r"-m launch\.job\.rank (.*) \\\n", script).group(1))
    for i, slots in enumerate([4, 8]):
        run_args = re.search(rf"    {i}\) RUN_ARGS=\((.*)\) ;;", script).group(1)
        assert run_args.endswith(f"--resolved {resolved[i]}")
        args = parse_args([*program, *shlex.split(run_args)])
        overrides = ["run.name=s", f"xccl.ring_slots={slots}", f"run.name=s-{i}"]
        assert args.overrides == overrides
        assert read_resolved(args.resolved, args.config, args.overrides) is not None
        assert read_config(args) == load_config(COLOCATED, overrides)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_a_failed_jobs_report_repeats_the_scripts_own_errors(tmp_path, capsys):
    """`submit --wait` after a FAILED job: its state line, then the script's own error lines from
    the job's output (a node without the memory for its ranks), not the whole output."""
    from types import SimpleNamespace

    from launch.slurm.submit import report

    output = tmp_path / "slurm-7.out"
    output.write_text(
        "xds-mpi job 7 on n1: 5 ranks\n"
        "xds-mpi job: error: 5 ranks need at least 0.2 GiB on node n1 ...: nothing was launched\n"
        "srun: error: n1: task 0: Exited with exit code 2\n"
    )
    spec = SimpleNamespace(sweep=None, run_file=lambda idx: tmp_path / "none.h5")
    job = {"JobState": "FAILED", "ExitCode": "2:0", "RunTime": "00:00:01", "StdOut": str(output)}
    assert report(spec, "7", [job]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("job 7: FAILED (exit 2:0") and out[0].endswith(f"output {output}")
    assert out[1:] == [
        "  xds-mpi job: error: 5 ranks need at least 0.2 GiB on node n1 ...: nothing was launched"
    ]
