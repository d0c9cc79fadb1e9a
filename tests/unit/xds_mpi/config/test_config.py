"""Config: YAML -> frozen dataclasses, unknown keys and bad values refused with the numbers."""

from __future__ import annotations

import dataclasses

import pytest

from xds_mpi.config.schema import (
    Config,
    ConfigError,
    FaultSpec,
    config_from_dict,
    load_config,
    parse_override,
)


def test_defaults_are_valid_and_frozen():
    cfg = config_from_dict({})
    assert cfg == Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.hidden = 7  # type: ignore[misc]


def test_sections_are_keyword_only():
    with pytest.raises(TypeError):
        Config().deployment.__class__("colocated")  # positional


def test_yaml_values_land_in_their_sections(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(
        "deployment:\n  dp_groups_per_domain: 6\nmodel:\n  top_k: 4\nxccl:\n  poll_timeout_s: 5\n"
    )
    cfg = load_config(path)
    assert cfg.deployment.dp_groups_per_domain == 6
    assert cfg.model.top_k == 4
    assert cfg.xccl.poll_timeout_s == 5.0 and isinstance(cfg.xccl.poll_timeout_s, float)
    assert cfg.workload == Config().workload


@pytest.mark.parametrize(
    "data, message",
    [
        ({"deployment": {"num_dies": 4}}, "unknown key 'num_dies' in section 'deployment'"),
        ({"modle": {}}, "unknown section 'modle'"),
        ({"model": {"top_k": "two"}}, "model.top_k must be int, got 'two'"),
        ({"model": {"top_k": True}}, "model.top_k must be int, got True"),
        ({"model": {"top_k": 1.5}}, "model.top_k must be int, got 1.5"),
        ({"deployment": {"kind": "mixed"}}, "deployment.kind must be one of 'colocated', 'afd'"),
        ({"model": {"top_k": 20}}, "model.top_k(20) must be <= model.num_routed_experts(16)"),
        (
            {"model": {"num_dense_layers": 4}},
            "model.num_dense_layers(4) must be < model.num_layers(4)",
        ),
        (
            {"model": {"num_routed_experts": 18, "num_expert_groups": 4}},
            "model.num_routed_experts(18) must be a multiple of model.num_expert_groups(4)",
        ),
        (
            {"deployment": {"kind": "afd", "dp_groups_per_domain": 4, "num_expert_dies": 3}},
            "num_expert_dies(3) < dp_groups_per_domain(4)",
        ),
        ({"deployment": {"num_dp_domains": 2}}, "num_dp_domains must be 1 for a colocated"),
        ({"deployment": {"shared_experts": "dedicated"}}, "num_shared_expert_dies must be > 0"),
        ({"xccl": {"slot_bytes": 0}}, "xccl.slot_bytes must be > 0, got 0"),
        ({"xccl": {"wait": "nap"}}, "xccl.wait must be one of 'auto', 'sleep', 'spin'"),
        (
            {"workload": {"prompt_len": 100}},
            "max_prompt_len(64) must be >= workload.prompt_len(100)",
        ),
        ({"workload": {"arrival": "rate"}}, "workload.rate_per_s must be > 0 when arrival is rate"),
        ({"scheduler": 5}, "section 'scheduler' must be a mapping"),
        # fault-table rows pass the same key and type checks as sections
        (
            {"faults": {"table": [{"die": 1, "op": "a2e", "layer": 1, "iteration": 0, "when": 3}]}},
            "unknown key 'when' in faults.table[0] (known: die, op, layer, iteration, code, times)",
        ),
        (
            {"faults": {"table": [{"die": 1, "op": "a2e", "layer": 1}]}},
            "faults.table[0] needs 'iteration' (has: die, op, layer)",
        ),
        (
            {"faults": {"table": [{"die": "x", "op": "a2e", "layer": 1, "iteration": 0}]}},
            "faults.table[0].die must be int, got 'x'",
        ),
        ({"faults": {"table": [7]}}, "faults.table[0] must be a mapping of keys to values, got 7"),
        (
            {"faults": {"table": [{"die": 1, "op": "alltoall", "layer": 1, "iteration": 0}]}},
            "faults.table[0].op: unknown operation 'alltoall' (known: p2p_send, p2p_recv",
        ),
        ({"faults": {"ops": ["bcast"]}}, "faults.ops: unknown operation 'bcast'"),
    ],
)
def test_bad_values_are_refused_with_the_numbers(data, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert message in str(err.value)


def test_overrides_are_typed_and_checked_like_the_file():
    cfg = config_from_dict(
        {"model": {"top_k": 4}}, ["model.top_k=8", "run.check=true", "xccl.poll_timeout_s=2"]
    )
    assert (cfg.model.top_k, cfg.run.check, cfg.xccl.poll_timeout_s) == (8, True, 2.0)
    with pytest.raises(ConfigError, match="model.top_k must be int, got 'x'"):
        config_from_dict({}, ["model.top_k=x"])
    with pytest.raises(ConfigError, match="--set 'model.topk=2': unknown key 'topk'"):
        config_from_dict({}, ["model.topk=2"])
    with pytest.raises(ConfigError, match="unknown section 'models'"):
        config_from_dict({}, ["models.top_k=2"])
    with pytest.raises(ConfigError, match="expects section.key=value"):
        parse_override("top_k=2")


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("deployment: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_a_config_round_trips_through_its_dict():
    cfg = config_from_dict(
        {
            "deployment": {"kind": "afd", "num_expert_dies": 5},
            "faults": {"table": [{"die": 5, "op": "e2a", "layer": 1, "iteration": 2, "times": 2}]},
        }
    )
    assert cfg.faults.table == [FaultSpec(die=5, op="e2a", layer=1, iteration=2, times=2)]
    assert config_from_dict(cfg.to_dict()) == cfg
