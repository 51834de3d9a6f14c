"""tiny/ablation.py: the arms differ only in the RoC fields, and the table and plots are computed from the run logs."""
import argparse
import json
import statistics
from pathlib import Path

import pytest

from tiny import ablation
from plumbing.config import load_config
from train import TrainConfig


def test_arms_differ_only_in_the_resampling_fields(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(ablation.subprocess, "run", lambda cmd, check, env: calls.append(cmd))
    args = argparse.Namespace(
        root=str(tmp_path), sft="runs/tiny/sft/model", data="task", config="configs/ablation/rl.yaml", steps=7,
        eval_every=5, eval_limit=100, eval_samples=2, override=["lr=1e-4"], train="train_level1.jsonl")
    for arm in ablation.ARMS:
        ablation.run_arm(arm, 3, args)
    fields = [dict(a.split("=", 1) for a in cmd[3:]) for cmd in calls]
    assert fields[0]["data"] == "[task/train_level1.jsonl]" and fields[0]["eval_data"] == "task/test.jsonl"
    assert [f["roc_mode"] for f in fields] == ["sample", "off", "lowest", "uniform"]
    assert [(f["rollouts_per_prompt"], f["group_size"]) for f in fields] == [("8", "4"), ("4", "4"), ("8", "4"),
                                                                             ("8", "4")]
    same = [{k: v for k, v in f.items() if k not in ("roc_mode", "rollouts_per_prompt", "group_size", "out_dir")}
            for f in fields]
    assert same[0] == same[1] == same[2] == same[3] and same[0]["seed"] == "3" and same[0]["lr"] == "1e-4"
    for cmd in calls:  # every arm is a valid train.py configuration
        cfg = load_config(TrainConfig, [cmd[2]], cmd[3:])
        assert cfg.steps == 7 and cfg.group_size == 4


def test_curve_smooths_with_a_trailing_mean_and_skips_missing_values():
    rows = [{"step": 1, "x": 1.0}, {"step": 2, "x": float("nan")}, {"step": 3, "x": 3.0}, {"step": 4},
            {"step": 5, "x": 5.0}]
    assert ablation.curve(rows, "x", 1) == [(1, 1.0), (3, 3.0), (5, 5.0)]
    assert ablation.curve(rows, "x", 2) == [(1, 1.0), (3, 2.0), (5, 4.0)]


def _fake_run(folder: Path, acc: list[float], err: list[float]):
    folder.mkdir(parents=True)
    rows = []
    for step, e in enumerate(err, 1):
        row = {"step": step, "rollout/tool_error_rate_in_correct": e, "rollout/response_tokens_mean": 100.0 - step,
               "rollout/tool_calls_mean": 1.0, "rollout/reward_mean": 0.1 * step}
        if step % 2 == 0:
            row["eval/accuracy"] = acc[step // 2 - 1]
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_reads_the_runs_and_writes_table_and_plots(tmp_path):
    _fake_run(tmp_path / "roc-seed0", [0.5, 0.7], [0.2, 0.1, 0.0, 0.0])
    _fake_run(tmp_path / "roc-seed1", [0.4, 0.9], [0.2, 0.2, 0.0, 0.1])
    _fake_run(tmp_path / "grpo-seed0", [0.5, 0.6], [0.2, 0.2, 0.2, 0.2])
    _fake_run(tmp_path / "grpo-seed1", [0.5, 0.5], [0.3, 0.2, 0.1, 0.1])
    ablation.main(["--root", str(tmp_path), "--arms", "roc", "grpo", "--seeds", "0", "1", "--smooth", "2",
                   "--report-only"])
    final = json.loads((tmp_path / "ablation.json").read_text())["final"]
    assert final["roc"]["accuracy"]["seeds"] == [0.7, 0.9]
    assert final["roc"]["accuracy"]["mean"] == pytest.approx(0.8)
    assert final["roc"]["accuracy"]["std"] == pytest.approx(statistics.stdev([0.7, 0.9]))
    # trailing mean of the last 2 steps: roc (0+0)/2 and (0+0.1)/2; grpo 0.2 and 0.1
    assert final["roc"]["tool_error_rate_in_correct"]["seeds"] == pytest.approx([0.0, 0.05])
    assert final["grpo"]["tool_error_rate_in_correct"]["seeds"] == pytest.approx([0.2, 0.1])
    assert final["grpo"]["response_tokens"]["mean"] == pytest.approx(96.5)
    assert final["roc"]["reward"]["seeds"] == pytest.approx([0.35, 0.35])  # (0.3 + 0.4) / 2
    for name, _, _ in ablation.METRICS:
        assert (tmp_path / f"ablation_{name}.png").stat().st_size > 1000
    table = (tmp_path / "ablation.md").read_text()
    assert "| roc | 0.800 ± 0.141 [0.700, 0.900]" in table


def _call(status):
    return {"code": "print(1)", "status": status, "response": status + "\n"}


def test_error_cost_splits_rollouts_by_what_their_calls_did():
    records = [{"reward": 1.0, "tool_calls": [_call("ok")]},                       # clean, right
               {"reward": 0.0, "tool_calls": [_call("ok"), _call("ok")]},          # clean, wrong
               {"reward": 1.0, "tool_calls": [_call("error")]},                    # answered after a failure
               {"reward": 0.0, "tool_calls": [_call("ok"), _call("timeout")]},     # answered after a failure
               {"reward": 1.0, "tool_calls": [_call("parse_error"), _call("ok")]},  # fixed
               {"reward": 0.0, "tool_calls": []}]
    cost = ablation.error_cost(records)
    assert {k: (v["n"], v["correct"]) for k, v in cost.items()} == {
        "clean": (2, 1), "failed": (3, 2), "answered_after_failure": (2, 1), "fixed": (1, 1), "no_call": (1, 0)}
    assert cost["failed"]["p"] == pytest.approx(2 / 3)
    assert ablation.error_cost([])["clean"]["p"] is None


def _rows(err: list[float], acc: float) -> list[dict]:
    """One run's metrics: err+ per step, the held-out accuracy at the last step only."""
    rows = [{"step": s, ablation.ERR: e} for s, e in enumerate(err, 1)]
    rows[-1]["eval/accuracy"] = acc
    return rows


def test_window_mean_takes_the_first_or_the_last_steps_and_skips_missing():
    rows = _rows([0.4, 0.2, float("nan"), 0.1, 0.3], 0.5)
    assert ablation.window_mean(rows, ablation.ERR, first=2) == pytest.approx(0.3)
    assert ablation.window_mean(rows, ablation.ERR, last=3) == pytest.approx(0.2)  # steps 3-5, step 3 is NaN
    assert ablation.window_mean(rows, ablation.ERR, first=20) == pytest.approx(0.25)


def test_check_finding_on_hand_made_metrics():
    flat, falling = [0.2] * 5 + [0.15] * 10, [0.2] * 5 + [0.05] * 10  # 15 steps: first 5, last 10
    runs = {"roc": [_rows(falling, 0.80), _rows([x * 0.8 for x in falling], 0.84)],
            "grpo": [_rows(flat, 0.78), _rows([x * 1.2 for x in flat], 0.86)]}
    checks = ablation.check_finding(runs)
    assert [c["ok"] for c in checks] == [True, True, True, True]
    assert checks[0]["value"] == "0.165 vs 0.045 (3.7x)"  # GRPO (0.15 + 0.18) / 2, RoC (0.05 + 0.04) / 2

    # GRPO only 1.4x RoC on average, and one GRPO seed below one RoC seed
    runs["grpo"] = [_rows([0.2] * 5 + [0.03] * 10, 0.78), _rows([0.2] * 5 + [0.1] * 10, 0.86)]
    oks = [c["ok"] for c in ablation.check_finding(runs)]
    assert oks[:2] == [False, False]
    # GRPO falls away: its last 10 steps under half its first 5 (still 2x RoC, every seed above)
    runs = {"roc": [_rows([0.9] * 5 + [0.01] * 10, 0.8)] * 2, "grpo": [_rows([0.9] * 5 + [0.1] * 10, 0.8)] * 2}
    assert [c["ok"] for c in ablation.check_finding(runs)] == [True, True, False, True]
    # RoC's accuracy below GRPO's by more than the larger seed standard deviation
    runs = {"roc": [_rows(falling, 0.60), _rows(falling, 0.64)], "grpo": [_rows(flat, 0.78), _rows(flat, 0.86)]}
    checks = ablation.check_finding(runs)
    assert [c["ok"] for c in checks] == [True, True, True, False]
    assert checks[3]["value"] == "0.620 vs 0.820, spread 0.057"


def test_ablation_smol_arms_differ_only_in_the_selector(monkeypatch, tmp_path):
    from smol import ablation as smol_ablation
    calls = []
    monkeypatch.setattr(ablation.subprocess, "run", lambda cmd, check, env: calls.append(cmd))
    args = ablation.parse(smol_ablation.ARGS + ["--root", str(tmp_path)])
    assert args.arms == ["roc", "uniform", "lowest"] and args.baseline == "uniform" and args.seeds == [0, 1, 2]
    for arm in args.arms:
        ablation.run_arm(arm, 1, args)
    fields = [dict(a.split("=", 1) for a in cmd[3:]) for cmd in calls]
    assert [f["roc_mode"] for f in fields] == ["sample", "uniform", "lowest"]
    same = [{k: v for k, v in f.items() if k not in ("roc_mode", "out_dir")} for f in fields]
    assert same[0] == same[1] == same[2]
    assert same[0]["rollouts_per_prompt"] == "8" and same[0]["group_size"] == "4" and same[0]["seed"] == "1"
    assert same[0]["data"] == "[runs/smol/data/train.jsonl]" and same[0]["prompts_per_step"] == "6"
    for cmd in calls:  # the smol stage-1 config with the arm's fields, a valid train.py configuration
        assert cmd[2] == "configs/smollm2-135m/stage1.yaml"
        cfg = load_config(TrainConfig, [cmd[2]], cmd[3:])
        assert cfg.steps == 15 and cfg.prompts_per_step == 6 and cfg.save_every == 3


def test_held_out_reads_each_arm_s_evaluation_and_the_transfer_family(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.jsonl").write_text("".join(json.dumps({"problem": str(i), "answer": "1", "family": f}) + "\n"
                                             for i, f in enumerate(["a", "a", "t", "t"])))
    for arm, rewards in (("roc", [1, 0, 1, 0]), ("uniform", [1, 1, 0, 0])):
        (tmp_path / f"{arm}-seed0" / "eval").mkdir(parents=True)
        (tmp_path / f"{arm}-seed0" / "eval" / "trajectories.jsonl").write_text(
            "".join(json.dumps({"problem_index": i, "reward": r}) + "\n" for i, r in enumerate(rewards)))
    held = ablation.read_held_out(tmp_path, ["roc", "uniform", "lowest"], [0], data, "t")
    assert held == {"roc": [{"pass@1": 0.5, "transfer": 0.5}], "uniform": [{"pass@1": 0.5, "transfer": 0.0}]}


def test_window_table_takes_the_windows_per_seed_with_a_bootstrap_interval():
    def rows(err):
        return [{"step": s, ablation.ERR: e, "rollout/response_tokens_mean": 10.0 * s} for s, e in enumerate(err, 1)]
    runs = {"roc": [rows([0.4, 0.2, 0.1, 0.0]), rows([0.4, 0.4, 0.2, 0.2])],
            "uniform": [rows([0.4, 0.4, 0.4, 0.4]), rows([0.2, 0.4, 0.3, 0.3])]}
    table = ablation.window_table(runs, first=2, last=2, held_out={"roc": [{"pass@1": 0.3, "transfer": None}]})
    roc, uni = table["roc"], table["uniform"]
    assert roc["err_in_correct_last"] == pytest.approx(0.125)  # seeds 0.05 and 0.2
    assert (roc["err_in_correct_last_min"], roc["err_in_correct_last_max"]) == pytest.approx((0.05, 0.2))
    low, high = roc["err_in_correct_last_ci"]
    assert 0.0 <= low < 0.125 < high <= 0.2
    assert roc["err_in_correct_first"] == pytest.approx(0.35) and uni["err_in_correct_last"] == pytest.approx(0.35)
    assert roc["response_tokens_last"] == pytest.approx(35.0)
    assert roc["held_out_pass@1"] == 0.3 and "held_out_transfer" not in roc and "held_out_pass@1" not in uni
    assert "| roc | 2 | 0.125 [0.050, 0.200]" in ablation.window_markdown(table, 2, 2)
