"""Hardware profiles: configs/hardware/<name>.yaml, each value citing its source paper."""

from __future__ import annotations

from pathlib import Path

from xds_mpi.config.loader import parse_yaml
from xds_mpi.config.schema import ConfigError

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


def profile_path(name: str) -> Path:
    """The file of a profile name (configs/hardware/<name>.yaml) or path."""
    path = Path(name) if name.endswith(".yaml") else PROFILE_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
        raise ConfigError(f"hardware.profile {name!r}: no such profile (known: {known})")
    return path


def load_profile(name: str) -> dict:
    """A profile by name (configs/hardware/<name>.yaml) or by path. A profile with `base: <name>`
    is that profile with each of its own sections updating the base's (a section's keys replace
    the base's, its other keys stay): ascend910c_kernels is ascend910c with issue 61's sections."""
    path = profile_path(name)
    profile = parse_yaml(path.read_text())
    if "base" in profile:
        base = load_profile(profile.pop("base"))
        for key, value in profile.items():
            if isinstance(value, dict) and isinstance(base.get(key), dict):
                base[key] = {**base[key], **value}
            else:
                base[key] = value
        profile = base
    for section, keys in REQUIRED.items():
        missing = [k for k in keys if k not in profile.get(section, {})]
        if missing:
            raise ConfigError(f"hardware profile {path}: section {section!r} lacks {missing}")
    return profile


REQUIRED = {
    "die": ["bf16_tflops", "int8_tops", "hbm_gb", "hbm_tb_per_s", "aiv_cores"],
    "ub": [
        "link_gb_per_s",
        "node_dies",
        "write_gb_per_s_inter",
        "write_gb_per_s_intra",
        "write_latency_us_inter",
        "write_latency_us_intra",
        "mte_gb_per_s_per_core",
        "dma_startup_us",
    ],
}

# die.stream_split: how the colocated two-stream die splits its cores where no split is given
# (xds_mpi/projection/layers.py): "cores", whole cores (the default); "equal", the share of the
# cube cores that equalises the two streams
STREAM_SPLITS = ("cores", "equal")


def stream_split(die: dict) -> str:
    """A profile's die.stream_split, "cores" when absent."""
    split = die.get("stream_split", "cores")
    if split not in STREAM_SPLITS:
        raise ConfigError(f"die.stream_split {split!r}: expected one of {STREAM_SPLITS}")
    return split
