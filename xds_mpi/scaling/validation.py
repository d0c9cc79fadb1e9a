"""CloudMatrix-Infer §4.4.3 Table 2 (model caching) against the TE-Load model.

The table's setting: a 671B INT8 model (~671 GB) in an OBS bucket of 2.5 GB/s, loaded by 8
instances at once ("Model load"), or by one instance switching to one of 8 models ("Model
switch"). The table does not say an instance's size: here CloudMatrix-Infer's prefill instance,
32 dies (§5.1). Its latencies are TE-Load's (storage or DRAM to NPU), not a whole scale event.

Calibration and validation are kept apart: the EMS cold start (one OBS fetch shared by the 8
instances, then the pool) sets `scaling.obs_efficiency` (`fit_obs_efficiency`); every other row
only checks the model. The model-switch row without a cache is one fetch by one loader, nearly
the calibration row again: it checks little beyond it (docs/scaling.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from xds_mpi.config.schema import Config
from xds_mpi.scaling.load import GB
from xds_mpi.scaling.steps import scale_out

MODEL_BYTES = 671 * GB  # [001] Table 2: "approximately 671GB data size"
NUM_INSTANCES = 8  # [001] Table 2: "into 8 model instances"
INSTANCE_DIES = 32  # assumption: [001] §5.1's prefill instance (16 NPUs, 32 dies)
SWITCH_HIT_RATE = 0.125  # [001] Table 2: local DRAM cache, 1 of 8 models cached
CALIBRATION = "EMS cold start"


@dataclass(frozen=True, kw_only=True)
class TableRow:
    """One latency of [001] Table 2 and how the model prices it.

    what: the row and column; published_s: the table's; path, num_loaders, ems_cached: the
    scale event that stands for it; hit_rate: where a DRAM cache holds the model with this
    probability (a switch), the latency is hit_rate x warm + (1 - hit_rate) x cold."""

    what: str
    published_s: float
    path: str
    num_loaders: int
    ems_cached: bool = True
    hit_rate: float = 0.0


TABLE2 = (
    TableRow(what="load, no cache: cold (OBS)", published_s=2560, path="cold", num_loaders=8),
    TableRow(what="load, local DRAM: cold", published_s=2560, path="cold", num_loaders=8),
    TableRow(what=CALIBRATION, published_s=320, path="ems", num_loaders=8, ems_cached=False),
    TableRow(what="load, local DRAM: warm", published_s=5, path="dram", num_loaders=8),
    TableRow(what="load, EMS: warm", published_s=5, path="ems", num_loaders=8),
    TableRow(what="switch, no cache", published_s=320, path="cold", num_loaders=1),
    TableRow(
        what="switch, local DRAM (12.5 % hit)",
        published_s=281,
        path="cold",
        num_loaders=1,
        hit_rate=SWITCH_HIT_RATE,
    ),
    TableRow(what="switch, EMS (100 % hit)", published_s=5, path="ems", num_loaders=1),
)


@dataclass(frozen=True, kw_only=True)
class Validation:
    """A row with the model's TE-Load seconds (`projected_s`, at cfg's obs_efficiency) and at
    the bucket's nominal bandwidth (`nominal_s`, obs_efficiency 1: nothing fitted)."""

    row: TableRow
    projected_s: float
    nominal_s: float

    @property
    def error(self) -> float:
        return (self.projected_s - self.row.published_s) / self.row.published_s

    @property
    def role(self) -> str:
        return "sets obs_efficiency" if self.row.what == CALIBRATION else "checks"


def load_s(cfg: Config, row: TableRow) -> float:
    """TE-Load seconds of one instance in `row`'s scenario."""

    def one(path: str) -> float:
        scaling = replace(cfg.scaling, path=path, ems_cached=row.ems_cached)
        timeline = scale_out(
            replace(cfg, scaling=scaling),
            num_dies=INSTANCE_DIES,
            num_new_tes=row.num_loaders,
            model_bytes=MODEL_BYTES,
        )
        return timeline.load.seconds

    if row.hit_rate:
        return row.hit_rate * one("dram") + (1 - row.hit_rate) * one(row.path)
    return one(row.path)


def fit_obs_efficiency(cfg: Config) -> float:
    """The OBS efficiency at which the calibration row comes out at its published seconds:
    the bucket's fetch takes what the row leaves after the pool transfer and tensor set-up."""
    (row,) = (r for r in TABLE2 if r.what == CALIBRATION)
    nominal = replace(cfg, scaling=replace(cfg.scaling, obs_efficiency=1.0))
    fetch_at_nominal = MODEL_BYTES / (cfg.scaling.obs_gb_per_s * GB)
    rest = load_s(nominal, row) - fetch_at_nominal
    return fetch_at_nominal / (row.published_s - rest)


def validate(cfg: Config) -> list[Validation]:
    """Every row of TABLE2, at cfg's figures and at nominal OBS bandwidth."""
    nominal = replace(cfg, scaling=replace(cfg.scaling, obs_efficiency=1.0))
    return [
        Validation(row=row, projected_s=load_s(cfg, row), nominal_s=load_s(nominal, row))
        for row in TABLE2
    ]
