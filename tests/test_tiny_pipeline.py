"""CI's short version of `make tiny`: every entry point for a few steps, on the real tiny model and task; and the
pipeline's rule for what is done: a step's marker, never the mere presence of its outputs.

The learning claim itself (RL gains over SFT) needs the full run (README: What you will see); policy change under the RL update
is asserted by tests/test_train.py on scripted rollouts, since a few-step SFT model rarely answers correctly."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import pipeline as tiny_pipeline

ROOT = Path(__file__).resolve().parents[1]


def test_quick_pipeline_runs_every_stage_and_a_changed_rerun_ends_with_its_own_numbers(tmp_path, monkeypatch):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = tmp_path / "tiny"
    done = subprocess.run([sys.executable, "-m", "tiny.pipeline", "--quick", "--root", str(root)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    for stage in ("sft", "stage1", "stage2", "stage3"):
        assert 0.0 <= summary[f"{stage}_accuracy"] <= 1.0
        assert stage in summary["tool_error_rate_in_correct"] and summary["mean_response_tokens"][stage] > 0
    assert summary["wall_seconds"] > 0 and (root / "summary.png").stat().st_size > 1000
    # each RL stage keeps its last step's rollouts (2 prompts x 4 under --quick), and their page
    assert summary["rollout_pages"] == {s: str(root / s / "rollouts" / "step_000002.html") for s in tiny_pipeline.RL_STAGES}
    assert all(len((root / s / "rollouts" / "step_000002.jsonl").read_text().splitlines()) == 8 for s in tiny_pipeline.RL_STAGES)
    for stage in ("stage1", "stage2", "stage3"):
        rows = [json.loads(x) for x in (root / stage / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2 and all(0.0 <= r["rollout/reward_mean"] <= 1.0 for r in rows)  # reward computed
        assert (root / stage / "model" / "config.json").is_file()
    sft_rows = (root / "sft" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(sft_rows[-1])["sft/loss"] < json.loads(sft_rows[0])["sft/loss"]  # SFT learned something
    assert "sft -> stage3" in done.stdout
    assert (tmp_path / "tiny" / "eval_stage3" / "report.html").is_file()  # eval.py writes each report
    assert "eval_sft vs eval_stage3" in (tmp_path / "tiny" / "compare_sft_stage3.html").read_text()
    assert summary["tool_sandbox"].startswith("code tool sandbox: ") and summary["tool_sandbox"] in done.stderr

    # The time table: every command with its wall and CPU seconds, the parts its entry point logged, and each
    # stage's evaluation started before the next stage (it runs beside it).
    phases = summary["phases"]
    assert set(phases) == {"base", "data", "sft", "eval_sft", "stage1", "eval_stage1", "stage2", "eval_stage2",
                           "val_stage1", "unsolved_stage2", "val_stage2", "stage3", "eval_stage3", "val_stage3"}
    # The guard compared the RL stages on the validation split and says which model is final.
    guard = summary["stage_guard"]
    val = guard["val_accuracy"]
    assert val[guard["final_model"]] == max(val.values()) and guard["kept"] == (guard["final_model"] == "stage3")
    assert summary["final_model"] == str(root / guard["final_model"] / "model")
    for stage in ("stage1", "stage2", "stage3"):
        val = json.loads((root / f"val_{stage}" / "results.json").read_text())
        assert list(val["benchmarks"]) == ["val"]  # the validation split (val.jsonl)
        assert next(iter(val["benchmarks"].values()))["pass@1"] == guard["val_accuracy"][stage]
    assert all(p["wall_s"] > 0 and p["cpu_s"] > 0 and p["peak_gib"] > 0.01 for p in phases.values())
    assert "GiB at once" in done.stdout
    assert phases["sft"]["parts"]["training"] > 0
    for stage in ("stage1", "stage2"):
        rows = [json.loads(x) for x in (root / stage / "metrics.jsonl").read_text().splitlines()]
        assert phases[stage]["parts"]["rollout"] > 0
        assert phases[stage]["parts"]["update"] == round(sum(r["perf/update_s"] for r in rows), 1)
        # A step updates only when some group's rewards differ; with 2 prompts a step under --quick, a stage may
        # have none (every group all right or all wrong), and then its update took no time worth a row.
        assert all(r["perf/update_s"] > 0 for r in rows if r["roc/equal_group_frac"] < 1.0)
    assert phases["eval_stage3"]["parts"]["rollouts_and_scoring"] > 0
    assert phases["val_stage3"]["parts"]["rollouts_and_scoring"] > 0
    for before, stage in (("sft", "stage1"), ("stage1", "stage2"), ("stage2", "stage3")):
        assert phases[f"eval_{before}"]["beside_next"] and phases[f"eval_{before}"]["start_s"] <= phases[stage]["start_s"]
    assert "where the time went" in done.stdout

    # The same folder with stage 3 changed (another lr): stage 3 is done again with its evaluations, and the
    # summary reads the new ones; every step it does not change is kept, evaluations included.
    kept = {p: p.stat().st_mtime_ns for name in ("base", "sft", "stage1", "stage2", "eval_sft", "eval_stage1",
                                                 "eval_stage2", "val_stage1", "val_stage2")
            for p in [root / name / "step.json"]}
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    real_inputs = tiny_pipeline.stage_inputs

    def other_stage3(root_, stage, previous, lora, *rest):
        config, model, extra = real_inputs(root_, stage, previous, lora, *rest)
        return config, model, extra + (["lr=5.0e-5"] if stage == 3 else [])
    monkeypatch.setattr(tiny_pipeline, "stage_inputs", other_stage3)
    tiny_pipeline.main(["--quick", "--root", str(root)])
    assert {p: p.stat().st_mtime_ns for p in kept} == kept  # nothing upstream of stage 3 was redone
    assert (root / "stage3.previous" / "metrics.jsonl").is_file()  # the old stage 3, kept aside
    assert "lr=5.0e-5" in json.loads((root / "stage3" / "step.json").read_text())["record"]["command"]
    summary = json.loads((root / "summary.json").read_text())
    for stage in ("stage3", "val_stage3"):
        results = json.loads((root / f"eval_{stage}" if stage == "stage3" else root / stage)
                             .joinpath("results.json").read_text())
        model = root / "stage3" / "model"
        stats = {str(p.relative_to(model)): [p.stat().st_size, p.stat().st_mtime_ns]
                 for p in sorted(model.rglob("*")) if p.is_file()}
        assert results["identity"]["model_files"] == stats  # the evaluation is of the new model, not the old one
    guard = summary["stage_guard"]
    results = json.loads((root / "eval_stage3" / "results.json").read_text())
    assert guard["trained_accuracy"] == next(iter(results["benchmarks"].values()))["pass@1"]
    final = json.loads((root / f"eval_{guard['final_model']}" / "results.json").read_text())
    assert summary["stage3_accuracy"] == next(iter(final["benchmarks"].values()))["pass@1"]


SCRIPT = """
import pathlib, sys
out, runs, value = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
with runs.open("a") as f:
    f.write(out.name + "\\n")
out.mkdir(exist_ok=True)
(out / "config.json").write_text(value)  # written first, as save_pretrained does
if (runs.parent / "fail").exists():
    sys.exit(1)
(out / "weights").write_text(value)
"""


def test_a_step_is_done_only_when_it_finished_with_the_same_command_configs_and_inputs(tmp_path):
    runs, a, b = tmp_path / "runs.txt", tmp_path / "a", tmp_path / "b"
    (tmp_path / "base.yaml").write_text("lr: 1.0\n")
    (tmp_path / "b.yaml").write_text("base: base.yaml\nsteps: 2\n")

    def step_a(value):
        return tiny_pipeline.step(a, ["-c", SCRIPT, str(a), str(runs), value])

    def step_b(after):
        return tiny_pipeline.step(b, ["-c", SCRIPT, str(b), str(runs), "b", str(tmp_path / "b.yaml")], after=[after])

    def ran():
        return runs.read_text().split()
    (tmp_path / "fail").touch()
    with pytest.raises(subprocess.CalledProcessError):
        step_a("1")  # stopped after config.json: outputs exist, but the step did not finish
    (tmp_path / "fail").unlink()
    marker = step_a("1")
    assert ran() == ["a", "a"] and (a / "weights").read_text() == "1"
    assert step_a("1") == marker and step_b(marker) and ran() == ["a", "a", "b"]
    step_b(step_a("1"))
    assert ran() == ["a", "a", "b"]  # nothing changed: nothing runs
    marker = step_a("2")  # another command: redone, the old folder kept aside ...
    assert (a / "weights").read_text() == "2" and (tmp_path / "a.previous" / "weights").read_text() == "1"
    step_b(marker)  # ... and what depends on it is redone too
    assert ran() == ["a", "a", "b", "a", "b"]
    (tmp_path / "base.yaml").write_text("# the learning rate\nlr:   1.0   # unchanged\n")  # a comment, spaces
    step_b(marker)
    assert ran() == ["a", "a", "b", "a", "b"]  # the same values: still done
    (tmp_path / "base.yaml").write_text("lr: 2.0\n")  # an edited value, even in a file named only via base:
    step_b(marker)
    assert ran() == ["a", "a", "b", "a", "b", "b"]


def test_one_seed_reaches_every_command_and_threads_when_given(tmp_path, monkeypatch):
    commands = {}

    def record(out, cmd, after=(), commands_=None, beside=False, **kw):
        commands[out.name] = cmd
        return out / "step.json"
    monkeypatch.setattr(tiny_pipeline, "step", lambda out, cmd, after=(), commands=None, beside=False:
                        record(out, cmd))
    monkeypatch.setattr(tiny_pipeline, "eval_results", lambda root, name, folder="eval": {"pass@1": 0.5})
    tiny_pipeline.pipeline(tmp_path, False, tiny_pipeline.Commands(), seed=7, threads=1)
    assert set(commands) == {"base", "data", "sft", "stage1", "stage2", "stage3", "unsolved_stage2", "eval_sft",
                             "eval_stage1", "eval_stage2", "eval_stage3", "val_stage1", "val_stage2", "val_stage3"}
    assert f"benchmarks=[{tmp_path / 'data' / 'val.jsonl'}]" in commands["val_stage3"]  # the validation split
    levels = f"data=[{tmp_path / 'data' / 'train_level1.jsonl'},{tmp_path / 'data' / 'train_level2.jsonl'}]"
    assert levels in commands["stage1"] and levels in commands["stage2"]  # all problems, as the report's stages 1-2
    assert f"data=[{tmp_path / 'data' / 'stage3.jsonl'}]" in commands["stage3"]
    assert commands["base"][-2:] == ["--seed", "7"] and commands["data"][-2:] == ["--seed", "7"]
    for name, cmd in commands.items():
        if name not in ("base", "data"):
            assert "seed=7" in cmd and "torch_threads=1" in cmd, name
    commands.clear()
    tiny_pipeline.pipeline(tmp_path, False, tiny_pipeline.Commands())  # the default: seed 0, the configs' threads
    assert commands["base"][-2:] == ["--seed", "0"] and all(
        "seed=0" in c and not any(a.startswith("torch_threads=") for a in c) for n, c in commands.items()
        if n not in ("base", "data"))


def test_the_lora_pipeline_carries_stage_1_s_adapter_into_stage_2_and_starts_stage_3_afresh(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(tiny_pipeline, "step", lambda out, cmd, after=(), commands=None, beside=False:
                        seen.setdefault(out.name, cmd) and out / "step.json")
    monkeypatch.setattr(tiny_pipeline, "eval_results", lambda root, name, folder="eval": {"pass@1": 0.5})
    tiny_pipeline.pipeline(tmp_path, False, tiny_pipeline.Commands(), lora=True)
    assert [seen[f"stage{s}"][1] for s in (1, 2, 3)] == [f"configs/tiny/lora_stage{s}.yaml" for s in (1, 2, 3)]
    assert f"model_path={tmp_path / 'sft' / 'model'}" in seen["stage1"]
    # stage 2: stage 1's adapter and AdamW state, on the model that adapter was trained on
    assert {f"model_path={tmp_path / 'sft' / 'model'}", f"lora_from={tmp_path / 'stage1' / 'adapter'}",
            f"optimizer_from={tmp_path / 'stage1'}"} <= set(seen["stage2"])
    # stage 3: stage 2's merged model, a fresh adapter and optimizer
    assert f"model_path={tmp_path / 'stage2' / 'model'}" in seen["stage3"]
    assert not any(a.startswith(("lora_from=", "optimizer_from=")) for a in seen["stage3"])
    from plumbing.config import parse_cli
    from plumbing.train_config import TrainConfig
    for s, lr in ((1, 2e-3), (2, 1e-3), (3, 1e-3)):  # each resolves to its full-fine-tuning stage, with LoRA
        lora, full = (parse_cli(TrainConfig, [f"configs/tiny/{p}stage{s}.yaml"]) for p in ("lora_", ""))
        assert (lora.lora_rank, full.lora_rank, lora.lr, lora.steps) == (16, 0, lr, full.steps)


def test_peak_at_once_sums_the_commands_that_overlap_and_only_those():
    phases = {"sft": {"start_s": 0.0, "wall_s": 10.0, "peak_gib": 4.0},
              "eval_sft": {"start_s": 10.0, "wall_s": 5.0, "peak_gib": 3.0},   # beside stage1
              "stage1": {"start_s": 10.5, "wall_s": 20.0, "peak_gib": 2.5},
              "eval_stage1": {"start_s": 30.5, "wall_s": 5.0, "peak_gib": 1.0}}
    assert tiny_pipeline.peak_at_once(phases) == 5.5  # eval_sft and stage1; sft ended when eval_sft began
    phases["eval_stage1"]["peak_gib"] = None
    assert tiny_pipeline.peak_at_once(phases) is None


def test_seeds_parse_and_the_seed_table_gives_each_stage_mean_min_max():
    assert tiny_pipeline.parse_seeds("0-2,5,1") == [0, 1, 2, 5]
    with pytest.raises(Exception, match="not a seed"):
        tiny_pipeline.parse_seeds("a-b")
    runs = {0: (0.30, 0.80, 0.85, 0.90, 320.0), 1: (0.20, 0.70, 0.75, 0.80, 300.0), 5: (0.25, 0.75, 0.95, 0.70, 900.0)}
    summaries = {seed: {"sft_accuracy": a, "stage1_accuracy": b, "stage2_accuracy": c, "stage3_accuracy": d,
                        "gain_points": 100 * (d - a), "wall_seconds": w, "torch_threads": 1 if seed == 5 else None}
                 for seed, (a, b, c, d, w) in runs.items()}
    stats, text = tiny_pipeline.seed_table(summaries)
    assert stats["stage2_accuracy"] == {"mean": pytest.approx(0.85), "min": 0.75, "max": 0.95}
    assert stats["gain_points"]["min"] == pytest.approx(45.0) and stats["gain_points"]["max"] == pytest.approx(60.0)
    lines = text.splitlines()
    assert lines[3].split()[:2] == ["5", "1"] and lines[3].split()[-1] == "900"  # a row per seed, its threads, wall
    assert lines[-3].split()[0] == "mean" and lines[-3].split()[-1] == "+55.0"


def test_the_final_model_is_the_rl_stage_best_on_the_validation_split():
    results = {"sft": {"pass@1": 0.3}, "stage1": {"pass@1": 0.90}, "stage2": {"pass@1": 0.81},
               "stage3": {"pass@1": 0.55}}
    final, record = tiny_pipeline.guard_stages(results, {"stage1": 0.88, "stage2": 0.78, "stage3": 0.56})
    assert final["stage3"] == {"pass@1": 0.90} and final["stage2"] == {"pass@1": 0.81}  # stage 1's model is final
    assert record == {"final_model": "stage1", "kept": False, "trained_accuracy": 0.55,
                      "val_accuracy": {"stage1": 0.88, "stage2": 0.78, "stage3": 0.56}}
    assert results["stage3"] == {"pass@1": 0.55}  # the caller's results are not changed
    final, record = tiny_pipeline.guard_stages(results, {"stage1": 0.80, "stage2": 0.85, "stage3": 0.84})
    assert final["stage3"] == {"pass@1": 0.81} and record["final_model"] == "stage2"
    for val3 in (0.85, 0.90):  # as good as the best before it, or better: stage 3 stays
        final, record = tiny_pipeline.guard_stages(results, {"stage1": 0.80, "stage2": 0.85, "stage3": val3})
        assert final["stage3"] == {"pass@1": 0.55} and record["kept"] and record["final_model"] == "stage3"


def test_seeds_json_keeps_the_seeds_of_earlier_commands_into_the_same_root(tmp_path, monkeypatch, capsys):
    def fake_run_seed(root, args, seed, sandbox, recipe=None):  # a summary whose numbers name the seed and the call
        calls.append(seed)
        acc = 0.1 * seed + 0.01 * len(calls)
        return {"sft_accuracy": 0.0, "stage1_accuracy": acc, "stage2_accuracy": acc, "stage3_accuracy": acc,
                "gain_points": 100 * acc, "wall_seconds": 1.0, "torch_threads": args.torch_threads}
    calls = []
    monkeypatch.setattr(tiny_pipeline, "run_seed", fake_run_seed)
    monkeypatch.setattr(tiny_pipeline, "announce", lambda sandbox: "")
    root = tmp_path / "seeds"
    tiny_pipeline.main(["--seeds", "0,1", "--root", str(root)])
    tiny_pipeline.main(["--seeds", "3,1", "--root", str(root), "--torch-threads", "1"])  # seed 1 again, one thread
    saved = json.loads((root / "seeds.json").read_text())
    assert list(saved["seeds"]) == ["0", "1", "3"]
    assert saved["seeds"]["0"]["stage3_accuracy"] == pytest.approx(0.01)  # from the first command
    assert saved["seeds"]["1"]["stage3_accuracy"] == pytest.approx(0.14) and saved["seeds"]["1"]["torch_threads"] == 1
    assert saved["over_seeds"]["stage3_accuracy"]["max"] == pytest.approx(0.33)
    assert "over seeds [0, 1, 3] (this command ran [3, 1])" in capsys.readouterr().out
