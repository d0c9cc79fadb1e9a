"""YAML -> keyword-only frozen dataclasses: reading, `--set` overrides, type and key checks.

Schema-agnostic: `xds_mpi.config.schema` declares the sections and binds these functions to its root
`Config`. Every mapping that becomes a dataclass (a section, a `--set` key, a fault-table row)
passes the same unknown-key check, and every value the same type check.

PyYAML is imported where a text is parsed, not here: its import costs ~25 ms of CPU, and a rank
the launcher handed its config resolved (xds_mpi/plan/resolved.py) parses no YAML at all.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Literal

# YAML texts already parsed, text -> value: what the launcher parsed for the ranks
# (xds_mpi/plan/resolved.py `read_resolved` fills it). The same text parses to the same value.
_PARSED: dict[str, object] = {}


class ConfigError(ValueError):
    """A user's config is wrong; the message names the key and the numbers."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def positive(section: str, **values: int | float) -> None:
    for key, value in values.items():
        require(value > 0, f"{section}.{key} must be > 0, got {value}")


def non_negative(section: str, **values: int | float) -> None:
    for key, value in values.items():
        require(value >= 0, f"{section}.{key} must be >= 0, got {value}")


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def check_value(where: str, tp, value):
    """Return `value` as type `tp` (int widens to float) or raise ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return check_value(where, option, value)
            except ConfigError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is type(None):
        if value is None:
            return value
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{where} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def check_keys(cls: type, keys: typing.Iterable[str], where: str) -> None:
    """Refuse any key that is not a field of dataclass `cls`, naming it and the known ones."""
    known = [f.name for f in dataclasses.fields(cls)]
    for key in keys:
        if key not in known:
            raise ConfigError(f"unknown key {key!r} in {where} (known: {', '.join(known)})")


def build_record(cls: type, values, path: str, where: str | None = None):
    """Dataclass `cls` from a mapping: keys known and present when required, values typed.

    path: how values are named ("model" -> "model.top_k"); where: how the mapping is named in
    messages (default: path)."""
    where = where or path
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {values!r}")
    check_keys(cls, values, where)
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for key in required:
        if key not in values:
            raise ConfigError(f"{where} needs {key!r} (has: {', '.join(values) or 'nothing'})")
    hints = typing.get_type_hints(cls)
    return cls(**{key: check_value(f"{path}.{key}", hints[key], v) for key, v in values.items()})


def parse_override(text: str) -> tuple[str, str, object]:
    """Parse `section.key=value` (value in YAML syntax) into (section, key, value)."""
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml_module().YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({exc})") from None
    return section, key, value


def _check_section(sections: dict[str, type], name: str, prefix: str = "") -> None:
    if name not in sections:
        raise ConfigError(f"{prefix}unknown section {name!r} (known: {', '.join(sections)})")


def _apply_overrides(
    sections: dict[str, type], merged: dict, overrides: typing.Sequence[str]
) -> None:
    for text in overrides:
        section, key, value = parse_override(text)
        _check_section(sections, section, f"--set {text!r}: ")
        try:
            check_keys(sections[section], [key], f"section {section!r}")
        except ConfigError as exc:
            raise ConfigError(f"--set {text!r}: {exc}") from None
        merged.setdefault(section, {})
        if isinstance(merged[section], dict):
            merged[section][key] = value


def merge_overrides(root: type, data: dict | None, overrides: typing.Sequence[str] = ()) -> dict:
    """A parsed YAML mapping with `section.key=value` overrides applied (a new mapping), its
    sections and overridden keys checked against dataclass `root`."""
    sections: dict[str, type] = typing.get_type_hints(root)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    merged = {
        name: dict(values or {}) if isinstance(values, dict) else values
        for name, values in data.items()
    }
    _apply_overrides(sections, merged, overrides)
    for name in merged:
        _check_section(sections, name)
    return merged


def build_root(root: type, data: dict | None, overrides: typing.Sequence[str] = ()):
    """Dataclass `root` (one field per section) from a parsed YAML mapping plus
    `section.key=value` overrides."""
    sections: dict[str, type] = typing.get_type_hints(root)
    merged = merge_overrides(root, data, overrides)
    return root(
        **{
            name: build_record(sections[name], values, name, f"section {name!r}")
            for name, values in merged.items()
        }
    )


def yaml_module():
    """PyYAML, imported when first needed (also by an `except` clause, evaluated only when an
    exception is raised)."""
    import yaml  # start-up: PyYAML only where YAML is read (docs/scale.md)

    return yaml


def remember_parsed(parsed: dict[str, object]) -> None:
    """Texts and the values they parse to (the launcher's, xds_mpi/plan/resolved.py):
    `parse_yaml` returns a copy of the value for such a text instead of parsing it."""
    _PARSED.update(parsed)


def parse_yaml(text: str):
    """yaml.safe_load through libyaml when PyYAML has it (~8x faster; every rank reads its config,
    model preset and hardware profile at start-up), else PyYAML's own loader: the same values.
    A text `remember_parsed` was given is not parsed again: a copy of its value."""
    if text in _PARSED:
        return copy.deepcopy(_PARSED[text])
    yaml = yaml_module()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def read_yaml(path: Path) -> tuple[str, object]:
    """A YAML file's text and value; ConfigError names the file when it cannot be read or is not
    YAML."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(path)!r}: {exc.strerror}") from None
    try:
        return text, parse_yaml(text)
    except yaml_module().YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None


def read_root(root: type, path: str | Path, overrides: typing.Sequence[str] = ()):
    """Read a YAML file into dataclass `root` and apply `--set` overrides; errors name the file."""
    path = Path(path)
    _, data = read_yaml(path)
    try:
        return build_root(root, data, overrides)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
