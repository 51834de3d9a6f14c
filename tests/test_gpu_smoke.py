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
    assert "skipped  exit_under_async_scheduling: needs a GPU" in out
    assert "flash    skipped: flash attention needs a GPU" in out
    assert (work / "sft" / "model" / "config.json").is_file()
    assert (work / "rl" / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()  # FSDP2 ran (sharded checkpoint)
    assert json.loads((work / "eval" / "results.json").read_text())["benchmarks"]
    steps = json.loads((work / "rl" / "smoke_train.json").read_text())["steps"]
    assert len(steps) == 2 and all(s["update_lengths"] and s["rollout_tokens"] > 0 for s in steps)


def fake_run(tmp_path: Path, loss: float = 0.5, reduce: str = "torch.float32", rl_lr: float = 2.5e-7) -> Path:
    """The files a --cpu run leaves, with chosen values: SFT at peak lr 1e-5 with a 1-step warm-up over 2 steps, RL
    at lr 1e-6 with a 4-step warm-up (step 1 trains at 1e-6 x 1/4)."""
    for name in ("sft", "rl", "eval"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "sft" / "smoke_sft.json").write_text(json.dumps({"phase": "sft", "seconds": 3.0, "memory": None}))
    (tmp_path / "sft" / "config.yaml").write_text("lr: 1.0e-5\nwarmup_ratio: 0.25\ndecay_ratio: 1.0\n")
    (tmp_path / "rl" / "config.yaml").write_text("lr: 1.0e-6\nwarmup_steps: 4\nupdates_per_step: 1\n")
    # each step's own lr: sft.lr_factor(0, 1, 2) = 1 (the warm-up's one step), (1, 1, 2) = 1 (the cosine's start)
    rows = [{"step": s, "sft/loss": 1.0, "perf/tokens_per_s": 100.0, "perf/seconds": 1.0, "sft/lr": lr}
            for s, lr in ((1, 1e-5), (2, 1e-5))]
    (tmp_path / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step = {"rollout_s": 1.0, "rollout_tokens": 10, "rollout_memory": None, "update_s": 1.0, "update_memory": None,
            "update_lengths": [30, 40], "policy": {"model.layers.0": ["torch.bfloat16", reduce]}}
    (tmp_path / "rl" / "smoke_train.json").write_text(json.dumps({"steps": [step, step]}))
    rows = [{"step": 1, "loss/policy": 0.0, "loss/grad_norm": 1.0, "loss/lr": rl_lr},
            {"step": 2, "loss/policy": loss, "loss/grad_norm": 1.0, "loss/lr": 5e-7}]
    (tmp_path / "rl" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval" / "smoke_eval.json").write_text(json.dumps(
        {"eval_s": 1.0, "eval_tokens": 8, "eval_memory": None, "eval_rollouts": 4, "eval_longest": 90}))
    return tmp_path


@pytest.mark.parametrize("change, message", [
    ({"loss": float("nan")}, "FAIL: rl step 2: non-finite loss or gradient norm"),
    ({"rl_lr": 5e-7}, "FAIL: rl .* lr at step 1 is 5e-07, 2x the schedule's 2.5e-07"),
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


def test_the_report_prints_the_logged_lr_beside_both_schedules(tmp_path, capsys):
    gpu_smoke.report(fake_run(tmp_path), "cpu", gpu_smoke.SIZES["cpu"], [100, 120], 1.0)
    out = capsys.readouterr().out
    assert ("lr       sft (peak 1e-05, warm-up 1 of 2 steps): step 1 1e-05 (schedule 1e-05), step 2 1e-05 "
            "(schedule 1e-05): as scheduled") in out
    assert ("lr       rl (lr 1e-06, warm-up 4 steps): step 1 2.5e-07 (schedule 2.5e-07), step 2 5e-07 (schedule "
            "5e-07): as scheduled") in out


def test_the_lr_comparison_by_hand():
    """train.py's warm-up lr * min(1, (t + 1) / W), logged as the lr step s trained with (t = s - 1 optimizer steps
    done before it); a scheduler stepped 8 times per optimizer step (8 ranks, each stepping it) is 4.5x ahead at
    step 2 of a 20-step warm-up."""
    assert [gpu_smoke.rl_schedule(t, 1e-6, 20) for t in (0, 1, 19, 50)] == pytest.approx([5e-8, 1e-7, 1e-6, 1e-6])
    assert gpu_smoke.rl_schedule(0, 1e-6, 0) == 1e-6  # no warm-up
    schedule = lambda t: gpu_smoke.rl_schedule(t, 1e-6, 20)  # noqa: E731
    right = [{"step": s, "loss/lr": schedule(s - 1)} for s in (1, 2, 3)] + [{"step": 4}]
    assert gpu_smoke.lr_comparison(right, "loss/lr", schedule, first=2) == [(1, 5e-8, 5e-8), (2, 1e-7, 1e-7)]
    assert gpu_smoke.lr_comparison(right, "loss/lr", schedule, per_step=2)[1] == (2, 1e-7, 1.5e-7)  # t = 2
    line, problem = gpu_smoke.lr_line("rl", gpu_smoke.lr_comparison(right, "loss/lr", schedule))
    assert problem is None and line == ("lr       rl: step 1 5e-08 (schedule 5e-08), step 2 1e-07 (schedule "
                                        "1e-07), step 3 1.5e-07 (schedule 1.5e-07): as scheduled")
    fast = [{"step": s, "loss/lr": schedule(8 * (s - 1))} for s in (1, 2, 3)]  # 8 scheduler steps per optimizer step
    line, problem = gpu_smoke.lr_line("rl", gpu_smoke.lr_comparison(fast, "loss/lr", schedule))
    assert line.endswith("step 1 5e-08 (schedule 5e-08), step 2 4.5e-07 (schedule 1e-07), step 3 8.5e-07 "
                         "(schedule 1.5e-07): NOT as scheduled")
    assert problem == "rl lr at step 2 is 4.5e-07, 4.5x the schedule's 1e-07"  # the warm-up runs 4.5x too fast
    slow = gpu_smoke.lr_line("sft", [(1, 1e-7, 2e-7)])[1]
    assert slow == "sft lr at step 1 is 1e-07, 0.5x the schedule's 2e-07"
    assert gpu_smoke.lr_line("rl", []) == ("lr       rl: no lr logged", None)
    assert gpu_smoke.lr_line("sft", [(2, 1e-6, 0.0)])[1] == "sft lr at step 2 is 1e-06, the schedule's 0"


@pytest.mark.parametrize("after_main, line, problem", [
    ("", "exit     async scheduling: status 0, ", None),
    ("threading.Thread(target=time.sleep, args=(60,)).start()",
     "exit     async scheduling: still running 2 s after main() returned", "no exit after main() under async scheduling"),
])
def test_the_exit_check_passes_a_prompt_exit_and_fails_a_hang(tmp_path, monkeypatch, after_main, line, problem):
    """The check's verdict, with the engine's script replaced by one without vLLM: ends at once, or hangs in a
    non-daemon thread after main() has returned."""
    monkeypatch.setattr(gpu_smoke, "EXIT_AFTER_MAIN_S", 2)
    monkeypatch.setattr(gpu_smoke, "EXIT_ASYNC", "import threading, time\nfrom plumbing import accel\n"
                        f"accel.run_and_exit(lambda: (print('returned', flush=True), {after_main or 'None'}))\n")
    got, why = gpu_smoke.exit_under_async_scheduling(tmp_path, {"model": "unused"},
                                                    {**os.environ, "PYTHONPATH": str(ROOT)})
    assert got.startswith(line) and why == problem
def test_the_flash_check_is_registered_and_says_it_skipped_on_the_cpu():
    assert gpu_smoke.flash_one_row_check in gpu_smoke.ATTENTION_CHECKS
    line, problem = gpu_smoke.flash_one_row_check("cpu")
    assert line.startswith("flash    skipped: ") and problem is None


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
    from tools import qwen_vocab

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


def test_the_vllm_lines_are_named_skipped_on_the_cpu(tmp_path, capsys):
    """--cpu: each GPU-only vLLM line says it was skipped, and nothing is run."""
    gpu_smoke.gpu_checks("cpu", tmp_path, {}, {})
    out = capsys.readouterr().out.splitlines()
    for name in ("sleep_preflight", "lora_after_sleep", "seeded_across_sleep", "handoff_gap",
                 "exit_under_async_scheduling"):
        assert f"skipped  {name}: needs a GPU" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("change, message", [
    ({}, None),
    ({"same_tokens": False}, "seeded tokens changed across a sleep and a reload"),
    ({"gap": 0.2}, "hand-off gap 0.2 over its tolerance"),
    ({"partial_refused": False}, "LoRA after sleep: a partial hand-off after a discard was accepted"),
    ({"lora_check": "the sampler's log-probs differ"}, "LoRA after sleep: the sampler's log-probs differ"),
])
def test_the_vllm_lines_judge_the_probe_s_measurements(tmp_path, capsys, monkeypatch, change, message):
    """On a GPU with vLLM the three lines read one probe's measurements (written here as the probe writes them) and
    the check fails on tokens that changed across a sleep, a gap over the tolerance, or LoRA's hand-off after a
    discard going wrong."""
    measured = {"tolerance": 0.1, "same_tokens": True, "tokens": 192, "gap": 0.012, "partial_refused": True,
                "lora_gap": 0.015, "lora_check": None, **change}
    (tmp_path / "vllm_probe.json").write_text(json.dumps(measured))
    monkeypatch.setattr(gpu_smoke.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(gpu_smoke, "GPU_CHECKS", [gpu_smoke.lora_after_sleep, gpu_smoke.seeded_across_sleep,
                                                  gpu_smoke.handoff_gap])  # the probe's lines only
    if message is None:
        gpu_smoke.gpu_checks("gpu", tmp_path, {}, {})
    else:
        with pytest.raises(SystemExit, match=message):
            gpu_smoke.gpu_checks("gpu", tmp_path, {}, {})
    out = capsys.readouterr().out
    assert "192 tokens" in out and f"gap {measured['gap']:g} per token on the GPU (tolerance 0.1" in out


@pytest.mark.parametrize("change, message", [
    ({}, None),
    ({"freed_gb": [21.5, 21.4, 9.0]}, "sleep 3 freed 9.00 GB of the first's 21.50"),
    ({"freed_gb": [0.9, 0.9, 0.9]}, "a sleep freed 0.90 GB, less than the weights' 1.19"),
    ({"awake": False}, "the engine was left asleep"),
    ({"gaps": [0.01, 0.3, 0.01]}, "a score after waking is off by 0.3"),
])
def test_the_sleep_preflight_prints_what_each_sleep_freed_and_fails_on_a_bad_cycle(tmp_path, capsys, monkeypatch,
                                                                                   change, message):
    """The preflight's line reads its process's measurements (written here as it writes them): the GB each sleep
    freed beside the weights, and the largest gap after waking; a sleep that frees less than the weights or than
    most of the first, an engine left asleep, or a gap over the tolerance fails the check."""
    measured = {"tolerance": 0.1, "weights_gb": 1.19, "freed_gb": [21.5, 21.4, 21.5], "gaps": [0.01, 0.012, 0.011],
                "awake": True, **change}
    (tmp_path / "sleep_preflight.json").write_text(json.dumps(measured))
    monkeypatch.setattr(gpu_smoke.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(gpu_smoke, "GPU_CHECKS", [gpu_smoke.sleep_preflight])
    if message is None:
        gpu_smoke.gpu_checks("gpu", tmp_path, {}, {})
    else:
        with pytest.raises(SystemExit, match=message):
            gpu_smoke.gpu_checks("gpu", tmp_path, {}, {})
    freed = ", ".join(f"{f:.2f}" for f in measured["freed_gb"])
    assert (f"sleep    level 2, wake weights, reload, wake KV cache, score, x3 (CUDA graphs on): freed {freed} GB "
            "(weights 1.19)") in capsys.readouterr().out
