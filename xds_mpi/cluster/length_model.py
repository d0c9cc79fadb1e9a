"""A trained decode-length predictor (DeepServe §5.3.3; docs/decode_length.md): a depth-limited
classification tree over what the JE knows at a request's arrival (`length_features`), into
128-token output buckets, the top one capped (>= TOP_BUCKET x 128 tokens is one class).

DeepServe classifies the prompt's text with a small LLM; a trace has no text, so this model reads
lengths and shared prefixes only. numpy only: the JE imports it.

- `train(requests)`: fits on requests in arrival order, the tree's depth chosen on the last
  `holdout_share` of them (by time), then refitted on all of them.
- `evaluate(model, train, held_out)`: accuracy on later requests, beside the majority class.
- `LengthModel.bucket(req)`: the `Predictor` the JE calls, once per request in arrival order;
  it keeps the prefix history of the requests it was asked about (it starts empty).
- `LengthModel.save(path)` / `load_length_model(path)`: a JSON file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xds_mpi.cluster.length_features import FEATURE_NAMES, PrefixHistory, history_features
from xds_mpi.cluster.length_tree import Tree, grow_tree
from xds_mpi.cluster.predict import BUCKET_TOKENS, bucket_of
from xds_mpi.config.loader import ConfigError
from xds_mpi.workload.requests import Request

TOP_BUCKET = 16  # outputs of >= 2048 tokens are one class
NUM_CLASSES = TOP_BUCKET + 1
FILE_FORMAT = "xds-mpi decode-length model"
FILE_VERSION = 1


def bucket_class(output_len: int) -> int:
    """The class of an output length: its 128-token bucket, capped at TOP_BUCKET."""
    return min(bucket_of(output_len), TOP_BUCKET)


def in_arrival_order(requests: list[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: (r.arrival_s, r.req_id))


def split_by_time(requests: list[Request], train_share: float) -> tuple[list, list]:
    """(the first `train_share` of the requests by arrival, the rest): disjoint, and every
    request of the first part arrives no later than any of the second."""
    if not 0 < train_share < 1:
        raise ValueError(f"train_share({train_share}) must be in (0, 1)")
    ordered = in_arrival_order(requests)
    num_train = round(train_share * len(ordered))
    if not 0 < num_train < len(ordered):
        raise ValueError(
            f"train_share({train_share}) of {len(ordered)} requests leaves a part empty"
        )
    return ordered[:num_train], ordered[num_train:]


class LengthModel:
    """A trained tree and the history it reads (a `Predictor`). The JE calls `bucket` in
    arrival order, once per request or more: a request asked again gets its first answer, a
    request arriving before the last new one is refused (PrefixHistory.observe)."""

    def __init__(
        self, tree: Tree, *, block_tokens: int, known_after_s: float, meta: dict | None = None
    ) -> None:
        self.tree, self.meta = tree, dict(meta or {})
        self.block_tokens, self.known_after_s = block_tokens, known_after_s
        self.history = PrefixHistory(block_tokens=block_tokens, known_after_s=known_after_s)
        self.decided: dict[int, int] = {}  # req_id -> its bucket

    def bucket(self, req: Request) -> int:
        if req.req_id not in self.decided:
            features = self.history.observe(req)
            self.decided[req.req_id] = int(self.tree.predict(features[None, :])[0])
        return self.decided[req.req_id]

    def features(self, requests: list[Request]) -> np.ndarray:
        """[len(requests), NUM_FEATURES]: `requests` (arrival order) through a fresh history."""
        return history_features(
            requests, block_tokens=self.block_tokens, known_after_s=self.known_after_s
        )

    def save(self, path: str | Path) -> None:
        t = self.tree
        doc = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "bucket_tokens": BUCKET_TOKENS,
            "num_classes": NUM_CLASSES,
            "feature_names": list(FEATURE_NAMES),
            "block_tokens": self.block_tokens,
            "known_after_s": self.known_after_s,
            "tree": {k: getattr(t, k).tolist() for k in Tree.__dataclass_fields__},
            "meta": self.meta,
        }
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_length_model(path: str | Path) -> LengthModel:
    """The model `LengthModel.save` wrote; ConfigError naming what does not match."""
    doc = json.loads(Path(path).read_text())
    expected = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "bucket_tokens": BUCKET_TOKENS,
        "num_classes": NUM_CLASSES,
        "feature_names": list(FEATURE_NAMES),
    }
    for key, value in expected.items():
        if not isinstance(doc, dict) or doc.get(key) != value:
            found = doc.get(key) if isinstance(doc, dict) else type(doc).__name__
            raise ConfigError(
                f"{path}: not a length model this code reads: {key} is {found!r}, "
                f"{value!r} expected (train one with `xds-mpi predict`)"
            )
    t = doc["tree"]
    tree = Tree(
        feature=np.array(t["feature"], dtype=np.int64),
        threshold=np.array(t["threshold"], dtype=np.float64),
        left=np.array(t["left"], dtype=np.int64),
        right=np.array(t["right"], dtype=np.int64),
        label=np.array(t["label"], dtype=np.int64),
    )
    return LengthModel(
        tree,
        block_tokens=doc["block_tokens"],
        known_after_s=doc["known_after_s"],
        meta=doc.get("meta", {}),
    )


def train(
    requests: list[Request],
    *,
    block_tokens: int = 512,
    known_after_s: float = 60.0,
    max_depths: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8),
    min_leaf: int = 40,
    holdout_share: float = 0.25,
    progress: Callable[[str], None] = lambda line: None,
) -> LengthModel:
    """A model fitted on `requests` (their true output lengths are the labels). Each depth of
    `max_depths` is fitted on all but the last `holdout_share` of them (by arrival) and scored
    on that last part; the best depth (the shallowest on a tie) is refitted on all of them."""
    ordered = in_arrival_order(requests)
    x = history_features(ordered, block_tokens=block_tokens, known_after_s=known_after_s)
    y = np.array([bucket_class(r.priced_output_len) for r in ordered], dtype=np.int64)  # [n]
    num_fit = len(ordered) - round(holdout_share * len(ordered))
    if not 0 < num_fit < len(ordered):
        raise ValueError(
            f"holdout_share({holdout_share}) of {len(ordered)} requests leaves a part empty"
        )
    scores = {}
    for depth in max_depths:
        tree = grow_tree(
            x[:num_fit], y[:num_fit], num_classes=NUM_CLASSES, max_depth=depth, min_leaf=min_leaf
        )
        scores[depth] = float(np.mean(tree.predict(x[num_fit:]) == y[num_fit:]))
        progress(f"depth {depth}: {scores[depth]:.1%} right on the last {len(y) - num_fit}")
    best = min(scores, key=lambda d: (-scores[d], d))
    tree = grow_tree(x, y, num_classes=NUM_CLASSES, max_depth=best, min_leaf=min_leaf)
    meta = {
        "num_train": len(ordered),
        "train_arrivals_s": [ordered[0].arrival_s, ordered[-1].arrival_s],
        "max_depth": best,
        "min_leaf": min_leaf,
        "holdout_share": holdout_share,
        "holdout_accuracy_by_depth": {str(d): round(a, 4) for d, a in scores.items()},
    }
    return LengthModel(tree, block_tokens=block_tokens, known_after_s=known_after_s, meta=meta)


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """A model's classes for held-out requests against their true ones (capped buckets).
    accuracy: the share right; within_one: the share off by at most one bucket;
    majority_class: the training part's most frequent class, majority_accuracy: its share of
    the held-out ones (the baseline); true_counts, predicted_counts, correct_counts:
    [NUM_CLASSES] int64 per class."""

    num_train: int
    num_eval: int
    accuracy: float
    within_one: float
    majority_class: int
    majority_accuracy: float
    true_counts: np.ndarray
    predicted_counts: np.ndarray
    correct_counts: np.ndarray


def evaluate(model: LengthModel, train: list[Request], held_out: list[Request]) -> Evaluation:
    """`model` on `held_out`, whose features read the history of `train` before them (the JE
    that served `train` has seen it); refused unless every held-out request arrives no earlier
    than every training one."""
    train, held_out = in_arrival_order(train), in_arrival_order(held_out)
    if train and held_out and held_out[0].arrival_s < train[-1].arrival_s:
        raise ValueError(
            f"held-out request {held_out[0].req_id} arrives at {held_out[0].arrival_s:g} s, "
            f"before the last training one ({train[-1].arrival_s:g} s): split by time"
        )
    x = model.features(train + held_out)[len(train) :]  # [num_eval, NUM_FEATURES]
    predicted = model.tree.predict(x)
    true = np.array([bucket_class(r.priced_output_len) for r in held_out], dtype=np.int64)
    train_counts = np.bincount(
        [bucket_class(r.priced_output_len) for r in train], minlength=NUM_CLASSES
    )
    majority = int(np.argmax(train_counts))
    return Evaluation(
        num_train=len(train),
        num_eval=len(held_out),
        accuracy=float(np.mean(predicted == true)),
        within_one=float(np.mean(np.abs(predicted - true) <= 1)),
        majority_class=majority,
        majority_accuracy=float(np.mean(true == majority)),
        true_counts=np.bincount(true, minlength=NUM_CLASSES),
        predicted_counts=np.bincount(predicted, minlength=NUM_CLASSES),
        correct_counts=np.bincount(true[predicted == true], minlength=NUM_CLASSES),
    )
