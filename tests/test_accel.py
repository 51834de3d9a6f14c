"""plumbing/accel.py, the Accelerator both entry points build: the process group's timeout reaches the group, the prepared
model's FSDP2 policy reduces gradients in fp32 (over gloo on 2 CPU processes, with tests/cpu_fsdp.py), and a
configured tracker that cannot start stops the run with one line before any work."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plumbing import accel
import sft
import train
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "run_accel.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def launch(config: str, mode: str, out: Path, port: int, extra_env: dict | None = None, mixed: str = "bf16"):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / config),
               "--num_processes", "2", "--mixed_precision", mixed, "--main_process_port", str(port)]
    if extra_env:
        command.append(str(ROOT / "tests" / "cpu_fsdp.py"))
    done = subprocess.run(command + [str(SCRIPT), mode, str(out)], cwd=ROOT, env={**ENV, **(extra_env or {})},
                          capture_output=True, text=True, timeout=300)
    return done, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1) if (out / f"rank{r}.json").exists()]


def test_the_prepared_model_gathers_in_bf16_and_reduces_gradients_in_fp32(tmp_path):
    done, ranks = launch("configs/accelerate/fsdp_1node_8gpu.yaml", "policy", tmp_path, free_port(), {"CPU_FSDP": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in ranks:
        assert rank["distributed_type"] == "DistributedType.FSDP"
        assert {"model.layers.0", "model.layers.1", "lm_head"} <= set(rank["policy"])  # each its own FSDP2 group
        assert set(map(tuple, rank["policy"].values())) == {("torch.bfloat16", "torch.float32")}
        assert rank["params"] == rank["grads"] == ["torch.float32"]  # fp32 masters and their sharded gradients


def test_accelerate_s_own_policy_would_reduce_in_bf16(tmp_path):
    """The contrast: the Accelerator train.py and sft.py built before plumbing/accel.py (Accelerate's policy from
    mixed_precision=bf16) reduce-scatters gradients in bf16."""
    done, ranks = launch("configs/accelerate/fsdp_1node_8gpu.yaml", "default-policy", tmp_path, free_port(),
                         {"CPU_FSDP": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert {tuple(v) for r in ranks for v in r["policy"].values()} == {("torch.bfloat16", "torch.bfloat16")}


def test_a_no_grad_forward_leaves_the_output_group_gathered_and_reshard_frees_it(tmp_path):
    """Accelerate shards the final norm and lm_head (tied: with the embedding) with reshard_after_forward=False, so a
    no-grad forward (handoff.verify_handoff's) leaves them gathered in bf16 on every rank, unsharded size; the backward
    frees them, and so does accel.reshard, after which a forward gathers them again and gives the same logits."""
    done, ranks = launch("configs/accelerate/fsdp_1node_8gpu.yaml", "reshard", tmp_path, free_port(), {"CPU_FSDP": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(ranks) == 2
    from tiny.model import build_tokenizer
    vocab = len(build_tokenizer())  # 118
    for rank in ranks:
        # the whole tensors in bf16 (2 bytes), not a shard: vocab x 32 embedding, 64 x 32 lm_head, norm of 32
        assert rank["tied"]["after_forward"] == {"model.embed_tokens.weight": vocab * 32 * 2, "model.norm.weight": 64}
        assert rank["untied"]["after_forward"] == {"lm_head.weight": 64 * 32 * 2, "model.norm.weight": 64}
        for model in ("tied", "untied"):
            seen = rank[model]
            assert seen["after_reshard"] == seen["after_second_reshard"] == seen["after_backward"] == {}
            assert seen["same_logits"] and seen["grads"] > 0


def test_reshard_and_gathered_parameters_do_nothing_without_fsdp():
    import torch
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    accel.reshard(model)
    assert accel.gathered_parameters(model) == {} and torch.equal(model.weight, before)


def test_the_timeout_reaches_the_process_group(tmp_path):
    """timeout_s=3: rank 0 gives up on a collective rank 1 joins 12 s late, after about 3 s, with gloo's timeout."""
    done, ranks = launch("configs/accelerate/cpu_2proc.yaml", "timeout", tmp_path, free_port(), mixed="no")
    assert ranks, done.stderr[-3000:]
    first = ranks[0]
    assert first["error"] is not None and "timed out" in first["error"].lower(), first
    assert 2.5 < first["waited_s"] < 10


def captured(monkeypatch) -> dict:
    """Replace accel.make_accelerator by a recorder that stops the caller (nothing after it runs)."""
    seen = {}

    def record(**kwargs):
        seen.update(kwargs)
        raise SystemExit("captured")

    monkeypatch.setattr(accel, "make_accelerator", record)
    return seen


def test_train_and_sft_build_their_accelerator_with_the_config_s_fields(monkeypatch):
    seen = captured(monkeypatch)
    with pytest.raises(SystemExit, match="captured"):
        train.main(["configs/tiny/stage1.yaml", "process_group_timeout_s=123", "mixed_precision=bf16",
                    "init_timeout_s=45"])
    assert seen == {"mixed_precision": "bf16", "report_to": None, "out_dir": "runs/tiny/stage1", "timeout_s": 123.0,
                    "init_timeout_s": 45.0}
    assert train.TrainConfig().process_group_timeout_s == sft.SFTConfig().process_group_timeout_s == 1800
    seen.clear()
    with pytest.raises(SystemExit, match="captured"):
        sft.make_accelerator(sft.SFTConfig(process_group_timeout_s=45.0, report_to="tensorboard", out_dir="o"))
    assert seen == {"mixed_precision": "no", "report_to": "tensorboard", "out_dir": "o", "timeout_s": 45.0,
                    "init_timeout_s": 600}


@pytest.mark.parametrize("given, expected", [
    ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}),
])
def test_train_s_set_up_sets_expandable_segments_before_cuda_unless_the_user_set_the_allocator(monkeypatch, given,
                                                                                               expected):
    """rl_stage.setup: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is in the environment before the
    Accelerator (the first to touch CUDA) is built, unless an allocator setting is given, which stays as it is."""
    for name in accel.ALLOC_CONF_NAMES:  # unset, and unset again afterwards (what the set-up sets included)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    at_accelerator = {}

    def record(**kwargs):
        at_accelerator.update({n: os.environ[n] for n in accel.ALLOC_CONF_NAMES if n in os.environ})
        raise SystemExit("captured")
    monkeypatch.setattr(accel, "make_accelerator", record)
    with pytest.raises(SystemExit, match="captured"):
        train.main(["configs/tiny/stage1.yaml"])
    assert at_accelerator == expected


@pytest.fixture
def no_trackers(monkeypatch):
    import accelerate.tracking
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])


def test_a_tracker_that_is_not_installed_stops_the_run_in_one_line(no_trackers):
    with pytest.raises(SystemExit, match=r"^config error: report_to=tensorboard but its package is not installed "
                                         r"\(pip install -e '\.\[tensorboard\]', or report_to=null"):
        accel.check_tracker("tensorboard")
    with pytest.raises(SystemExit, match=r"report_to='tensorbord' is not a tracker Accelerate knows \(.*tensorboard"):
        accel.check_tracker("tensorbord")
    accel.check_tracker(None)  # no tracker: nothing to check


def test_train_py_stops_before_any_work_when_its_tracker_cannot_start(no_trackers, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="report_to=tensorboard but its package is not installed"):
        train.main(["configs/tiny/stage1.yaml", f"out_dir={out}", "report_to=tensorboard"])
    assert not out.exists()  # nothing written, no model loaded


def test_sft_py_stops_before_any_work_when_its_tracker_cannot_start(no_trackers, tmp_path):
    from tiny.model import build_tiny
    from tiny.task import write_task
    data = write_task(tmp_path / "data", n_train=2, n_test=1, n_sft=2, workers=1)["sft"]
    model = build_tiny(tmp_path / "model", hidden=16, layers=1, heads=2)
    cfg = sft.SFTConfig(model_path=str(model), data=str(data), out_dir=str(tmp_path / "run"), report_to="tensorboard")
    with pytest.raises(SystemExit, match="report_to=tensorboard but its package is not installed"):
        sft.train(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
