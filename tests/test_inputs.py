"""Bad input through the real entry points (train.py, sft.py, eval.py): one line naming the file, line or key,
never a traceback from deep inside a library."""
import json
from pathlib import Path

import pytest

import eval as ev
import sft
import train
from config import parse_cli
from data import write_jsonl
from scripted_policy import say_problems
from tiny_model import build_tiny

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "say.jsonl", say_problems(4))
    return root


def run_entry(entry: str, tiny: Path, out: Path, *extra: str):
    """Run an entry point as the command line would, on the tiny model; returns the SystemExit it raised."""
    base = {"train": [str(ROOT / "configs/tiny/stage1.yaml"), f"data=[{tiny / 'say.jsonl'}]", "eval_data=null"],
            "sft": [str(ROOT / "configs/tiny/sft.yaml")],
            "eval": [str(ROOT / "configs/tiny/eval.yaml"), f"benchmarks=[{tiny / 'say.jsonl'}]"]}[entry]
    argv = base + [f"model_path={tiny / 'base'}", f"out_dir={out}", *extra]
    main = {"train": train.main, "eval": ev.main, "sft": lambda a: sft.train(parse_cli(sft.SFTConfig, a))}[entry]
    with pytest.raises(SystemExit) as e:
        main(argv)
    return str(e.value)


def test_an_over_long_prompt_names_its_file_and_line(tiny, tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"problem": "Say 1.", "answer": 1}) + "\n\n"
                    + json.dumps({"problem": "Say " + "9" * 300 + ".", "answer": 9}) + "\n")
    message = run_entry("train", tiny, tmp_path / "out", f"data=[{data}]")
    assert message.startswith(f"input error: {data}:3: prompt is ") and "over max_prompt_tokens=256" in message


@pytest.mark.parametrize("entry", ["train", "sft", "eval"])
@pytest.mark.parametrize("raw, words", [
    ('{"problem": "caf\xe9", "answer": "1"}'.encode("latin-1"), "not UTF-8 text"),
    (b"[" * 50_000 + b"]" * 50_000, "JSON nested too deeply"),
])
def test_unreadable_data_is_one_line_naming_file_and_line(tiny, tmp_path, entry, raw, words):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\n" + raw + b"\n")
    key = {"train": f"data=[{data}]", "sft": f"data={data}", "eval": f"benchmarks=[{data}]"}[entry]
    message = run_entry(entry, tiny, tmp_path / "out", key)
    assert f"{data}:2: {words}" in message and "\n" not in message


@pytest.mark.parametrize("entry", ["train", "sft", "eval"])
def test_a_mistyped_local_model_folder_is_named_not_looked_up_on_the_hub(tiny, tmp_path, monkeypatch, entry):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "sft").mkdir(parents=True)
    message = run_entry(entry, tiny, tmp_path / "out", "model_path=runs/sft_typo")
    assert "model_path 'runs/sft_typo' is not a model folder (no such folder in runs/" in message
