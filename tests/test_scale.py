"""Resume claims, proven with separate processes: a run killed with SIGKILL resumes to the same metrics and
weights, and a kill during a checkpoint's write leaves the previous one loadable. One process against many:
tests/test_train_invariance.py."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plumbing.data import write_jsonl
from scripted_policy import say_problems
from tiny.model import build_tiny

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "run_scripted_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "say.jsonl", say_problems(6))  # 6 problems, 4 per step: steps cross epoch boundaries
    return root


def train_args(tiny, out, steps):
    return ["configs/tiny/stage1.yaml", f"model_path={tiny / 'base'}", f"data=[{tiny / 'say.jsonl'}]",
            f"out_dir={out}", "prompts_per_step=4", "rollouts_per_prompt=8", "group_size=4", f"steps={steps}",
            "eval_data=null", "save_every=1", "max_response_tokens=96", "lr=1e-2", "warmup_steps=2",
            "torch_threads=1", "tool_workers=1"]


def metrics(out) -> list[dict]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # timings differ run to run


def weights(out) -> dict:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(Path(out) / "model").state_dict()


def test_sigkill_then_resume_matches_the_uninterrupted_run(tiny, tmp_path):
    env = {**ENV, "SCRIPTED_RNG": "1"}  # the policy's answers come from the global RNG: resume must restore it
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run([sys.executable, str(SCRIPT)] + train_args(tiny, straight, 4), check=True, env=env, cwd=ROOT,
                   capture_output=True)
    proc = subprocess.Popen([sys.executable, str(SCRIPT)] + train_args(tiny, killed, 4), env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not ((killed / "latest").is_file()
                                          and (killed / "latest").read_text().strip() == "checkpoint-2"):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: mid-step 3, maybe mid-checkpoint
    proc.wait()
    assert not (killed / "model").exists()
    resumed = subprocess.run([sys.executable, str(SCRIPT)] + train_args(tiny, killed, 4), env=env, cwd=ROOT,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert metrics(killed) == metrics(straight)
    assert [r["step"] for r in metrics(killed)] == [1, 2, 3, 4]
    w1, w2 = weights(straight), weights(killed)
    for name in w1:
        assert torch.equal(w1[name], w2[name]), name


def test_a_kill_during_the_checkpoint_write_leaves_the_previous_one_loadable(tiny, tmp_path):
    from plumbing.checkpoint import latest_checkpoint
    out = tmp_path / "run"
    subprocess.run([sys.executable, str(SCRIPT)] + train_args(tiny, out, 2), check=True, env=ENV, cwd=ROOT,
                   capture_output=True)
    # What a kill halfway through writing checkpoint-3 leaves: a partial .tmp folder, `latest` untouched.
    partial = out / "checkpoint-3.tmp"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 100)
    assert latest_checkpoint(out).name == "checkpoint-2"
    done = subprocess.run([sys.executable, str(SCRIPT)] + train_args(tiny, out, 3) + ["resume_allow_changes=[steps]"],
                          env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and latest_checkpoint(out).name == "checkpoint-3"
    assert not partial.exists()
