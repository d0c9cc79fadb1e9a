"""A config resolved by the launcher for its ranks: JSON, read without PyYAML.

PyYAML's import costs every rank ~25 ms of start-up CPU (issue 33), to read small files the
launcher has read already: the config with its `--set` values, the cost preset and the hardware
profiles. So the launcher (`xds-mpi run`, `serve`, `submit`: launch/job/prepare.py
`resolve_for_ranks`) writes what they hold into one JSON file under run.output_dir/.config/,
once per content (the file's name carries a CRC-32 of it), and names it on each rank's line
(`--resolved`, after the YAML and its `--set` values). A rank reads it with the json module
(`read_resolved`) when it finds it and it was made of that YAML file and those values, else it
reads the YAML. The preset's and the profiles' values go in keyed by their YAML text: a rank
that reads a file of that very text takes the value (xds_mpi/config/loader.py
`remember_parsed`), any other text it parses itself. Values that would not come back from JSON
as they are (e.g. a YAML date) are not written: the ranks then read the YAML. A rank given no
resolved file (a test body, a hand-written mpiexec line, a dry run's line) parses the YAML.
"""

from __future__ import annotations

import json
import os
import typing
import zlib
from pathlib import Path

from xds_mpi.config.hardware import profile_path
from xds_mpi.config.loader import (
    ConfigError,
    build_root,
    merge_overrides,
    read_yaml,
    remember_parsed,
)
from xds_mpi.config.schema import Config
from xds_mpi.model.shapes import COST_PRESET, preset_path

FORMAT = "xds-mpi-resolved/1"
CACHE_DIR = ".config"  # under run.output_dir
SUFFIX = ".resolved.json"


def rank_yaml_files(cfg) -> list[Path]:
    """The YAML files a rank of `cfg` reads besides its config: the cost preset and the hardware
    profiles (the main one, a PD prefill die's)."""
    profiles = dict.fromkeys(p for p in (cfg.hardware.profile, cfg.pd.prefill_profile) if p)
    return [preset_path(COST_PRESET), *(profile_path(name) for name in profiles)]


def resolve(config_path: str | Path, overrides: typing.Sequence[str], files: list[Path]) -> dict:
    """What a rank reads: the config's mapping with `overrides` applied, and each of `files`'
    text with its value."""
    _, data = read_yaml(Path(config_path))
    parsed = dict(read_yaml(path) for path in files)
    return {
        "format": FORMAT,
        "source": str(Path(config_path).resolve()),
        "overrides": list(overrides),
        "config": merge_overrides(Config, data, overrides),
        "parsed": parsed,
    }


def write_resolved(
    output_dir: str | Path, config_path: str | Path, overrides: typing.Sequence[str], cfg
) -> Path | None:
    """The resolved file of this config and these overrides under `output_dir` (absolute),
    written now unless it is there; None when a value would not survive JSON (the ranks then
    read the YAML). Raises OSError where it cannot be written."""
    resolved = resolve(config_path, overrides, rank_yaml_files(cfg))
    try:
        text = json.dumps(resolved, sort_keys=True)
    except (TypeError, ValueError):  # a value JSON has no type for
        return None
    if json.loads(text) != resolved:  # e.g. NaN, or a key that is not a string
        return None
    name = f"{Path(config_path).stem}-{zlib.crc32(text.encode()):08x}{SUFFIX}"
    target = Path(output_dir, CACHE_DIR, name).resolve()
    if target.is_file() and target.read_text() == text:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{name}.{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, target)  # a rank never sees half of one; two launchers write the same
    return target


def read_resolved(path: str | Path, config_path: str | Path, overrides: typing.Sequence[str]):
    """The Config of a resolved file made of `config_path` and `overrides`, or None when there is
    no such file here (another host's output dir, another format) or it was made of another
    config or other overrides: the caller then reads the YAML."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    made_of = (str(Path(config_path).resolve()), list(overrides))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    if (data["source"], data["overrides"]) != made_of:
        return None
    remember_parsed(data["parsed"])
    try:
        return build_root(Config, data["config"])
    except ConfigError as exc:
        raise ConfigError(f"{path} (resolved from {data['source']}): {exc}") from None
