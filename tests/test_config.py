"""The config helper: defaults, YAML, key=value overrides, and errors that name the key."""
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from plumbing.config import ConfigError, check_ranges, load_config, parse_cli, save_config


@dataclass
class Demo:
    lr: float = 1e-6          # learning rate
    steps: int = 10
    name: str = "run"
    resume: bool = False
    data: str | None = None
    stages: list[int] = field(default_factory=lambda: [1, 2])


@pytest.mark.spec
def test_defaults_yaml_then_overrides(tmp_path):
    cfg_file = tmp_path / "a.yaml"
    cfg_file.write_text("lr: 0.001\nsteps: 5\nname: base\n")
    cfg = load_config(Demo, [cfg_file], ["steps=7", "resume=true", "name=123", "data=null", "stages=[3]"])
    assert cfg == Demo(lr=0.001, steps=7, name="123", resume=True, data=None, stages=[3])


@pytest.mark.spec
def test_int_is_accepted_for_float_but_not_the_reverse(tmp_path):
    assert load_config(Demo, [], ["lr=1"]).lr == 1.0
    with pytest.raises(ConfigError, match="'steps' must be int"):
        load_config(Demo, [], ["steps=1.5"])


@pytest.mark.spec
def test_unknown_yaml_key_names_file_line_and_key(tmp_path):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("lr: 0.1\n\nstep: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3: unknown config key 'step'"):
        load_config(Demo, [cfg_file])


@pytest.mark.spec
def test_wrong_type_in_yaml_names_key_and_line(tmp_path):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("name: x\nresume: maybe\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: 'resume' must be bool, got 'maybe'"):
        load_config(Demo, [cfg_file])


@pytest.mark.spec
def test_unknown_override_and_missing_file():
    with pytest.raises(ConfigError, match="unknown config key 'lrr'"):
        load_config(Demo, [], ["lrr=1"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Demo, ["/nonexistent.yaml"])


@pytest.mark.spec
def test_cli_exits_with_one_line_message():
    with pytest.raises(SystemExit, match="config error: command line: unknown config key 'nope'"):
        parse_cli(Demo, ["nope=1"])


@pytest.mark.spec
def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(Demo, [], ["lr=3e-4", "data=x.jsonl"])
    save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(Demo, [tmp_path / "run" / "config.yaml"]) == cfg


@pytest.mark.spec
def test_exponent_without_dot_is_a_float_in_yaml_too(tmp_path):
    cfg_file = tmp_path / "a.yaml"
    cfg_file.write_text("lr: 1e-6\n")
    assert load_config(Demo, [cfg_file]).lr == 1e-6
    with pytest.raises(ConfigError, match="'lr' must be float"):
        load_config(Demo, [], ["lr=fast"])


@pytest.mark.spec
def test_base_files_are_read_first_and_errors_name_the_file_that_holds_the_key(tmp_path):
    (tmp_path / "common.yaml").write_text("lr: 0.5\nsteps: 3\n")
    (tmp_path / "stage.yaml").write_text("base: common.yaml\nsteps: 9\n")
    assert load_config(Demo, [tmp_path / "stage.yaml"]) == Demo(lr=0.5, steps=9)
    (tmp_path / "common.yaml").write_text("lr: 0.5\nstepz: 3\n")
    with pytest.raises(ConfigError, match=r"common.yaml:2: unknown config key 'stepz'"):
        load_config(Demo, [tmp_path / "stage.yaml"])
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(Demo, [tmp_path / "loop.yaml"])


@pytest.mark.spec
def test_tiny_stage_configs_hold_only_what_differs_from_their_base():
    """configs/tiny/stage{1,2,3}.yaml resolve through rl.yaml to the stage's full config, and repeat no value of it."""
    import yaml
    from train import TrainConfig
    root = Path(__file__).resolve().parents[1] / "configs" / "tiny"
    base = yaml.safe_load((root / "rl.yaml").read_text())
    stages = {1: (15, 64, 2e-4, 320, 4), 2: (12, 16, 1e-4, 448, 4), 3: (8, 16, 1e-4, 448, 6)}
    for stage, (steps, prompts, lr, budget, turns) in stages.items():
        own = yaml.safe_load((root / f"stage{stage}.yaml").read_text())
        assert own.pop("base") == "rl.yaml"
        assert all(own[key] != base[key] for key in set(own) & set(base))  # a key of the base only to change it
        cfg = load_config(TrainConfig, [root / f"stage{stage}.yaml"])
        assert (cfg.stage, cfg.steps, cfg.max_response_tokens, cfg.max_turns) == (stage, steps, budget, turns)
        assert (cfg.prompts_per_step, cfg.lr) == (prompts, lr)
        assert (cfg.group_size, cfg.rollouts_per_prompt, cfg.torch_threads) == (4, 8, 1)


@pytest.mark.spec
def test_non_utf8_yaml_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8"):
        load_config(Demo, [bad])


@pytest.mark.parametrize("entry", ["train", "sft", "eval"])
def test_help_lists_every_field_with_type_default_and_comment(entry):
    import dataclasses
    import importlib
    import subprocess
    import sys
    module = importlib.import_module(entry)
    cls = {"train": "TrainConfig", "sft": "SFTConfig", "eval": "EvalConfig"}[entry]
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, f"{entry}.py", "--help"], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for f in dataclasses.fields(getattr(module, cls)):
        assert f"\n  {f.name} (" in out.stdout, f.name
    assert "lr (float, default " in out.stdout if entry != "eval" else "samples (int, default 16, >= 1)" in out.stdout


def test_help_shows_each_field_s_whole_comment_and_its_range():
    """A comment continued on the lines under its field is shown whole, on the field's entry; each numeric field
    shows its allowed values (RANGES)."""
    from plumbing.config import field_help
    from plumbing.train_config import RANGES, TrainConfig
    shown = field_help(TrainConfig)
    by_name, name = {}, None
    for line in shown.splitlines():
        if line.startswith("      "):  # a field's comment, on the line under it
            by_name[name] = (by_name[name][0], line.strip())
        elif line.startswith("  "):
            name = line.split(" (")[0].strip()
            by_name[name] = (line.strip(), "")
    assert by_name["fsdp"][1] == ("for dry_run only: the launch shards with FSDP2 (false: python train.py on one GPU, "
                                  "or a DDP launch)")
    assert by_name["max_tokens_per_micro_batch"][1].endswith("0: micro-batches of micro_batch_size rollouts, padded")
    assert by_name["mismatch_seq_low"][1].endswith("pi_old / pi_sampler is below this is dropped (verl's geometric "
                                                   "preset)")
    assert by_name["mismatch_seq_low"][0] == "mismatch_seq_low (float, default 0.999, > 0 and <= 1)"
    assert by_name["lr"][0] == "lr (float, default 1e-06, > 0)"
    assert all(f"{name} (" in by_name[name][0] and RANGES[name] in by_name[name][0] for name in RANGES)
    assert by_name["model_path"][0] == "model_path (str, default '')"  # no range: text


@pytest.mark.parametrize("entry", ["tiny.pipeline", "tiny.ablation"])
def test_argparse_entry_points_answer_help(entry):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", entry, "--help"], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr


# ----------------------------------------------------------------------------------- numeric ranges
@pytest.mark.spec
def test_check_ranges_names_the_key_the_rule_and_the_value():
    cfg = Demo(lr=float("nan"), steps=-5)
    assert check_ranges(cfg, {"lr": "> 0", "steps": ">= 1", "data": ">= 0"}) == [
        "lr must be a finite number > 0, got nan", "steps must be an integer >= 1, got -5"]  # None passes
    assert check_ranges(Demo(lr=float("inf")), {"lr": "> 0"}) == ["lr must be a finite number > 0, got inf"]
    assert check_ranges(Demo(lr=1.0), {"lr": ">= 0 and < 1"}) == ["lr must be a finite number >= 0 and < 1, got 1.0"]
    assert check_ranges(Demo(lr=0.5, steps=1), {"lr": ">= 0 and < 1", "steps": ">= 1"}) == []


ENTRY_CLASSES = {"train": "TrainConfig", "sft": "SFTConfig", "eval": "EvalConfig"}
# where each entry's config lives
CONFIG_MODULES = {"train": "plumbing.train_config", "sft": "plumbing.sft_config", "eval": "plumbing.eval_config"}
UNCHECKED = {"stage"}  # TrainConfig.stage is a label in the log, any integer will do


@pytest.mark.spec
@pytest.mark.parametrize("entry", sorted(ENTRY_CLASSES))
def test_every_numeric_field_has_a_range_and_the_shipped_configs_are_in_it(entry):
    import dataclasses
    import importlib
    import typing
    module = importlib.import_module(CONFIG_MODULES[entry])
    cls = getattr(module, ENTRY_CLASSES[entry])
    hints = typing.get_type_hints(cls)
    numeric = {f.name for f in dataclasses.fields(cls)
               if {int, float} & {hints[f.name], *typing.get_args(hints[f.name])}}
    assert set(module.RANGES) == numeric - UNCHECKED
    assert check_ranges(cls(), module.RANGES) == []
    root = Path(__file__).resolve().parents[1]
    name = {"train": "stage*", "sft": "sft", "eval": "eval"}[entry]
    shipped = sorted(root.glob(f"configs/*/{name}.yaml"))
    assert len(shipped) >= 2
    for path in shipped:
        assert check_ranges(load_config(cls, [path]), module.RANGES) == [], path


@pytest.mark.spec
def test_validate_warns_once_that_the_clip_cannot_bind_with_one_update(capsys, monkeypatch):
    from plumbing.train_config import TrainConfig, validate
    monkeypatch.delenv("RANK", raising=False)
    validate(TrainConfig(data=["x.jsonl"], prompts_per_step=4, updates_per_step=1, dual_clip=3.0), 1)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config warning: updates_per_step=1: ")
    assert "clip_low=0.2, clip_high=0.28, dual_clip=3.0 never bind" in err
    validate(TrainConfig(data=["x.jsonl"], prompts_per_step=4, updates_per_step=2), 1)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "1")  # the other processes of a launch stay quiet
    validate(TrainConfig(data=["x.jsonl"], prompts_per_step=4), 1)
    assert capsys.readouterr().err == ""


@pytest.mark.spec
@pytest.mark.parametrize("entry, override, message", [
    ("train", "lr=nan", "lr must be a finite number > 0, got nan"),
    ("train", "lr=-1", "lr must be a finite number > 0, got -1.0"),
    ("train", "steps=-5", "steps must be an integer >= 1, got -5"),
    ("train", "temperature=0", "temperature must be a finite number > 0, got 0.0"),
    ("train", "save_every=0", "save_every must be an integer >= 1, got 0"),
    ("train", "log_every=0", "log_every must be an integer >= 1, got 0"),
    ("train", "micro_batch_size=0", "micro_batch_size must be an integer >= 1, got 0"),
    ("train", "updates_per_step=0", "updates_per_step must be an integer >= 1, got 0"),
    ("train", "updates_per_step=17", "updates_per_step=17 exceeds the 16 kept rollouts of a step"),
    ("train", "dual_clip=1.0", "dual_clip must be a finite number > 1, got 1.0"),
    ("train", "top_p=1.5", "top_p must be a finite number > 0 and <= 1, got 1.5"),
    ("train", "schedule=fast", "schedule must be one of ['balanced', 'static'], got 'fast'"),
    ("train", "claim_rule=kv", "claim_rule must be one of ['free_kv', 'count'], got 'kv'"),
    ("sft", "lr=nan", "lr must be a finite number > 0, got nan"),
    ("sft", "log_every=0", "log_every must be an integer >= 1, got 0"),
    ("sft", "micro_batch_size=0", "micro_batch_size must be an integer >= 1, got 0"),
    ("sft", "warmup_ratio=2", "warmup_ratio must be a finite number >= 0 and <= 1, got 2.0"),
    ("sft", "max_steps=0", "max_steps must be an integer >= 1, got 0"),
    ("eval", "samples=0", "samples must be an integer >= 1, got 0"),
    ("eval", "temperature=-1", "temperature must be a finite number >= 0, got -1.0"),
    ("eval", "batch_size=0", "batch_size must be an integer >= 1, got 0"),
])
def test_entry_points_refuse_out_of_range_values_before_any_work(tmp_path, entry, override, message):
    """The checks come before any file is read or written (the tiny configs name models and data that need not
    exist here)."""
    import eval as ev
    import sft
    import train
    out = tmp_path / "out"
    args = {"train": ["configs/tiny/stage1.yaml", "prompts_per_step=4", "micro_batch_size=2"],
            "sft": ["configs/tiny/sft.yaml"], "eval": ["configs/tiny/eval.yaml"]}[entry] + [override, f"out_dir={out}"]
    root = Path(__file__).resolve().parents[1]
    args[0] = str(root / args[0])
    run = {"train": train.main, "eval": ev.main,
           "sft": lambda argv: sft.train(parse_cli(sft.SFTConfig, argv))}[entry]
    with pytest.raises(SystemExit) as e:
        run(args)
    assert str(e.value).startswith("config error: ") and message in str(e.value)
    assert not out.exists()
