"""Bad input through the real entry points (train.py, sft.py, eval.py): one line naming the file, line or key,
never a traceback from deep inside a library."""
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import eval as ev
import sft
import train
from plumbing.config import parse_cli
from plumbing.data import write_jsonl
from scripted_policy import say_problems
from tiny.model import build_tiny

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "say.jsonl", say_problems(4))
    write_jsonl(root / "sft.jsonl", [{"messages": [{"role": "user", "content": "Say 1."},
                                                   {"role": "assistant", "content": "</reason>\n1"}]}])
    return root


def run_entry(entry: str, tiny: Path, out: Path, *extra: str):
    """Run an entry point as the command line would, on the tiny model; returns the SystemExit it raised."""
    base = {"train": [str(ROOT / "configs/tiny/stage1.yaml"), f"data=[{tiny / 'say.jsonl'}]", "eval_data=null"],
            "sft": [str(ROOT / "configs/tiny/sft.yaml"), f"data={tiny / 'sft.jsonl'}"],
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


class _NoSuchRepository(http.server.BaseHTTPRequestHandler):
    """A hub that has no repositories: every request gets the 404 the Hugging Face hub sends for an unknown one."""

    def _missing(self):
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _missing

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def empty_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepository)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("entry, hub", [("train", "unreachable")] + [(e, "no such repository")
                                                                     for e in ("train", "sft", "eval")])
def test_a_mistyped_model_path_in_a_fresh_checkout_is_one_line(tiny, tmp_path, empty_hub, entry, hub):
    """`model_path=runs/sft_typo` before any runs/ folder exists is taken for a hub id; whatever the hub answers (no
    connection, no such repository), the run ends in one line naming the folder and the hub repository looked for
    (before: an OSError traceback from deep inside from_pretrained). The three entry points share the loader
    (data.load_pretrained); the unreachable hub, which huggingface_hub retries for about 50 s, is tried on one."""
    endpoint = "http://127.0.0.1:9" if hub == "unreachable" else empty_hub  # port 9: nothing listens
    config = {"train": "stage1.yaml", "sft": "sft.yaml", "eval": "eval.yaml"}[entry]
    conversation = [{"role": "user", "content": "Say 1."}, {"role": "assistant", "content": "</reason>\n1"}]
    (tmp_path / "sft.jsonl").write_text(json.dumps({"messages": conversation}) + "\n")
    data = {"train": f"data=[{tiny / 'say.jsonl'}]", "sft": f"data={tmp_path / 'sft.jsonl'}",
            "eval": f"benchmarks=[{tiny / 'say.jsonl'}]"}[entry]
    env = {**os.environ, "HF_ENDPOINT": endpoint, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run([sys.executable, str(ROOT / f"{entry}.py"), str(ROOT / "configs" / "tiny" / config),
                           "model_path=runs/sft_typo", data, f"out_dir={tmp_path / 'out'}", "eval_data=null"
                           if entry == "train" else "seed=0"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert f"model_path 'runs/sft_typo': AutoTokenizer could not load it (looked in no folder " \
           f"{tmp_path / 'runs' / 'sft_typo'}, then the hub repository 'runs/sft_typo' at {endpoint})" in line, line


@pytest.mark.parametrize("entry", ["train", "sft", "eval"])
def test_a_model_folder_without_weights_or_tokenizer_is_one_line(tiny, tmp_path, entry):
    """An incomplete folder: config.json and no weights, or weights and no tokenizer (from which transformers builds
    an empty tokenizer that encodes every text to no tokens), refused before any work; a tokenizer file that cannot
    be read is named with the loader's own words."""
    import shutil
    folder = tmp_path / "partial"
    folder.mkdir()
    shutil.copy(tiny / "base" / "config.json", folder)
    message = run_entry(entry, tiny, tmp_path / "out", f"model_path={folder}")
    assert "is not a whole model folder: config.json but no weights" in message and "\n" not in message
    shutil.copy(tiny / "base" / "model.safetensors", folder)
    message = run_entry(entry, tiny, tmp_path / "out", f"model_path={folder}")
    assert "is not a whole model folder: no tokenizer" in message and "\n" not in message, message
    (folder / "tokenizer.json").write_text("{ not json")
    message = run_entry(entry, tiny, tmp_path / "out", f"model_path={folder}")
    assert message.startswith(("input error: ", "sft: ")) and "\n" not in message, message
    assert f"AutoTokenizer could not load it (looked in the folder {folder})" in message, message
