"""Model presets: the tiny compute shape that runs and DeepSeek-V3/R1's cost shape (data only).

Presets are YAML files in configs/model/ holding `model:` keys; both load into the same frozen
`ModelConfig`, so a cost model reads the published dimensions with the names the tiny model uses.
"""

from __future__ import annotations

import os
from pathlib import Path

from xds_mpi.config.loader import parse_yaml
from xds_mpi.config.schema import ConfigError, ModelConfig, config_from_dict

MODEL_PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
COMPUTE_PRESET = "tiny"
COST_PRESET = "deepseek_v3"


def presets_dir() -> Path:
    return Path(os.environ.get("XDS_MPI_MODEL_PRESETS", MODEL_PRESETS_DIR))


def available_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def preset_path(name_or_path: str | Path) -> Path:
    """The file of a preset name in configs/model/ (e.g. "tiny", "deepseek_v3") or a YAML file
    path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = presets_dir() / f"{str(name_or_path).removesuffix('.yaml')}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"model preset {str(name_or_path)!r} is neither a file nor a name in "
            f"{presets_dir()} (known: {', '.join(available_presets())})"
        )
    return path


def load_model_preset(name_or_path: str | Path) -> ModelConfig:
    """A preset name in configs/model/ (e.g. "tiny", "deepseek_v3") or a YAML file path."""
    path = preset_path(name_or_path)
    data = parse_yaml(path.read_text())
    if not isinstance(data, dict) or set(data) != {"model"}:
        raise ConfigError(
            f"{path}: a model preset holds exactly one section 'model', "
            f"got {sorted(data) if isinstance(data, dict) else type(data).__name__}"
        )
    try:
        return config_from_dict(data).model
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def compute_shape() -> ModelConfig:
    return load_model_preset(COMPUTE_PRESET)


def cost_shape() -> ModelConfig:
    return load_model_preset(COST_PRESET)
