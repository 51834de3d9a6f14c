"""Configuration for the entry points: one dataclass each, YAML files in configs/, then `key=value` overrides.

    python train.py configs/tiny/stage1.yaml steps=20 roc_mode=lowest

Rules (as nanoGPT's configurator, but typed): the dataclass defaults come first, each YAML file given on the command
line overrides them in order, then each `key=value` overrides those. An unknown key or a value of the wrong type is
an error that names the key (and the file and line for YAML). `key=value` values are read as YAML scalars, so
`lr=1e-6`, `resume=true` and `data=null` mean what they look like. The resolved config is printed by the entry point
and saved next to its outputs with `save_config`.
"""
import dataclasses
import sys
import types
import typing
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key and where it came from."""


def _check_type(name: str, value, hint, where: str):
    """Return `value` if it fits the field's type hint (int accepted for float), else raise ConfigError."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check_type(name, value, option, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: '{name}' must be {_type_name(hint)}, got {value!r}")
    if hint is type(None):
        if value is None:
            return None
    elif origin is list:
        (item,) = typing.get_args(hint) or (typing.Any,)
        if isinstance(value, list):
            return [_check_type(f"{name}[{i}]", v, item, where) for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif hint is typing.Any:
        return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `1e-6` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, hint):
        return value
    raise ConfigError(f"{where}: '{name}' must be {_type_name(hint)}, got {value!r}")


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _yaml_lines(path: Path, text: str) -> dict:
    """Line number (1-based) of each top-level key in a YAML mapping, for error messages."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if node is None:
        return {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level")
    return {k.value: k.start_mark.line + 1 for k, _ in node.value}


def load_config(cls, yaml_paths=(), overrides=()):
    """Build a `cls` dataclass from defaults, YAML files (in order) and `key=value` strings (in order)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for path in map(Path, yaml_paths):
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        text = path.read_text()
        lines = _yaml_lines(path, text)
        for key, value in (yaml.safe_load(text) or {}).items():
            where = f"{path}:{lines.get(key, '?')}"
            if key not in known:
                raise ConfigError(f"{where}: unknown config key '{key}' for {cls.__name__}")
            values[key] = _check_type(key, value, hints[key], where)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"command line: expected key=value, got {item!r}")
        if key not in known:
            raise ConfigError(f"command line: unknown config key '{key}' for {cls.__name__}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if hints[key] is str and value is not None and not isinstance(value, str):
            value = raw  # `name=123` for a string field means the string "123"
        values[key] = _check_type(key, value, hints[key], "command line")
    return cls(**values)


def parse_cli(cls, argv=None):
    """Entry-point helper: `[config.yaml ...] [key=value ...]` -> cls. Config errors exit with a one-line message."""
    argv = sys.argv[1:] if argv is None else list(argv)
    yaml_paths = [a for a in argv if "=" not in a]
    overrides = [a for a in argv if "=" in a]
    try:
        return load_config(cls, yaml_paths, overrides)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def format_config(cfg) -> str:
    """The resolved config as YAML text (printed at start of a run)."""
    return yaml.safe_dump(config_dict(cfg), sort_keys=False, width=120)


def save_config(cfg, path) -> None:
    """Write the resolved config as YAML, loadable again with `load_config(type(cfg), [path])`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_config(cfg))
