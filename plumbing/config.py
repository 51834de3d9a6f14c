"""Configuration for the entry points: one dataclass each, YAML files in configs/, then `key=value` overrides.

    python train.py configs/tiny/stage1.yaml steps=20 roc_mode=lowest

Rules (as nanoGPT's configurator, but typed): the dataclass defaults come first, each YAML file given on the command
line overrides them in order, then each `key=value` overrides those. An unknown key or a value of the wrong type is
an error that names the key (and the file and line for YAML). `key=value` values are read as YAML scalars, so
`lr=1e-6`, `resume=true` and `data=null` mean what they look like. The resolved config is printed by the entry point
and saved next to its outputs with `save_config`.

A YAML file may start from others: `base: rl.yaml` (or a list), paths relative to the file. The bases are read
first, in order, then the file's own keys override them; configs/tiny/stage{1,2,3}.yaml hold only what differs from
configs/tiny/rl.yaml. `--help` lists every field with its type, default, range and whole comment (`field_help`).

Types are checked here; the allowed range of each numeric field is a small table next to each dataclass
({field: "> 0"}, checked by `check_ranges` before the entry point does any work), so `lr=nan`, `steps=-5` or
`save_every=0` stop at once with one line naming the key instead of failing after a step or training silently.
"""
import dataclasses
import inspect
import math
import operator
import re
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
    if typing.get_origin(hint) is None and hasattr(hint, "__name__"):
        return hint.__name__
    return str(hint).replace("typing.", "")


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


def _read_yaml(path: Path, seen: tuple = ()) -> list[tuple[str, object, str]]:
    """(key, value, "file:line") for every key of `path`, its `base:` files' keys first (recursively)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' includes itself (through {' -> '.join(str(s) for s in seen)})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    lines = _yaml_lines(path, text)
    data = yaml.safe_load(text) or {}
    bases = data.pop("base", [])
    items = []
    for base in [bases] if isinstance(bases, str) else bases:
        if not isinstance(base, str):
            raise ConfigError(f"{path}:{lines.get('base', '?')}: 'base' must be a file name or a list of them")
        items += _read_yaml(path.parent / base, seen + (path.resolve(),))
    return items + [(key, value, f"{path}:{lines.get(key, '?')}") for key, value in data.items()]


def load_config(cls, yaml_paths=(), overrides=()):
    """Build a `cls` dataclass from defaults, YAML files (in order) and `key=value` strings (in order)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for path in map(Path, yaml_paths):
        for key, value, where in _read_yaml(path):
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


_COMPARISONS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def check_ranges(cfg, ranges: dict[str, str]) -> list[str]:
    """One readable line per numeric field of `cfg` outside its range; [] when all are in range.

    ranges: {field: rule}, a rule being comparisons joined by "and": "> 0", ">= 1", ">= 0 and < 1".
    None (an optional field left unset) passes. A float must also be finite: nan compares False with everything,
    so without this check it would pass any rule. Messages read "lr must be a finite number > 0, got nan"."""
    problems = []
    for name, rule in ranges.items():
        value = getattr(cfg, name)  # AttributeError: the table names a field the dataclass does not have
        if value is None:
            continue
        comparisons = [part.split() for part in rule.split(" and ")]
        ok = all(_COMPARISONS[op](value, float(bound)) for op, bound in comparisons)
        if isinstance(value, float):
            ok, kind = ok and math.isfinite(value), "a finite number"
        else:
            kind = "an integer"
        if not ok:
            problems.append(f"{name} must be {kind} {rule}, got {value!r}")
    return problems


def field_help(cls, ranges: dict[str, str] | None = None) -> str:
    """Every field of `cls`: name, type, default, its allowed values and the whole comment on its line in the source
    (with the comment-only lines under it, indented past the field's name), under the `# --- group` banners of the
    dataclass (the source is the one place the comments live). ranges: {field: rule} as `check_ranges` reads it;
    None: the `RANGES` table of the module that defines `cls`, where it has one."""
    if ranges is None:
        ranges = getattr(inspect.getmodule(cls), "RANGES", {})
    comments, groups = {}, {}
    group = last_field = None
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"\s*# -+ (.+)", line):
            group, last_field = m.group(1).strip(), None
        elif last_field and (m := re.match(r"( *)#\s*(.*)$", line)) and len(m.group(1)) > field_indent:
            joint = "" if re.search(r"\w-$", comments[last_field]) else " "  # "micro-" + "batches": one word
            comments[last_field] += joint + m.group(2).strip()  # a continuation of the field's comment
        elif m := re.match(r"( *)(\w+):[^#]*(?:#\s*(.*))?$", line):
            field_indent, last_field = len(m.group(1)), m.group(2)
            comments[last_field], groups[last_field] = (m.group(3) or "").strip(), group
        else:
            last_field = None
    hints = typing.get_type_hints(cls)
    out, last = [], object()
    for f in dataclasses.fields(cls):
        if groups.get(f.name) != last:
            last = groups.get(f.name)
            out.append(f"\n{last}:" if last else "")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        allowed = f", {ranges[f.name]}" if f.name in ranges else ""
        out.append(f"  {f.name} ({_type_name(hints[f.name])}, default {default!r}{allowed})"
                   + (f"\n      {comments[f.name]}" if comments.get(f.name) else ""))
    return "\n".join(out).lstrip("\n")


def parse_cli(cls, argv=None, usage: str = ""):
    """Entry-point helper: `[config.yaml ...] [key=value ...]` -> cls. Config errors exit with a one-line message;
    `-h` / `--help` prints `usage` and every field (`field_help`) and exits 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print((usage.strip() + "\n\n" if usage else "") + "Fields (YAML keys or key=value on the command line):\n"
              + field_help(cls))
        raise SystemExit(0)
    yaml_paths = [a for a in argv if "=" not in a]
    overrides = [a for a in argv if "=" in a]
    try:
        return load_config(cls, yaml_paths, overrides)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def tracker_config(cfg) -> dict:
    """The config as a tracker's hyperparameters: numbers, text and booleans as they are, anything else (None, lists)
    as its text. TensorBoard's hparams refuse other types."""
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in config_dict(cfg).items()}


def format_config(cfg) -> str:
    """The resolved config as YAML text (printed at start of a run)."""
    return yaml.safe_dump(config_dict(cfg), sort_keys=False, width=120)


def save_config(cfg, path) -> None:
    """Write the resolved config as YAML, loadable again with `load_config(type(cfg), [path])`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_config(cfg))
