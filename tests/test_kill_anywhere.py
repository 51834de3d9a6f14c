"""Kill anywhere: sft.py, train.py and eval.py are SIGKILLed at seeded random moments, at least KILLS times each,
and started again after every kill; each then ends with the metrics, weights and results of a run that never
stopped, with no log line or result lost or duplicated.

Runs start from tests/fork_runner.py (a process that has imported the entry points and forks one child per run),
so a dozen restarts cost no imports. A kill moment is drawn (seeded) as "once the run has set up its folder and the
log has e lines (or e benchmarks are finished), plus a random part of one step's time", e uniform over the run, so
kills land in model loading, in steps, in checkpoint and log writes and in the final save, early and late, however
fast the machine is. Equality is exact: the metrics without their wall-clock fields (perf/*), the
weights bit for bit (resume restores every RNG and the data position; one thread; the scripted policy and
sync_turns make rollouts independent of timing), results.json, and trajectories.jsonl line for line. Rollouts come
from the scripted policy (tests/scripted_policy.py) on the real tiny model; its answers draw on the global torch RNG.
"""
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plumbing.data import write_jsonl
from protocol import TOOL_NAME
from scripted_policy import say_problems
from tiny.model import build_tiny

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
KILLS = 10
SEED = 17


class Runner:
    """Talks to tests/fork_runner.py: start a run, see whether it has ended, SIGKILL it, read its exit code."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fork_runner.py")], cwd=ROOT, env=ENV,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)

    def _line(self) -> str:
        return self.proc.stdout.readline().decode().strip()  # unbuffered: select sees what is not read yet

    def start(self, name: str, args: list[str], output: Path) -> int:
        self.proc.stdin.write((json.dumps([name, args, str(output)]) + "\n").encode())
        return int(self._line().split()[1])

    def ended(self, wait: float) -> bool:
        return bool(select.select([self.proc.stdout], [], [], wait)[0])

    def exit_code(self) -> int:
        return int(self._line().split()[1])

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def runner():
    r = Runner()
    yield r
    r.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    build_tiny(root / "base", hidden=32, layers=2, heads=2, max_positions=512)
    write_jsonl(root / "say.jsonl", say_problems(6))
    for b in range(5):  # evaluation: 5 benchmarks of 6 problems
        write_jsonl(root / f"bench{b}.jsonl", say_problems(6, start=10 * b + 1))
    rows = []
    for a in range(12, 24):  # SFT: 12 short tool conversations
        rows.append({"messages": [
            {"role": "user", "content": f"Say {a}."},
            {"role": "assistant", "content": "Use Python.</reason>\n", "tool_calls": [
                {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": f"print({a})"}}}]},
            {"role": "tool", "content": str(a)},
            {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{a}}}</answer>"}]})
    write_jsonl(root / "sft.jsonl", rows)
    return root


def written(path: Path) -> int:
    return path.stat().st_mtime_ns if path.is_file() else 0


def kill_and_restart(runner, name, args, out: Path, events, total: int, unit_s: float) -> list[int]:
    """SIGKILL the run at KILLS seeded random moments in order, starting it again after each, then run it to the end.
    A moment is "once the run has written its config.yaml (its checks passed, the folder set for it) and `events`
    (log lines, finished benchmarks) reach e, plus a random part of one event's time unit_s", e uniform over the
    run; two more come after the last event (the final save) and may miss. Returns the events at each kill."""
    rng = random.Random(SEED)
    moments = sorted(rng.randrange(total) for _ in range(KILLS)) + [total, total]
    landed = []
    for attempt, at in enumerate(moments):
        extra, config = rng.uniform(0.0, unit_s), written(out / "config.yaml")
        pid = runner.start(name, args, out.with_name(f"{out.name}-attempt{attempt}.txt"))
        while (written(out / "config.yaml") == config or events(out) < at) and not runner.ended(0.005):
            pass
        if not runner.ended(extra):
            landed.append(events(out))
            os.kill(pid, signal.SIGKILL)
        assert runner.exit_code() in (0, -signal.SIGKILL)
    assert len(landed) >= KILLS, f"only {len(landed)} kills landed: the runs end too fast"
    output = out.with_name(f"{out.name}-final.txt")
    runner.start(name, args, output)
    assert runner.exit_code() == 0, output.read_text()[-3000:]
    return landed


def log_lines(out: Path) -> int:
    """Complete lines of metrics.jsonl (a line being written is not counted yet)."""
    log = out / "metrics.jsonl"
    return log.read_bytes().count(b"\n") if log.is_file() else 0


def metrics(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def assert_same_weights(a: Path, b: Path):
    from transformers import AutoModelForCausalLM
    wa, wb = (AutoModelForCausalLM.from_pretrained(p / "model").state_dict() for p in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def timed(runner, name, args, out, events, total: int) -> float:
    """Run to the end without a kill; returns the seconds from its first event to its last, per event."""
    output, seen = out.with_name(f"{out.name}.txt"), []
    runner.start(name, args, output)
    while not runner.ended(0.005):
        if events(out) > len(seen):
            seen.append(time.perf_counter())
    assert runner.exit_code() == 0, output.read_text()[-3000:]
    assert len(seen) >= 2, "events too close together to time"
    return (seen[-1] - seen[0]) / (len(seen) - 1)


def test_sft_killed_anywhere_ends_as_if_never_stopped(runner, tiny, tmp_path):
    # 12 conversations, micro-batches of 2, 2 per optimizer step: 3 steps per epoch, 4 epochs = 12 steps
    args = [f"model_path={tiny / 'base'}", f"data={tiny / 'sft.jsonl'}", "epochs=4", "lr=3e-3", "batch_size=4",
            "micro_batch_size=2", "log_every=1", "save_every=1", "system_prompt=compact", "user_instruction="]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    unit = timed(runner, "sft", args + [f"out_dir={straight}"], straight, log_lines, 12)
    landed = kill_and_restart(runner, "sft", args + [f"out_dir={killed}"], killed, log_lines, 12, unit)
    print(f"sft: {unit:.2f} s per step; log lines on disk at each kill {landed}")
    assert len(set(landed)) >= 3  # kills landed at several points of the run, not all at one
    assert [r["step"] for r in metrics(killed)] == list(range(1, 13))
    assert metrics(killed) == metrics(straight)
    assert_same_weights(straight, killed)


@pytest.mark.parametrize("weights", ["full", "lora"])
def test_train_killed_anywhere_ends_as_if_never_stopped(runner, tiny, tmp_path, weights):
    """Every weight trained, or a LoRA adapter (its checkpoints hold the adapter alone: plumbing/lora.py)."""
    args = ["configs/tiny/stage1.yaml", f"model_path={tiny / 'base'}", f"data=[{tiny / 'say.jsonl'}]",
            "prompts_per_step=4", "rollouts_per_prompt=8", "group_size=4", "steps=8", "eval_data=null",
            "save_every=1", "max_response_tokens=96", "lr=1e-2", "warmup_steps=2", "torch_threads=1",
            "tool_workers=1", "tool_timeout=30", "sync_turns=true"] + (["lora_rank=4"] if weights == "lora" else [])
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    unit = timed(runner, "train", args + [f"out_dir={straight}"], straight, log_lines, 8)
    landed = kill_and_restart(runner, "train", args + [f"out_dir={killed}"], killed, log_lines, 8, unit)
    print(f"train: {unit:.2f} s per step; log lines on disk at each kill {landed}")
    assert len(set(landed)) >= 3
    assert [r["step"] for r in metrics(killed)] == list(range(1, 9))
    assert metrics(killed) == metrics(straight)
    assert_same_weights(straight, killed)


def test_eval_killed_anywhere_ends_as_if_never_stopped(runner, tiny, tmp_path):
    benches = ",".join(str(tiny / f"bench{b}.jsonl") for b in range(5))
    args = ["configs/tiny/eval.yaml", f"model_path={tiny / 'base'}", f"benchmarks=[{benches}]", "samples=4",
            "max_response_tokens=96", "max_turns=2", "sync_turns=true", "tool_workers=1", "tool_timeout=30"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    def finished(out: Path) -> int:
        results = out / "results.json"
        return len(json.loads(results.read_text())["benchmarks"]) if results.is_file() else 0
    unit = timed(runner, "eval", args + [f"out_dir={straight}"], straight, finished, 5)
    landed = kill_and_restart(runner, "eval", args + [f"out_dir={killed}"], killed, finished, 5, unit)
    print(f"eval: {unit:.2f} s per benchmark; finished benchmarks at each kill {landed}")
    assert len(set(landed)) >= 3
    def untimed(out: Path) -> dict:  # every metric but each benchmark's wall-clock seconds
        results = json.loads((out / "results.json").read_text())["benchmarks"]
        return {name: {k: v for k, v in m.items() if k != "seconds"} for name, m in results.items()}
    assert untimed(killed) == untimed(straight)
    records = [json.loads(x) for x in (killed / "trajectories.jsonl").read_text().splitlines()]
    assert [(r["benchmark"], r["problem_index"], r["sample"]) for r in records] == \
        [(f"bench{b}", i, s) for b in range(5) for i in range(6) for s in range(4)]  # each exactly once, in order
    assert records == [json.loads(x) for x in (straight / "trajectories.jsonl").read_text().splitlines()]
