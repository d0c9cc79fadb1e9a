"""The config the launcher resolves for its ranks (xds_mpi/config/resolved.py) gives them the
Config, cost preset and hardware profiles the YAML gives, without PyYAML."""

from __future__ import annotations

import json

import pytest
from harness import REPO_ROOT

from xds_mpi.config.loader import ConfigError
from xds_mpi.config.resolved import SUFFIX, read_resolved, write_resolved
from xds_mpi.config.schema import load_config

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
    assert read_resolved(resolved) == cfg
    # Further --set values apply on top, as on a YAML file.
    more = ["run.log_level=debug"]
    assert read_resolved(resolved, more) == load_config(path, [*overrides, *more])


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


def test_a_file_that_is_not_a_resolved_config_is_refused(tmp_path):
    path = tmp_path / f"x{SUFFIX}"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ConfigError, match="not a resolved config"):
        read_resolved(path)


def test_the_launcher_hands_the_ranks_the_resolved_file_or_else_the_yaml(tmp_path, capsys):
    from launch.startup import rank_config

    path, overrides = CONFIGS / "colocated.yaml", ["run.check=true"]
    out = tmp_path / "out"
    config, sets = rank_config(path, overrides, load_config(path, [f"run.output_dir={out}"]))
    assert config.endswith(SUFFIX) and config.startswith(str(out)) and sets == []
    (tmp_path / "file").write_text("")  # an output_dir that cannot be made
    cfg = load_config(path, [f"run.output_dir={tmp_path / 'file' / 'out'}"])
    assert rank_config(path, overrides, cfg) == (str(path), overrides)
    assert "the ranks read" in capsys.readouterr().out
