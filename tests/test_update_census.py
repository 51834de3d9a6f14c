"""A held-out check of the update's plan: train.py under a launcher on CPU processes, skewed rollouts, the default
plan (configs/tiny/rl.yaml's token budget, schedule=balanced), and its lockstep efficiency read from the model's own
forwards alone (bench/update_plan.py's census: every forward under autograd, its token slots, and the sequences in
it whose logits receive gradient), not from the plan's own metric, which it must then match."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))
import update_plan  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return update_plan.prepare(tmp_path_factory.mktemp("census"), prompts=12)


@pytest.mark.parametrize("backend, world", [("ddp", 2), ("fsdp", 3)])
def test_the_default_plan_keeps_the_lockstep_busy_by_the_models_own_forwards(root, backend, world):
    args = SimpleNamespace(steps=3, prompts=12, long=256, short=32, slots=16)
    r = update_plan.run(root, world, backend, "balanced", args)
    assert r["census"] >= 0.85, r
    assert r["census"] == pytest.approx(r["reported"], abs=1e-9), r  # the metric counts what ran
