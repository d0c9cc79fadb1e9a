"""The config the launcher resolves for its ranks (xds_mpi/plan/resolved.py) gives them the
Config, cost preset and hardware profiles the YAML gives, without PyYAML."""

from __future__ import annotations

import json

import pytest
from harness import REPO_ROOT

from xds_mpi.config.schema import load_config
from xds_mpi.plan.resolved import SUFFIX, read_resolved, write_resolved

CONFIGS = REPO_ROOT / "configs"
CASES = [
    ("colocated", ["run.check=true"]),
    ("afd", ["deployment.dp_groups_per_domain=2", "workload.num_requests=3"]),
    ("pd", ["pd.prefill_profile=ascend910b", "run.name=x y"]),
    ("eplb", []),
    ("ep288", ["model.weights=random", "xccl.wait=sleep"]),
]


@pytest.mark.parametrize("name,overrides", CASES)
def test_a_resolved_config_is_the_yaml_with_its_overrides(tmp_path, name, overrides):
    path = CONFIGS / f"{name}.yaml"
    cfg = load_config(path, overrides)
    resolved = write_resolved(tmp_path, path, overrides, cfg)
    assert resolved is not None and resolved.name.endswith(SUFFIX)
    assert read_resolved(resolved, path, overrides) == cfg


def test_a_copy_made_of_another_config_or_other_overrides_or_missing_is_not_read(tmp_path):
    """The rank then reads the YAML (launch/job/rank.py read_config)."""
    path, overrides = CONFIGS / "colocated.yaml", ["run.check=true"]
    resolved = write_resolved(tmp_path, path, overrides, load_config(path, overrides))
    assert read_resolved(resolved, path, overrides) is not None
    assert read_resolved(resolved, path, []) is None
    assert read_resolved(resolved, path, [*overrides, "run.log_level=debug"]) is None
    assert read_resolved(resolved, CONFIGS / "afd.yaml", overrides) is None
    assert read_resolved(tmp_path / f"missing{SUFFIX}", path, overrides) is None


def test_one_file_per_content_written_once(tmp_path):
    path = CONFIGS / "colocated.yaml"
    first = write_resolved(tmp_path, path, [], load_config(path))
    mtime = first.stat().st_mtime_ns
    assert write_resolved(tmp_path, path, [], load_config(path)) == first
    assert first.stat().st_mtime_ns == mtime
    other = write_resolved(tmp_path, path, ["run.check=true"], load_config(path))
    assert other != first and sorted(p.name for p in first.parent.iterdir()) == sorted(
        [first.name, other.name]
    )


def test_a_value_json_cannot_hold_leaves_the_ranks_the_yaml(tmp_path):
    path = tmp_path / "nan.yaml"
    path.write_text("run:\n  timeout_s: .nan\n")  # NaN != NaN: not the same after JSON
    assert write_resolved(tmp_path, path, [], load_config(CONFIGS / "colocated.yaml")) is None


def test_a_file_of_another_format_is_not_read(tmp_path):
    path = tmp_path / f"x{SUFFIX}"
    path.write_text(json.dumps({"format": "something else"}))
    assert read_resolved(path, CONFIGS / "colocated.yaml", []) is None


def test_the_rank_reads_the_copy_it_is_named_or_else_the_yaml(tmp_path, capsys):
    """launch/job/prepare.py resolve_for_ranks -> launch/job/mpiexec.py rank_program ->
    launch/job/rank.py parse_args and read_config."""
    from launch.job.mpiexec import rank_program
    from launch.job.prepare import resolve_for_ranks
    from launch.job.rank import parse_args, read_config

    path, overrides = CONFIGS / "colocated.yaml", ["run.check=true"]
    cfg = load_config(path, [*overrides, f"run.output_dir={tmp_path / 'out'}"])
    resolved = resolve_for_ranks(path, overrides, cfg)
    assert resolved is not None and resolved.is_relative_to(tmp_path / "out")
    args = parse_args(rank_program(path, overrides, resolved)[5:])
    assert args.resolved == str(resolved) and read_config(args) == load_config(path, overrides)
    resolved.unlink()  # e.g. a host that does not see the output dir: the YAML
    assert read_config(args) == load_config(path, overrides)
    (tmp_path / "file").write_text("")  # an output_dir that cannot be made
    cfg = load_config(path, [f"run.output_dir={tmp_path / 'file' / 'out'}"])
    assert resolve_for_ranks(path, overrides, cfg) is None
    assert "the ranks read" in capsys.readouterr().out
