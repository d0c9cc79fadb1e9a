"""The run file: one HDF5 file per run, written by the TE-shell when the run ends.

Layout (a later issue adds per-request results as more groups in the same file):

    /                attrs: format_version, name, status ("completed" or "failed: <why>"),
                            world_size, num_dies, num_host_ranks, wall_time_s, handshake_s,
                            started_at (ISO 8601, local time), topology (Topology.summary())
    /config          0-d string dataset: the effective config (file + --set) as YAML
    /ranks           table, one row per rank: rank, role, die_idx, server, chip, die_in_chip,
                     dp_domain, dp_group (-1 where it does not apply); host (Slurm node
                     name or host name) and node (lowest world rank on the rank's MPI memory
                     node) once the handshake has seen every rank
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import h5py
import numpy as np
import yaml

from xds_mpi.config.schema import Config, config_from_dict
from xds_mpi.plan.topology import Topology

FORMAT_VERSION = 1
RANK_FIELDS = ("rank", "die_idx", "server", "chip", "die_in_chip", "dp_domain", "dp_group")


def run_name(cfg: Config, started_at: datetime) -> str:
    """run.name, or one derived from the start time (to the microsecond, so runs started in the
    same second do not overwrite each other) and the PID."""
    if cfg.run.name:
        return cfg.run.name
    return f"run-{started_at:%Y%m%d-%H%M%S-%f}-{os.getpid()}"


def run_file_path(cfg: Config, started_at: datetime) -> Path:
    """run.output_dir / <name>.h5 (a relative output_dir is relative to the working directory)."""
    return Path(cfg.run.output_dir) / f"{run_name(cfg, started_at)}.h5"


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What a run file holds, as read back by `read_run_file`."""

    name: str
    status: str
    world_size: int
    num_dies: int
    num_host_ranks: int
    wall_time_s: float
    handshake_s: float
    started_at: str
    topology: str
    config: Config
    ranks: dict[str, np.ndarray]  # RANK_FIELDS + "role" (+ "host", "node"), each [world_size]


def write_run_file(
    path: str | Path,
    *,
    cfg: Config,
    topo: Topology,
    status: str,
    started_at: datetime,
    wall_time_s: float,
    handshake_s: float,
    extra: Callable[[h5py.File], None] | None = None,
    hosts: Sequence[str] = (),
    nodes: Sequence[int] = (),
) -> Path:
    """Write the run file atomically (a temp file renamed into place), so a reader never sees a
    half-written file and an array of runs never shares one. `extra` adds more groups (the
    serving results) before the file is renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs.update(
            format_version=FORMAT_VERSION,
            name=path.stem,
            status=status,
            world_size=topo.world_size,
            num_dies=topo.num_dies,
            num_host_ranks=topo.num_host_ranks,
            wall_time_s=wall_time_s,
            handshake_s=handshake_s,
            started_at=started_at.isoformat(),
            topology=topo.summary(),
        )
        f["config"] = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        ranks = f.create_group("ranks")
        for field in RANK_FIELDS:
            ranks[field] = np.array([getattr(info, field) for info in topo.ranks], dtype=np.int32)
        ranks["role"] = np.array([info.role for info in topo.ranks], dtype=h5py.string_dtype())
        if hosts:
            ranks["host"] = np.array(list(hosts), dtype=h5py.string_dtype())
            ranks["node"] = np.array(list(nodes), dtype=np.int32)
        if extra is not None:
            extra(f)
    os.replace(tmp, path)
    return path


def read_run_file(path: str | Path) -> RunRecord:
    with h5py.File(path, "r") as f:
        attrs = dict(f.attrs)
        config_text = f["config"][()].decode()
        ranks = {field: f["ranks"][field][()] for field in RANK_FIELDS}
        ranks["role"] = f["ranks"]["role"].asstr()[()]
        if "host" in f["ranks"]:
            ranks["host"] = f["ranks"]["host"].asstr()[()]
            ranks["node"] = f["ranks"]["node"][()]
    return RunRecord(
        name=str(attrs["name"]),
        status=str(attrs["status"]),
        world_size=int(attrs["world_size"]),
        num_dies=int(attrs["num_dies"]),
        num_host_ranks=int(attrs["num_host_ranks"]),
        wall_time_s=float(attrs["wall_time_s"]),
        handshake_s=float(attrs["handshake_s"]),
        started_at=str(attrs["started_at"]),
        topology=str(attrs["topology"]),
        config=config_from_dict(yaml.safe_load(config_text)),
        ranks=ranks,
    )
