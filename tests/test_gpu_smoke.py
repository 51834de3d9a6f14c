"""bench/gpu_smoke.py cannot rot: its CPU version (--cpu) runs the same three entry points in CI (sft.py, train.py,
eval.py under FSDP2 in bf16 with the real vocabulary), its verdict fails on what it must, its FLOP count is checked
by hand, and what it needs on a machine without network is found or named in one line. The GPU version is the same
script without --cpu; the last test runs it where a GPU is present."""
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


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory, qwen_tokenizer_dir):
    work = tmp_path_factory.mktemp("smoke")
    done = subprocess.run([sys.executable, "bench/gpu_smoke.py", "--cpu", "--keep", str(work)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=400)
    return work, done


def test_the_cpu_version_runs_sft_train_and_eval_under_fsdp2_in_bf16_and_passes(cpu_run):
    work, done = cpu_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert out.strip().endswith("gpu smoke: PASS")
    assert "vocabulary 151,936 (Qwen3-Base's tokenizer), bf16 compute with fp32 masters" in out
    for phase in ("sft      2 steps of 2 conversations", "rollout  2 steps of 2 x 4", "update   later steps",
                  "eval     4 rollouts (HFSampler)"):
        assert phase in out, phase
    assert "parameters gathered in torch.bfloat16, gradients reduced in torch.float32" in out
    assert "hand-off passed at the start and after each of the 2 steps" in out
    assert "tool     print(sum(range(10))) -> 45 in" in out  # the code tool's sandbox works where it runs
    assert (work / "sft" / "model" / "config.json").is_file()
    assert (work / "rl" / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()  # FSDP2 ran (sharded checkpoint)
    assert json.loads((work / "eval" / "results.json").read_text())["benchmarks"]
    steps = json.loads((work / "rl" / "smoke_train.json").read_text())["steps"]
    assert len(steps) == 2 and all(s["update_lengths"] and s["rollout_tokens"] > 0 for s in steps)


def fake_run(tmp_path: Path, loss: float = 0.5, reduce: str = "torch.float32") -> Path:
    """The files a --cpu run leaves, with chosen values."""
    for name in ("sft", "rl", "eval"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "sft" / "smoke_sft.json").write_text(json.dumps({"phase": "sft", "seconds": 3.0, "memory": None}))
    rows = [{"step": s, "sft/loss": 1.0, "perf/tokens_per_s": 100.0, "perf/seconds": 1.0} for s in (1, 2)]
    (tmp_path / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step = {"rollout_s": 1.0, "rollout_tokens": 10, "rollout_memory": None, "update_s": 1.0, "update_memory": None,
            "update_lengths": [30, 40], "policy": {"model.layers.0": ["torch.bfloat16", reduce]}}
    (tmp_path / "rl" / "smoke_train.json").write_text(json.dumps({"steps": [step, step]}))
    rows = [{"step": 1, "loss/policy": 0.0, "loss/grad_norm": 1.0}, {"step": 2, "loss/policy": loss,
                                                                     "loss/grad_norm": 1.0}]
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval" / "smoke_eval.json").write_text(json.dumps(
        {"eval_s": 1.0, "eval_tokens": 8, "eval_memory": None, "eval_rollouts": 4, "eval_longest": 90}))
    return tmp_path


@pytest.mark.parametrize("change, message", [
    ({"loss": float("nan")}, "FAIL: rl step 2: non-finite loss or gradient norm"),
    ({"reduce": "torch.bfloat16"}, "FAIL: the prepared model's FSDP2 policy reduces in ['torch.bfloat16'], not "
                                   "torch.float32"),
])
def test_the_verdict_fails_on_a_non_finite_loss_or_a_bf16_reduction(tmp_path, capsys, change, message):
    work = fake_run(tmp_path, **change)
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        gpu_smoke.report(work, "cpu", gpu_smoke.SIZES["cpu"], [100, 120], 1.0)
    assert "gpu smoke: PASS" not in capsys.readouterr().out
    gpu_smoke.report(fake_run(tmp_path / "good"), "cpu", gpu_smoke.SIZES["cpu"], [100, 120], 1.0)
    assert capsys.readouterr().out.strip().endswith("gpu smoke: PASS")


def test_model_flops_of_qwen3_0_6b_by_hand():
    """6 N T + 12 L H Q T^2 (PaLM, appendix B), N the matrix products' parameters: 28 layers of q, k, v, o
    (1,024 x 2,048 + 2 x 1,024 x 1,024 + 2,048 x 1,024) and the MLP (3 x 1,024 x 3,072), plus the output layer."""
    shape = gpu_smoke.shape_of("qwen3-0.6b")
    n = 28 * (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072) + 151_936 * 1024
    assert n == 595_984_384
    assert gpu_smoke.model_flops(shape, [1000, 10]) == pytest.approx(
        6 * n * 1010 + 12 * 28 * 16 * 128 * (1000 ** 2 + 10 ** 2))


def test_math_verify_comes_from_the_carried_wheels_or_one_line_says_how(tmp_path, monkeypatch):
    """On a machine without math-verify the check installs the wheels found in .cache/wheels/ into its work folder
    (here: a stand-in package built offline); with none there it stops with one line naming make smoke-wheels."""
    real_find = gpu_smoke.importlib.util.find_spec
    monkeypatch.setattr(gpu_smoke.importlib.util, "find_spec",
                        lambda name, *a: None if name == "math_verify" else real_find(name, *a))
    monkeypatch.setattr(gpu_smoke, "WHEELS", tmp_path / "none")
    with pytest.raises(SystemExit, match=r"math-verify is not installed and .*none has no wheels of it .*"
                                         r"run `make smoke-wheels` where there is network"):
        gpu_smoke.ensure_math_verify(tmp_path / "work")
    source = tmp_path / "src"
    (source / "math_verify").mkdir(parents=True)
    (source / "math_verify" / "__init__.py").write_text("CARRIED = True\n")
    (source / "pyproject.toml").write_text('[project]\nname = "math-verify"\nversion = "0.0.1"\n'
                                           '[tool.setuptools]\npackages = ["math_verify"]\n')
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    monkeypatch.setattr(gpu_smoke, "WHEELS", wheels)
    monkeypatch.setattr(sys, "path", list(sys.path))
    site = gpu_smoke.ensure_math_verify(tmp_path / "work")
    assert (Path(site) / "math_verify" / "__init__.py").read_text() == "CARRIED = True\n" and sys.path[0] == site


def test_missing_ranks_without_network_stop_with_one_line(tmp_path, monkeypatch):
    import qwen_vocab

    def offline():
        raise SystemExit("qwen_vocab: `pip download --no-deps qwen-agent==0.0.34` failed")

    monkeypatch.setattr(qwen_vocab, "RANKS_FILE", tmp_path / "qwen.tiktoken")
    monkeypatch.setattr(qwen_vocab, "fetch_ranks", offline)
    with pytest.raises(SystemExit, match=r"no Qwen ranks at .*qwen.tiktoken and fetching them failed .*bring "
                                         r"\.cache/qwen/ along"):
        gpu_smoke.ensure_ranks()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the check at Qwen3-0.6B's shape (bf16, "
                    "FSDP2 on one GPU, CUDA memory figures) runs only there")
def test_the_gpu_version_passes_within_its_time_limit():
    done = subprocess.run([sys.executable, "bench/gpu_smoke.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=gpu_smoke.TIME_LIMIT_S["gpu"] + 60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("gpu smoke: PASS")
