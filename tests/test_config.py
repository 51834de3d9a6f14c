"""The config helper: defaults, YAML, key=value overrides, and errors that name the key."""
from dataclasses import dataclass, field

import pytest

from config import ConfigError, load_config, parse_cli, save_config


@dataclass
class Demo:
    lr: float = 1e-6          # learning rate
    steps: int = 10
    name: str = "run"
    resume: bool = False
    data: str | None = None
    stages: list[int] = field(default_factory=lambda: [1, 2])


def test_defaults_yaml_then_overrides(tmp_path):
    cfg_file = tmp_path / "a.yaml"
    cfg_file.write_text("lr: 0.001\nsteps: 5\nname: base\n")
    cfg = load_config(Demo, [cfg_file], ["steps=7", "resume=true", "name=123", "data=null", "stages=[3]"])
    assert cfg == Demo(lr=0.001, steps=7, name="123", resume=True, data=None, stages=[3])


def test_int_is_accepted_for_float_but_not_the_reverse(tmp_path):
    assert load_config(Demo, [], ["lr=1"]).lr == 1.0
    with pytest.raises(ConfigError, match="'steps' must be int"):
        load_config(Demo, [], ["steps=1.5"])


def test_unknown_yaml_key_names_file_line_and_key(tmp_path):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("lr: 0.1\n\nstep: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: unknown config key 'step'"):
        load_config(Demo, [cfg_file])


def test_wrong_type_in_yaml_names_key_and_line(tmp_path):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("name: x\nresume: maybe\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: 'resume' must be bool, got 'maybe'"):
        load_config(Demo, [cfg_file])


def test_unknown_override_and_missing_file():
    with pytest.raises(ConfigError, match="unknown config key 'lrr'"):
        load_config(Demo, [], ["lrr=1"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Demo, ["/nonexistent.yaml"])


def test_cli_exits_with_one_line_message():
    with pytest.raises(SystemExit, match="config error: command line: unknown config key 'nope'"):
        parse_cli(Demo, ["nope=1"])


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(Demo, [], ["lr=3e-4", "data=x.jsonl"])
    save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(Demo, [tmp_path / "run" / "config.yaml"]) == cfg


def test_exponent_without_dot_is_a_float_in_yaml_too(tmp_path):
    cfg_file = tmp_path / "a.yaml"
    cfg_file.write_text("lr: 1e-6\n")
    assert load_config(Demo, [cfg_file]).lr == 1e-6
    with pytest.raises(ConfigError, match="'lr' must be float"):
        load_config(Demo, [], ["lr=fast"])
