"""eval.py under torchrun (gloo, CPU processes): the evaluation does not depend on the number of ranks.

The policy is tests/run_scripted_eval.py's VariedSampler: its answers depend only on the problem and on which of
the problem's k samples is being drawn, never on chance, timing or the rank that plays it. So 1, 2 and 3 ranks must
write the same results.json metrics (all but the wall-clock seconds) and the same trajectories.jsonl, line for
line. With a real sampler two things may legitimately differ, and nothing else: the samples themselves (rank r
draws its own with seed + r, so a problem's k samples are other draws when it lands on another rank) and a
rollout's batch neighbours (HFSampler batches a rank's own share; vLLM batches and schedules it), which change the
numerics of its forward passes; so metrics agree within sampling noise. Problem counts 7, 5 and 1 divide by neither
2 nor 3, and 3 ranks on the one-problem benchmark leave two ranks without a share."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev
from plumbing.data import write_jsonl
from scripted_policy import say_problems
from tiny.model import build_tiny
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "run_scripted_eval.py"
ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")},
       "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
SAMPLES = 4
# benchmark name -> first N of its "Say N." problems, and their count
BENCHES = {"a": (1, 7), "b": (20, 5), "c": (40, 1)}


def launch(world: int, root: Path, out: Path, seen: Path | None = None, crash_on: str | None = None):
    """eval.py with the scripted policy: plain python for world 1, torchrun with `world` processes otherwise."""
    env = dict(ENV)
    if seen is not None:
        seen.mkdir(parents=True, exist_ok=True)
        env["SEEN_DIR"] = str(seen)
    if crash_on is not None:
        env["CRASH_ON"] = crash_on
    starter = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                   str(world), "--master_port", str(free_port())]
    args = ["configs/tiny/eval.yaml", f"model_path={root / 'model'}", f"samples={SAMPLES}", f"out_dir={out}",
            "benchmarks=[" + ",".join(str(root / f"{name}.jsonl") for name in BENCHES) + "]",
            "tool_backend=subprocess", "tool_workers=1", "torch_threads=1"]
    return subprocess.run(starter + [str(SCRIPT)] + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same evaluation at 1, 2 and 3 ranks: {world: (out_dir, seen_dir)}."""
    root = tmp_path_factory.mktemp("invariance")
    build_tiny(root / "model", hidden=32, layers=2, heads=2)
    for name, (start, count) in BENCHES.items():
        write_jsonl(root / f"{name}.jsonl", say_problems(count, start=start))
    done = {}
    for world in (1, 2, 3):
        out, seen = root / f"world{world}", root / f"seen{world}"
        result = launch(world, root, out, seen)
        assert result.returncode == 0, result.stderr[-3000:]
        done[world] = (out, seen)
    done["root"] = root
    return done


def metrics(out: Path) -> dict:
    """results.json's metrics of every benchmark, without the wall-clock seconds."""
    saved = json.loads((out / "results.json").read_text())["benchmarks"]
    return {name: {k: v for k, v in m.items() if k != "seconds"} for name, m in saved.items()}


def lines(out: Path) -> list[str]:
    return (out / "trajectories.jsonl").read_text().splitlines()


def test_eval_invariance_problem_shares_cover_every_problem_once():
    for count in (0, 1, 5, 7):
        for world in (1, 2, 3, 8):
            shares = [ev.problem_share(count, rank, world) for rank in range(world)]
            assert sorted(i for share in shares for i in share) == list(range(count))
    assert [ev.problem_share(7, r, 3) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [ev.problem_share(1, r, 3) for r in range(3)] == [[0], [], []]


def test_eval_invariance_one_two_and_three_ranks_write_the_same_results_and_trajectories(runs):
    one = runs[1][0]
    # One process, by hand: problem N answers right in 3, 2 or 1 of 4 samples for N % 3 = 0, 1, 2.
    right = {n: (3, 2, 1)[n % 3] / 4 for start, count in BENCHES.values() for n in range(start, start + count)}
    for name, (start, count) in BENCHES.items():
        m = metrics(one)[name]
        assert (m["problems"], m["samples"]) == (count, SAMPLES)
        assert m["pass@1"] == pytest.approx(sum(right[n] for n in range(start, start + count)) / count)
        se = ev.standard_error([right[n] for n in range(start, start + count)])
        assert m["pass@1_se"] == (pytest.approx(se) if count > 1 else None)
    records = [json.loads(line) for line in lines(one)]
    assert [(r["benchmark"], r["problem_index"], r["sample"]) for r in records] == \
        [(name, i, s) for name, (_, count) in BENCHES.items() for i in range(count) for s in range(SAMPLES)]
    assert [r["answer"] for r in records[::SAMPLES]] == \
        [str(n) for start, count in BENCHES.values() for n in range(start, start + count)]
    for world in (2, 3):
        out = runs[world][0]
        assert metrics(out) == metrics(one), world
        assert lines(out) == lines(one), world
        assert (out / "config.yaml").is_file() and (out / "report.html").is_file()


def test_eval_invariance_two_ranks_write_each_rollout_once(runs):
    """Before eval.py was data-parallel, each of the two ranks evaluated everything and appended it: twice the
    lines."""
    records = [json.loads(line) for line in lines(runs[2][0])]
    assert len(records) == SAMPLES * sum(count for _, count in BENCHES.values()) == 52
    assert len({(r["benchmark"], r["problem_index"], r["sample"]) for r in records}) == 52


def test_eval_invariance_each_problem_is_played_by_one_rank_with_that_ranks_seed(runs):
    for world in (1, 2, 3):
        seen = runs[world][1]
        for rank in range(world):
            path = seen / f"rank{rank}.jsonl"
            played = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
            expected = [start + i for start, count in BENCHES.values() for i in ev.problem_share(count, rank, world)]
            # each of the rank's problems once, all k samples in one batch, seeded seed + rank (seed: 0)
            assert [(p["problem"], p["copy"]) for p in played] == [(n, c) for n in expected for c in range(SAMPLES)]
            assert {p["seed"] for p in played} == {rank}, (world, rank)
        assert not (seen / f"rank{world}.jsonl").exists()


def test_eval_invariance_crash_at_two_ranks_then_resume_at_three(runs, tmp_path):
    """The main process dies in benchmark b (at its first problem, which rank 0 plays: a is on disk by then).
    Three ranks then agree that a is done, play b and c only, and the folder ends as the one-process run's."""
    out = tmp_path / "out"
    crashed = launch(2, runs["root"], out, crash_on="Say 20.")
    assert crashed.returncode != 0 and "scripted crash on 'Say 20.'" in crashed.stderr
    assert list(metrics(out)) == ["a"]
    resumed = launch(3, runs["root"], out, seen=tmp_path / "seen")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "kept from the earlier run" in resumed.stdout
    played = {json.loads(line)["problem"] for path in (tmp_path / "seen").glob("rank*.jsonl")
              for line in path.read_text().splitlines()}
    assert played == {20, 21, 22, 23, 24, 40}  # b and c; a is not played again
    assert metrics(out) == metrics(runs[1][0])
    assert lines(out) == lines(runs[1][0])


def test_eval_vllm_tensor_parallel_under_a_launcher_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = ev.EvalConfig(model_path="m", sampler="vllm", vllm_tensor_parallel_size=2, out_dir=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match=r"config error: vllm_tensor_parallel_size=2 under a launcher with 2 "):
        ev.run(cfg)
    assert not (tmp_path / "out").exists()


def test_eval_vllm_under_a_launcher_is_one_engine_per_rank_seeded_seed_plus_rank(tmp_path, monkeypatch):
    """vLLM is not installed here: the arguments load_model (plumbing/eval_run.py) gives VLLMSampler on rank 1 of 2."""
    from plumbing import eval_run
    from samplers import vllm_engine
    from tiny.model import build_tokenizer
    build_tokenizer().save_pretrained(tmp_path / "model")
    built = []
    monkeypatch.setattr(vllm_engine, "VLLMSampler", lambda *args, **kwargs: built.append(kwargs) or "engine")
    monkeypatch.setattr(eval_run, "rank_of_process", lambda: (1, 2))
    ev.load_model(ev.EvalConfig(model_path=str(tmp_path / "model"), sampler="vllm", seed=3))
    monkeypatch.setattr(eval_run, "rank_of_process", lambda: (0, 1))
    ev.load_model(ev.EvalConfig(model_path=str(tmp_path / "model"), sampler="vllm", seed=3))
    assert (built[0]["seed"], built[0]["distributed_executor_backend"]) == (4, "external_launcher")
    assert built[1]["seed"] == 3 and "distributed_executor_backend" not in built[1]
