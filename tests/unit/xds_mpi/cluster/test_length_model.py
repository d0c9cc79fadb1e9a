"""Decode-length prediction (xds_mpi/cluster/length_model.py, length_features.py,
length_tree.py): synthetic traces with a known rule the classifier must learn, the oracle's
measured accuracy against its setting, causality of the features, and the model file."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from xds_mpi.cluster.length_features import FEATURE_NAMES, PrefixHistory, history_features
from xds_mpi.cluster.length_model import (
    NUM_CLASSES,
    TOP_BUCKET,
    LengthModel,
    bucket_class,
    evaluate,
    load_length_model,
    split_by_time,
    train,
)
from xds_mpi.cluster.length_tree import grow_tree
from xds_mpi.cluster.predict import OraclePredictor, bucket_of, predictor_from
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.workload.requests import Request

COLUMN = {name: i for i, name in enumerate(FEATURE_NAMES)}


def _req(req_id, arrival_s, prompt_len, output_len, block_ids=()) -> Request:
    return Request(
        req_id=req_id,
        prompt=(),
        max_new_tokens=output_len,
        arrival_s=arrival_s,
        trace_prompt_len=prompt_len,
        trace_output_len=output_len,
        block_ids=tuple(block_ids),
    )


def _prompt_rule_trace(num: int, seed: int) -> list[Request]:
    """Prompts of 1..5999 tokens with no shared blocks; the output's bucket is the prompt's
    thousands: bucket = prompt // 1000, six classes about equally frequent."""
    rng = np.random.default_rng(seed)
    reqs = []
    for k in range(num):
        prompt = int(rng.integers(1, 6000))
        output = 128 * (prompt // 1000) + int(rng.integers(0, 128))
        blocks = [10_000_000 + 100 * k + b for b in range(math.ceil(prompt / 512))]
        reqs.append(_req(k, float(k), prompt, output, blocks))
    return reqs


def _conversation_trace(num_conversations: int, seed: int, gap_s: float) -> list[Request]:
    """Two-turn conversations: a first turn of random prompt and an output of bucket 1 or 6 by
    a coin, then `gap_s` later a second turn extending its prompt whose output has the first
    turn's bucket. Prompt lengths say nothing; only the first turn's output does."""
    rng = np.random.default_rng(seed)
    reqs, k = [], 0
    for c in range(num_conversations):
        t0 = 5.0 * c
        bucket = 1 if rng.random() < 0.5 else 6
        first_len = int(rng.integers(600, 4000))
        second_len = first_len + int(rng.integers(600, 2000))
        first_ids = [1_000 * c + b for b in range(math.ceil(first_len / 512))]
        second_ids = first_ids[:-1] + [
            1_000 * c + 500 + b for b in range(math.ceil(second_len / 512) - len(first_ids) + 1)
        ]
        for arrival, prompt, ids in (
            (t0, first_len, first_ids),
            (t0 + gap_s, second_len, second_ids),
        ):
            output = 128 * bucket + int(rng.integers(0, 128))
            reqs.append(_req(k, arrival, prompt, output, ids))
            k += 1
    return sorted(reqs, key=lambda r: (r.arrival_s, r.req_id))


def test_buckets_are_128_tokens_and_the_top_one_is_capped():
    assert [bucket_class(n) for n in (0, 127, 128, 2047, 2048, 50_000)] == [0, 0, 1, 15, 16, 16]
    assert TOP_BUCKET == 16 and NUM_CLASSES == 17


def test_the_tree_learns_a_threshold_rule_on_two_features():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, size=(2000, 3))  # [n, 3]; feature 2 is noise
    y = (x[:, 0] > 0.3).astype(np.int64) + 2 * (x[:, 1] > 0.6)  # classes 0..3
    tree = grow_tree(x[:1500], y[:1500], num_classes=4, max_depth=3, min_leaf=5)
    assert np.mean(tree.predict(x[1500:]) == y[1500:]) > 0.97
    row_by_row = [int(tree.predict(row[None, :])[0]) for row in x[1500:1600]]
    assert row_by_row == tree.predict(x[1500:1600]).tolist()
    stump = grow_tree(x, y, num_classes=4, max_depth=0, min_leaf=5)
    assert stump.depth == 0 and stump.predict(x).tolist() == [np.bincount(y).argmax()] * 2000


def test_a_model_learns_the_output_from_the_prompt_length_when_that_is_the_rule():
    train_part, held_out = split_by_time(_prompt_rule_trace(1200, seed=1), 0.5)
    model = train(train_part, min_leaf=10)
    result = evaluate(model, train_part, held_out)
    assert result.accuracy > 0.97, result
    assert result.majority_accuracy < 0.25  # six classes: the baseline cannot pass
    assert result.true_counts.sum() == result.predicted_counts.sum() == len(held_out) == 600


def test_a_model_learns_a_conversations_previous_output_once_it_is_known():
    """The second turn's bucket is the first turn's. Second turns arrive 90 s after the first:
    with known_after_s 60 the first output is known and the model gets them right; with 120 it
    is not, and nothing else tells the bucket (a coin: about half right)."""
    reqs = _conversation_trace(600, seed=2, gap_s=90.0)
    train_part, held_out = split_by_time(reqs, 0.5)
    second_ids = {r.req_id for r in held_out if r.req_id % 2 == 1}
    by_id = {r.req_id: r for r in reqs}
    for known_after_s, lowest, highest in ((60.0, 0.97, 1.0), (120.0, 0.3, 0.7)):
        model = train(train_part, known_after_s=known_after_s, min_leaf=10)
        predicted = {r.req_id: model.bucket(r) for r in train_part + held_out}
        right = [predicted[i] == bucket_of(by_id[i].priced_output_len) for i in second_ids]
        assert lowest <= np.mean(right) <= highest, (known_after_s, np.mean(right))


@pytest.mark.parametrize("accuracy", [0.5, 0.849, 1.0])
def test_the_oracles_measured_accuracy_matches_its_setting(accuracy):
    """Within 4 binomial standard deviations over 5000 requests; a miss is one bucket off."""
    rng = np.random.default_rng(3)
    reqs = [_req(k, 0.0, 100, int(rng.integers(1, 3000))) for k in range(5000)]
    oracle = OraclePredictor(accuracy, seed=7)
    true = np.array([bucket_of(r.priced_output_len) for r in reqs])
    predicted = np.array([oracle.bucket(r) for r in reqs])
    measured = np.mean(predicted == true)
    sigma = math.sqrt(accuracy * (1 - accuracy) / len(reqs))
    assert abs(measured - accuracy) <= 4 * sigma + 1e-12, (measured, accuracy)
    assert set(np.abs(predicted - true)) <= {0, 1}
    assert predicted.tolist() == [oracle.bucket(r) for r in reqs]  # pure: asked again, the same


def test_no_feature_reads_a_later_request_or_its_own_output():
    reqs = _conversation_trace(40, seed=4, gap_s=90.0)
    features = history_features(reqs, known_after_s=60.0)  # [80, NUM_FEATURES]
    cut = 41
    later_changed = reqs[:cut] + [
        replace(r, trace_prompt_len=3 * r.trace_prompt_len, trace_output_len=1999)
        for r in reqs[cut:]
    ]
    np.testing.assert_array_equal(history_features(later_changed)[:cut], features[:cut])
    own_changed = [*reqs[: cut - 1], replace(reqs[cut - 1], trace_output_len=5)]
    np.testing.assert_array_equal(history_features(own_changed)[cut - 1], features[cut - 1])


def test_an_earlier_output_counts_only_from_known_after_s_after_its_arrival():
    first = _req(0, 0.0, 1024, 700, [1, 2])
    for arrival_s, is_known in ((59.9, False), (60.0, True)):
        history = PrefixHistory(known_after_s=60.0)
        history.observe(first)
        x = history.observe(_req(1, arrival_s, 2048, 3, [1, 2, 3, 4]))
        assert x[COLUMN["log_shared_blocks"]] == pytest.approx(math.log1p(2))  # known at arrival
        assert x[COLUMN["log_growth"]] == pytest.approx(math.log1p(1024))
        assert x[COLUMN["has_known"]] == float(is_known)
        assert x[COLUMN["known_blocks"]] == (2.0 if is_known else 0.0)
        assert x[COLUMN["log_known_last"]] == pytest.approx(math.log1p(700) if is_known else 0.0)


def test_the_history_refuses_a_request_out_of_arrival_order():
    history = PrefixHistory()
    history.observe(_req(0, 10.0, 100, 5))
    with pytest.raises(
        ValueError, match=r"request 1 arrives at 9 s, before the last one observed \(10 s\)"
    ):
        history.observe(_req(1, 9.0, 100, 5))


def test_evaluate_refuses_a_held_out_part_that_starts_before_training_ends():
    reqs = _prompt_rule_trace(200, seed=5)
    model = train(reqs[:100], min_leaf=10)
    with pytest.raises(ValueError, match="before the last training one"):
        evaluate(model, reqs[50:150], reqs[:50])


def test_the_model_file_round_trips_and_the_config_names_it(tmp_path):
    reqs = _conversation_trace(200, seed=6, gap_s=90.0)
    model = train(reqs[:300], min_leaf=10)
    path = tmp_path / "model.json"
    model.save(path)
    cfg = load_config(resolve_config("colocated"), [f"cluster.predictor={path}"])
    loaded = predictor_from(cfg)
    assert isinstance(loaded, LengthModel) and loaded.meta == model.meta
    fresh = LengthModel(model.tree, block_tokens=512, known_after_s=model.known_after_s)
    assert [loaded.bucket(r) for r in reqs] == [fresh.bucket(r) for r in reqs]
    assert [loaded.bucket(r) for r in reqs[:5]] == [fresh.bucket(r) for r in reqs[:5]]  # again
    batch = model.tree.predict(model.features(reqs))
    assert [fresh.bucket(r) for r in reqs] == batch.tolist()


def test_a_file_that_is_not_a_length_model_is_refused_by_name(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(
        ConfigError, match=r"other.json: not a length model .*format is 'something else'"
    ):
        load_length_model(path)
