"""Where configs live, and how a config argument (a path or a name in configs/) is resolved."""

from __future__ import annotations

import os
from pathlib import Path

from xds_mpi.config.schema import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "colocated"


def configs_dir() -> Path:
    """configs/ beside the packages (editable install or checkout), or $XDS_MPI_CONFIGS."""
    return Path(os.environ.get("XDS_MPI_CONFIGS", REPO_ROOT / "configs"))


def available_configs() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


def resolve_config(arg: str | None) -> Path:
    """A path to an existing file, else the name of a YAML file in configs/."""
    arg = arg or DEFAULT_CONFIG
    path = Path(arg)
    if path.is_file():
        return path.resolve()
    named = configs_dir() / f"{arg.removesuffix('.yaml')}.yaml"
    if named.is_file():
        return named.resolve()
    known = ", ".join(available_configs()) or f"none in {configs_dir()}"
    raise ConfigError(f"config {arg!r} is neither a file nor a name in configs/ (known: {known})")
