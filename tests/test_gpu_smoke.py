"""bench/gpu_smoke.py cannot rot: its CPU version (--tiny) runs the whole check in CI, and its verdict fails on a
non-finite loss. The GPU version is the same script without --tiny; the last test runs it where a GPU is present."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_smoke  # noqa: E402


def test_the_cpu_version_runs_train_py_steps_under_fsdp_and_passes(tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--tiny", "--keep", str(tmp_path)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("gpu smoke: PASS")
    assert "passed at the start and after each of the 2 steps" in done.stdout
    assert "code tool        print(sum(range(10))) -> 45" in done.stdout
    assert (tmp_path / "run" / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()  # FSDP2 ran (sharded checkpoint)
    steps = json.loads((tmp_path / "run" / "smoke.json").read_text())["steps"]
    assert len(steps) == 2 and all(s["update_tokens"] > 0 and s["rollout_tokens"] > 0 for s in steps)


def test_the_verdict_fails_on_a_non_finite_loss(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    step = {"rollout_s": 1.0, "rollout_tokens": 10, "rollout_peak_gb": None, "update_s": 1.0, "update_tokens": 50,
            "longest": 25, "update_peak_gb": None}
    (run / "smoke.json").write_text(json.dumps({"steps": [step, step], "gpu": "cpu"}))
    rows = [{"step": 1, "loss/policy": 0.0, "loss/grad_norm": 1.0, "perf/step_s": 2.0},
            {"step": 2, "loss/policy": float("nan"), "loss/grad_norm": 1.0, "perf/step_s": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="FAIL: step 2: non-finite loss or gradient norm"):
        gpu_smoke.report(tmp_path, gpu_smoke.TINY_CONFIG, gpu_smoke.SIZES["tiny"], False, "tool ok", 1.0)
    assert "gpu smoke: PASS" not in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the smoke check at Qwen3-0.6B's shape "
                    "(bf16, FSDP2 on one GPU, CUDA memory figures) runs only there")
def test_the_gpu_version_passes_within_its_time_limit():
    done = subprocess.run([sys.executable, "bench/gpu_smoke.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=gpu_smoke.TIME_LIMIT_S + 60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("gpu smoke: PASS")
