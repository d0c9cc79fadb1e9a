"""Decode-length prediction at a request's arrival (DeepServe §5.3.3; docs/cluster.md): what the
JE predicts of a request's output, in 128-token buckets at the scale the virtual clock prices
(`priced_output_len`), for `pd_heatmap` and `combined`.

`OraclePredictor` knows the true length and is right with a tunable probability (else off by
one bucket, up or down by the request's seeded coin), to measure what a misprediction costs;
a trained model (xds_mpi/cluster/length_model.py) predicts from what the JE knows at arrival.
`predictor_from(cfg)` is the one the config names (`cluster.predictor`).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Protocol

from xds_mpi.workload.requests import Request

if TYPE_CHECKING:
    from xds_mpi.config.schema import Config

BUCKET_TOKENS = 128  # DeepServe's bucket granularity


def bucket_of(num_tokens: int) -> int:
    return max(int(num_tokens), 0) // BUCKET_TOKENS


def bucket_tokens(bucket: int) -> int:
    """A bucket's middle, in tokens: the length a policy reads for a predicted bucket."""
    return bucket * BUCKET_TOKENS + BUCKET_TOKENS // 2


class Predictor(Protocol):
    def bucket(self, req: Request) -> int:
        """The predicted output bucket of `req` (pure: the same request, the same bucket)."""
        ...


class OraclePredictor:
    """The true bucket with probability `accuracy`; else the bucket above or below (below only
    when there is one), by a coin seeded with the request's id and `seed`."""

    def __init__(self, accuracy: float = 1.0, seed: int = 0) -> None:
        self.accuracy, self.seed = accuracy, seed

    def bucket(self, req: Request) -> int:
        true = bucket_of(req.priced_output_len)
        coin = random.Random(self.seed * 1_000_003 + req.req_id)
        if coin.random() < self.accuracy:
            return true
        return true + 1 if true == 0 or coin.random() < 0.5 else true - 1


def predictor_from(cfg: Config) -> Predictor:
    """The predictor `cluster.predictor` names: "oracle", or the file of a trained model."""
    cluster = cfg.cluster
    if cluster.predictor == "oracle":
        return OraclePredictor(cluster.predictor_accuracy, cfg.run.seed)
    # Lazy import: a trained model only when the config names one.
    from xds_mpi.cluster.length_model import load_length_model

    return load_length_model(cluster.predictor)
