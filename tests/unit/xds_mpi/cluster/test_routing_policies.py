"""prefix, pd_heatmap and combined (xds_mpi/cluster/policies/) on crafted TE states and a crafted
heatmap with known answers, and their refusals (`xds-mpi validate` runs the policy's check)."""

from __future__ import annotations

import math

import pytest

from xds_mpi.cluster.heatmap import Heatmap, write_heatmap
from xds_mpi.cluster.policies import TeState, check_policy, explain, load_policy, policy_names
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.workload.requests import Request


def _state(te: int, tokens: int, *, prefix: int = 0, kind: str = "colocated", n: int = 1):
    return TeState(
        te=te, num_unfinished=n, unfinished_tokens=tokens, num_routed=0, kind=kind,
        prefix_tokens=prefix,
    )  # fmt: skip


def _req(prompt_len: int, output_len: int) -> Request:
    """A request served (and priced on the virtual clock) at these lengths: the heatmap's."""
    return Request(req_id=7, prompt=(1,) * prompt_len, max_new_tokens=output_len)


def _cfg(tmp_path, policy: str, *sets: str, heatmap: bool = True):
    """A 2-TE config; the crafted map: a prompt of 1000+ tokens with decode/prompt below 0.5
    goes to a PD pair (+0.6), everything else to the others."""
    path = tmp_path / "heatmap.json"
    cells = ((-0.2, -0.3), (0.6, -0.1))
    write_heatmap(
        path,
        Heatmap(
            prompt_edges=(0, 1000, 100_000), ratio_edges=(0, 0.5, 100), rps=(1.0,),
            cells=(cells,), combined=cells, sign_stable_share=1.0,
        ),
    )  # fmt: skip
    given = [f"cluster.heatmap={path}"] if heatmap else []
    return load_config(
        "configs/colocated.yaml", ["cluster.num_tes=2", f"cluster.policy={policy}", *given, *sets]
    )


def test_the_registry_finds_the_new_policies():
    assert policy_names() == ["combined", "least_load", "pd_heatmap", "prefix", "round_robin"]


def test_prefix_picks_the_te_holding_the_longest_prefix_then_the_least_load():
    pick = load_policy("prefix")
    req = Request(req_id=0, prompt=(1,) * 40, max_new_tokens=4)
    assert pick(req, [_state(0, 10), _state(1, 900, prefix=32), _state(2, 5, prefix=16)], 0) == 1
    # nobody holds any of it: the least load (unfinished requests, then tokens)
    assert pick(req, [_state(0, 10, n=2), _state(1, 900), _state(2, 5)], 0.0) == 2
    # equal prefixes: the least load of those two
    assert pick(req, [_state(0, 10), _state(1, 90, prefix=16), _state(2, 50, prefix=16)], 0) == 2
    scored = explain(pick, req, [_state(0, 10), _state(1, 90, prefix=16)], 0.0)
    assert scored.scores == (0.0, 16.0) and scored.note == "prefix 16 tokens"


def test_pd_heatmap_sends_a_long_prompt_with_a_short_predicted_output_to_the_pd_te(tmp_path):
    pick = load_policy("pd_heatmap", _cfg(tmp_path, "pd_heatmap"))
    tes = [_state(0, 10, kind="colocated"), _state(1, 900, kind="pd"), _state(2, 50)]
    # 8000-token prompt, 100 tokens out: predicted bucket 0 (64 tokens), ratio 0.008: +0.6
    scored = explain(pick, _req(8000, 100), tes, 0.0)
    assert scored.te == 1  # the PD pair, though the most loaded
    assert scored.scores == (-0.6, 0.6, -0.6) and scored.note == "heatmap +0.600 -> pd"
    # the same prompt with 6000 tokens out (ratio ~0.74): -0.1, the least loaded of the others
    assert pick(_req(8000, 6000), tes, 0.0) == 0
    assert pick(_req(500, 10), tes, 0.0) == 0  # a short prompt: -0.2
    # no PD TE: every TE is a candidate, the least loaded wins
    assert pick(_req(8000, 100), [_state(0, 10), _state(1, 5)], 0.0) == 1


def test_pd_heatmap_reads_the_predicted_length_not_the_true_one(tmp_path):
    """A predictor right with probability 0 is a bucket off (request 7, seed 0: one up): a
    1000-token prompt with 420 tokens out (bucket 3, 448 predicted by the true bucket: ratio
    0.448, +0.6) is predicted at bucket 4 (576 tokens: ratio 0.576, -0.1)."""
    wrong = load_policy("pd_heatmap", _cfg(tmp_path, "pd_heatmap", "cluster.predictor_accuracy=0"))
    right = load_policy("pd_heatmap", _cfg(tmp_path, "pd_heatmap"))
    tes = [_state(0, 10), _state(1, 10, kind="pd")]
    assert right(_req(1000, 420), tes, 0.0) == 1
    assert wrong(_req(1000, 420), tes, 0.0) == 0


def test_combined_uses_the_prefix_when_balanced_and_the_load_when_not(tmp_path):
    pick = load_policy("combined", _cfg(tmp_path, "combined", heatmap=False))
    req = Request(req_id=0, prompt=(1,) * 40, max_new_tokens=4)
    # 100 vs 110 unfinished tokens: 10 <= 0.25 x 100, balanced: the prefix wins
    balanced = [_state(0, 110, prefix=32), _state(1, 100)]
    scored = explain(pick, req, balanced, 0.0)
    assert scored.te == 0 and scored.scores == (32.0, 0.0)
    assert scored.note == "no heatmap; balanced -> prefix 32 tokens"
    # 200 vs 100: 100 > 25, unbalanced: the least loaded, whatever it holds
    unbalanced = [_state(0, 200, prefix=32), _state(1, 100)]
    scored = explain(pick, req, unbalanced, 0.0)
    assert scored.te == 1 and scored.scores == (-200.0, -100.0)
    assert scored.note == "no heatmap; unbalanced -> least load"
    # every TE idle is balanced; one idle and one not is not
    assert pick(req, [_state(0, 0, n=0), _state(1, 0, prefix=16, n=0)], 0.0) == 1
    assert pick(req, [_state(0, 0, n=0), _state(1, 4, prefix=16)], 0.0) == 0


def test_combined_narrows_to_the_heatmap_s_type_first(tmp_path):
    pick = load_policy("combined", _cfg(tmp_path, "combined"))
    tes = [
        _state(0, 100, prefix=64),
        _state(1, 1000, kind="pd"),
        _state(2, 1100, kind="pd", prefix=16),
    ]
    scored = explain(pick, _req(8000, 100), tes, 0.0)  # +0.6: the PD pairs, balanced among them
    assert scored.te == 2 and math.isnan(scored.scores[0]) and scored.scores[1:] == (0.0, 16.0)
    assert pick(_req(500, 10), tes, 0.0) == 0  # -0.2: the colocated TE alone


@pytest.mark.parametrize("policy", ["pd_heatmap"])
def test_a_policy_needing_a_heatmap_is_refused_without_one_naming_the_key(tmp_path, policy):
    cfg = _cfg(tmp_path, policy, heatmap=False)
    with pytest.raises(
        ConfigError, match=r"cluster.policy\(pd_heatmap\) reads a heatmap: set cluster.heatmap"
    ):
        load_policy(policy, cfg)
    with pytest.raises(ConfigError, match=r"set cluster.heatmap"):  # at validate
        check_policy(cfg)
    missing = f"cluster.heatmap={tmp_path / 'none.json'}"
    broken = load_config(
        "configs/colocated.yaml", ["cluster.num_tes=2", f"cluster.policy={policy}", missing]
    )
    with pytest.raises(
        ConfigError, match=r"cluster.heatmap\(.*none.json\): heatmap .* not a heatmap"
    ):
        check_policy(broken)


def test_combined_without_a_heatmap_validates():
    cfg = load_config("configs/colocated.yaml", ["cluster.num_tes=2", "cluster.policy=combined"])
    assert DeploymentPlan.build(cfg, None, launcher_checks=False).cluster.policy == "combined"


def test_a_trace_replay_is_looked_up_at_its_served_lengths_which_the_clock_prices(tmp_path):
    # served at a tenth of the trace: 600 of 6000 prompt tokens, 10 of 100 output tokens. At the
    # trace's lengths the map would say PD (+0.6); at the served ones, which the virtual clock
    # prices and the map was made at, not (-0.2).
    cfg = _cfg(
        tmp_path,
        "pd_heatmap",
        "workload.source=trace",
        "trace.path=any.jsonl",
        "trace.length_scale=0.1",
    )
    req = Request(
        req_id=7, prompt=(1,) * 600, max_new_tokens=10, trace_prompt_len=6000, trace_output_len=100
    )
    tes = [_state(0, 10, kind="colocated"), _state(1, 900, kind="pd")]
    scored = explain(load_policy("pd_heatmap", cfg), req, tes, 0.0)
    assert scored.note == "heatmap -0.200 -> not pd" and scored.te == 0
