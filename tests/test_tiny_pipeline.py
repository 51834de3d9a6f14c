"""CI's short version of `make tiny`: every entry point for a few steps, on the real tiny model and task.

The learning claim itself (RL gains over SFT) needs the full run (README: Results); policy change under the RL update
is asserted by tests/test_train.py on scripted rollouts, since a few-step SFT model rarely answers correctly."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_pipeline_runs_every_stage_and_writes_the_summary(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "tiny_pipeline.py", "--quick", "--root", str(tmp_path / "tiny")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    for stage in ("sft", "stage1", "stage2", "stage3"):
        assert 0.0 <= summary[f"{stage}_accuracy"] <= 1.0
        assert stage in summary["tool_error_rate_in_correct"] and summary["mean_response_tokens"][stage] > 0
    assert summary["wall_seconds"] > 0 and (tmp_path / "tiny" / "summary.png").stat().st_size > 1000
    for stage in ("stage1", "stage2", "stage3"):
        rows = [json.loads(x) for x in (tmp_path / "tiny" / stage / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)  # reward computed
        assert (tmp_path / "tiny" / stage / "model" / "config.json").is_file()
    sft_rows = (tmp_path / "tiny" / "sft" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(sft_rows[-1])["sft/loss"] < json.loads(sft_rows[0])["sft/loss"]  # SFT learned something
    assert "sft -> stage3" in done.stdout
    # The time table: every command with its wall and CPU seconds, the parts its entry point logged, and each
    # stage's evaluation started before the next stage (it runs beside it).
    phases = summary["phases"]
    assert set(phases) == {"model", "task", "sft", "eval_sft", "stage1", "eval_stage1", "stage2", "eval_stage2",
                           "unsolved_stage2", "stage3", "eval_stage3"}
    assert all(p["wall_s"] > 0 and p["cpu_s"] > 0 for p in phases.values())
    assert phases["sft"]["parts"]["training"] > 0
    assert all(phases[s]["parts"]["rollout"] > 0 and phases[s]["parts"]["update"] > 0 for s in ("stage1", "stage2"))
    assert phases["eval_stage3"]["parts"]["rollouts_and_scoring"] > 0
    for before, stage in (("sft", "stage1"), ("stage1", "stage2"), ("stage2", "stage3")):
        assert phases[f"eval_{before}"]["beside_next"] and phases[f"eval_{before}"]["start_s"] <= phases[stage]["start_s"]
    assert "where the time went" in done.stdout
