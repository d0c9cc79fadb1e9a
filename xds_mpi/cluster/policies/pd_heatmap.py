"""pd_heatmap: PD-aware routing (DeepServe §5.3.2): the heatmap's value for the request's prompt
and predicted decode length picks the TE type, the PD-disaggregated pairs (kind "pd") when it is
positive, the others (colocated, afd) when not; among that type the least loaded TE
(`least_load`'s order); when the type has no TE, among all. The map is `cluster.heatmap`
(xds_mpi/cluster/heatmap.py, the combined map over the studied rates); the decode length is the
middle of the bucket `cluster.predictor` predicts (xds_mpi/cluster/predict.py). Its score, per
TE: the map's preference for that TE's type (the value for a PD pair, minus it for the others)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from xds_mpi.cluster.heatmap import Heatmap, read_heatmap
from xds_mpi.cluster.policies import Scored, ScoredPolicy, TeState, load_key
from xds_mpi.cluster.predict import Predictor, bucket_tokens, predictor_from
from xds_mpi.config.schema import ConfigError
from xds_mpi.workload.requests import Request

if TYPE_CHECKING:
    from xds_mpi.config.schema import Config

PD = "pd"


def check(cfg: Config) -> None:
    """The heatmap the policy reads: named and readable (ConfigError naming the key)."""
    read_map(cfg)


def read_map(cfg: Config) -> Heatmap:
    name, path = cfg.cluster.policy, cfg.cluster.heatmap
    if not path:
        raise ConfigError(
            f"cluster.policy({name}) reads a heatmap: set cluster.heatmap to a heatmap file "
            "(xds_mpi/cluster/heatmap.py; docs/routing.md)"
        )
    try:
        return read_heatmap(path)
    except ValueError as exc:
        raise ConfigError(f"cluster.heatmap({path}): {exc}") from exc


def output_scale(cfg: Config) -> float:
    """Served output tokens per trace token (1 but for a trace replay, docs/trace.md)."""
    if cfg.workload.source != "trace":
        return 1.0
    return cfg.trace.output_scale or cfg.trace.length_scale


class TypeByHeatmap:
    """The TE type a request goes to by the map and the predicted decode length. The map's
    lengths are the served ones, which the virtual clock prices (docs/heatmap.md): a trace
    replay's request is looked up at its served prompt and its predicted output (a trace-scale
    bucket) times the replay's output scale."""

    def __init__(self, heatmap: Heatmap, predictor: Predictor, scale: float = 1.0) -> None:
        self.heatmap, self.predictor, self.scale = heatmap, predictor, scale

    def value(self, request: Request) -> float:
        decode_len = bucket_tokens(self.predictor.bucket(request)) * self.scale
        return self.heatmap.value(len(request.prompt), decode_len)

    def narrow(
        self, request: Request, te_states: Sequence[TeState]
    ) -> tuple[list[TeState], tuple[float, ...], str]:
        """(the TEs of the chosen type, or all when it has none; per TE the map's preference for
        its type; a note naming the value and the type)."""
        value = self.value(request)
        is_pd = value > 0
        chosen = [s for s in te_states if (s.kind == PD) == is_pd]
        prefer = tuple(value if s.kind == PD else -value for s in te_states)
        kind = "pd" if is_pd else "not pd"
        note = f"heatmap {value:+.3f} -> {kind}" + ("" if chosen else " (none: all TEs)")
        return chosen or list(te_states), prefer, note


def make(cfg: Config) -> ScoredPolicy:
    by_type = TypeByHeatmap(read_map(cfg), predictor_from(cfg), output_scale(cfg))

    def scored(request: Request, te_states: Sequence[TeState], now_s: float) -> Scored:
        candidates, prefer, note = by_type.narrow(request, te_states)
        best = min(candidates, key=load_key)
        return Scored(te=best.te, scores=prefer, note=note)

    return ScoredPolicy(scored)
