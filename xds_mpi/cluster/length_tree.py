"""A depth-limited classification tree (CART by Gini impurity), numpy only: the classifier of
the decode-length model (xds_mpi/cluster/length_model.py), kept as flat arrays so it saves as
plain JSON and predicts a batch by walking every row down at once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Tree:
    """A classification tree as flat arrays, node 0 the root: node i sends x with
    x[feature[i]] <= threshold[i] to left[i], the others to right[i]; a leaf has feature -1 and
    predicts label[i]. All [num_nodes]: feature, left, right, label int64; threshold float64."""

    feature: np.ndarray
    threshold: np.ndarray
    left: np.ndarray
    right: np.ndarray
    label: np.ndarray

    def predict(self, x: np.ndarray) -> np.ndarray:
        """x: [n, num_features] -> [n] int64 classes."""
        node = np.zeros(len(x), dtype=np.int64)  # [n]: each row's node, walked down together
        rows = np.arange(len(x))
        while True:
            inner = self.feature[node] >= 0
            if not inner.any():
                return self.label[node]
            goes_left = x[rows, np.maximum(self.feature[node], 0)] <= self.threshold[node]
            node = np.where(inner, np.where(goes_left, self.left[node], self.right[node]), node)

    @property
    def depth(self) -> int:
        depths = np.zeros(len(self.feature), dtype=np.int64)
        for i in range(len(self.feature)):  # children come after their parent
            if self.feature[i] >= 0:
                depths[[self.left[i], self.right[i]]] = depths[i] + 1
        return int(depths.max())


def _best_split(x: np.ndarray, onehot: np.ndarray, min_leaf: int) -> tuple[float, int, float]:
    """(Gini gain, feature, threshold) of the best split of these rows leaving >= min_leaf rows
    on each side; gain 0 and feature -1 when none helps. x: [n, F]; onehot: [n, num_classes]."""
    n = len(x)
    total = onehot.sum(0)  # [num_classes]
    parent = 1.0 - ((total / n) ** 2).sum()
    num_left = np.arange(1, n)  # [n - 1]: rows left of each cut
    best = (0.0, -1, 0.0)
    for f in range(x.shape[1]):
        order = np.argsort(x[:, f], kind="stable")
        xs = x[order, f]
        left = np.cumsum(onehot[order], 0)[:-1]  # [n - 1, num_classes]: class counts left
        right = total - left
        gini_left = 1.0 - ((left / num_left[:, None]) ** 2).sum(1)
        gini_right = 1.0 - ((right / (n - num_left)[:, None]) ** 2).sum(1)
        gain = parent - (num_left * gini_left + (n - num_left) * gini_right) / n
        can_cut = (xs[:-1] < xs[1:]) & (num_left >= min_leaf) & (n - num_left >= min_leaf)
        if can_cut.any():
            cut = int(np.argmax(np.where(can_cut, gain, -1.0)))
            if gain[cut] > best[0] + 1e-12:
                best = (float(gain[cut]), f, float((xs[cut] + xs[cut + 1]) / 2))
    return best


def grow_tree(
    x: np.ndarray, y: np.ndarray, *, num_classes: int, max_depth: int, min_leaf: int
) -> Tree:
    """The tree of at most `max_depth` splits on any path and at least `min_leaf` rows per
    leaf: x [n, F] float64, y [n] int classes in [0, num_classes). A node splits where the
    Gini impurity falls most; a leaf predicts its most frequent class (the lowest on a tie)."""
    if len(x) == 0:
        raise ValueError("grow_tree needs at least one training row, got 0")
    onehot = np.eye(num_classes)[y]  # [n, num_classes]
    nodes: list[list] = []  # [feature, threshold, left, right, label]

    def grow(rows: np.ndarray, depth: int) -> int:
        index = len(nodes)
        nodes.append([-1, 0.0, -1, -1, int(np.argmax(onehot[rows].sum(0)))])
        if depth == max_depth or len(rows) < 2 * min_leaf:
            return index
        _, f, threshold = _best_split(x[rows], onehot[rows], min_leaf)
        if f < 0:
            return index
        goes_left = x[rows, f] <= threshold
        nodes[index][:2] = [f, threshold]
        nodes[index][2] = grow(rows[goes_left], depth + 1)
        nodes[index][3] = grow(rows[~goes_left], depth + 1)
        return index

    grow(np.arange(len(x)), 0)
    columns = list(zip(*nodes))
    return Tree(
        feature=np.array(columns[0], dtype=np.int64),
        threshold=np.array(columns[1], dtype=np.float64),
        left=np.array(columns[2], dtype=np.int64),
        right=np.array(columns[3], dtype=np.int64),
        label=np.array(columns[4], dtype=np.int64),
    )
