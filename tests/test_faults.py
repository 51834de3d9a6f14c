"""Faults at several ranks, on CPU processes over gloo: a rank stopped (SIGSTOP) or killed during a step's
rollouts stops the others within peer_timeout_s + 60 s, with one line naming it (accel.Peers); torchrun
--max_restarts 1 brings a group with a killed worker back from its last checkpoint, and the run ends with the
metrics and weights of one never stopped; ranks whose samplers differ in giving log-probs, and a rank with only
fillers, neither hang nor mislabel metrics. Rollouts come from the scripted policy (tests/run_scripted_train.py)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plumbing.data import write_jsonl
from scripted_policy import say_problems
from ports import free_port
from test_train_invariance import assert_same_metrics_and_weights, metrics
from tiny.model import build_tiny

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "run_scripted_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PEER_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "train.jsonl", say_problems(9))
    write_jsonl(root / "held_out.jsonl", say_problems(5, start=20))
    return root


def args(data: Path, out: Path, steps: int = 3, extra=()) -> list[str]:
    return ["configs/tiny/stage1.yaml", f"model_path={data / 'base'}", f"data=[{data / 'train.jsonl'}]",
            f"out_dir={out}", "prompts_per_step=6", "rollouts_per_prompt=8", "group_size=4", "updates_per_step=2",
            "max_tokens_per_micro_batch=256", f"steps={steps}", "lr=1e-3", "warmup_steps=10",
            "max_response_tokens=96", "save_every=1", "torch_threads=1", "tool_workers=1",
            f"eval_data={data / 'held_out.jsonl'}", "eval_every=1", "eval_samples=2", "eval_limit=0",
            f"peer_timeout_s={PEER_TIMEOUT_S}", *extra]


def torchrun(world: int, *options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), *options]


def ended_after_fault(done_at: float, out: Path) -> tuple[float, int]:
    """(seconds from the fault to `done_at`, the faulty rank's pid), from the mark the rank wrote."""
    mark = json.loads((out.parent / f"{out.name}.fault").read_text())
    return done_at - mark["time"], mark["pid"]


def reap(pid: int) -> None:
    """The stopped rank, if its launcher left it behind."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stopped_run(data: Path, out: Path, world: int, silent: int, fault: str, line: str, logged: int = 1) -> None:
    """Launch `world` ranks with FAULT=`fault` and check that every survivor says `line` once, within
    PEER_TIMEOUT_S + 60 s of the fault, and the launch ends non-zero with `logged` steps logged. The survivors' lines
    are read as they come; once every one has spoken, the stopped rank (which no SIGTERM reaches: torchrun would
    wait 30 s for it before its SIGKILL) is killed, so the launch ends at once."""
    launch = subprocess.Popen(torchrun(world, "--master_port", str(free_port())) + [str(SCRIPT)] + args(data, out),
                              env={**ENV, "FAULT": fault}, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    said, tail = [], []
    for text in launch.stderr:
        tail = (tail + [text])[-40:]
        if line in text:
            said.append(time.time())
            if len(said) == world - 1:
                break
    seconds, pid = ended_after_fault(said[-1] if said else time.time(), out)
    reap(pid)
    rest = launch.stderr.read()
    assert launch.wait(timeout=120) != 0
    assert len(said) == world - 1 and line not in rest, "".join(tail) + rest[-3000:]  # each survivor says it, once
    assert seconds <= PEER_TIMEOUT_S + 60, seconds
    assert len(metrics(out)) == logged  # step 1 was logged and saved; step 2 never finished (or was not saved)


@pytest.mark.parametrize("world", [2, 3])
def test_a_stopped_rank_stops_the_others_with_one_line_naming_it(data, world):
    silent = world - 1
    stopped_run(data, data / f"stopped{world}", world, silent, f"stop:{silent}:1",
                f"train: step 2, rollouts: rank {silent} made no progress for {PEER_TIMEOUT_S} s")


# (ranks, the stopped rank, the phase of step 2 it stops in): every phase of a step outside the rollouts' wait,
# where the others block in a collective, rank 0 (whose agent, not it, holds the store) among the stopped ones.
STALLS = [(2, 0, "score gather"), (3, 1, "update"), (2, 1, "hand-off"), (3, 0, "checkpoint"), (3, 0, "rollouts")]


@pytest.mark.parametrize("world,silent,phase", STALLS, ids=[f"{w}ranks-rank{r}-{p}" for w, r, p in STALLS])
def test_a_stall_in_any_phase_is_named_by_the_watchdog(data, world, silent, phase):
    """A rank stopped (SIGSTOP) as it enters a phase of step 2: every other rank's watchdog thread (its main thread
    is blocked in the phase's collective) names it and the phase in one line and ends its process."""
    stopped_run(data, data / f"stall{world}_{silent}_{phase.replace(' ', '_')}", world, silent,
                f"stop:{silent}:1:{phase}",
                f"train: step 2, {phase}: rank {silent} made no progress for {PEER_TIMEOUT_S} s",
                logged=2 if phase == "checkpoint" else 1)  # a step is logged before its checkpoint


def test_a_slow_but_live_rank_is_not_stopped_by_the_watchdog(data):
    """Rank 0's main thread spends 2.5 x peer_timeout_s as it enters every checkpoint (a long write), while rank 1
    waits in the checkpoint's barrier: the run ends normally, with every step logged."""
    out = data / "slow"
    done = subprocess.run(torchrun(2, "--master_port", str(free_port())) + [str(SCRIPT)] + args(data, out, steps=2),
                          env={**ENV, "SLOW": f"0:checkpoint:{2.5 * PEER_TIMEOUT_S}"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "made no progress" not in done.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_a_killed_rank_on_another_node_stops_this_one(data):
    """Two torchrun agents on one machine, one process each, as two nodes run (static rendezvous): the second
    node's worker dies; its agent ends, and the first node's worker, whom no launcher tells, stops itself."""
    out, port = data / "nodes", str(free_port())
    node = lambda rank: subprocess.Popen(  # noqa: E731
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
         "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, str(SCRIPT)]
        + args(data, out), env={**ENV, "FAULT": "kill:1:1"}, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    first, second = node(0), node(1)
    _, err1 = first.communicate(timeout=600)
    seconds, _ = ended_after_fault(time.time(), out)
    second.communicate(timeout=120)
    assert first.returncode != 0 and second.returncode != 0
    assert f"train: step 2, rollouts: rank 1 made no progress for {PEER_TIMEOUT_S} s" in err1, err1[-3000:]
    assert seconds <= PEER_TIMEOUT_S + 60, seconds


def test_a_restarted_group_resumes_from_its_checkpoint_as_if_never_stopped(data):
    """torchrun --max_restarts 1: rank 1 is killed in step 3's rollouts, after step 2's checkpoint; the agent
    restarts both workers, which resume from it (a new launch identity: the killed attempt's claims counter of step 3
    is still in the agent's store, and is not read). Every count (rewards, tokens, RoC, held-out) equals an
    uninterrupted run's, so each resumed step rolled out all its prompts once; losses and weights agree to float
    rounding, since which rank claims which rollout, and so the update's summation order, depends on timing."""
    plain, restarted = data / "plain", data / "restarted"
    for out, env in ((plain, {}), (restarted, {"FAULT": "kill:1:2"})):
        done = subprocess.run(torchrun(2, "--master_port", str(free_port()), "--max_restarts", "1")
                              + [str(SCRIPT)] + args(data, out, steps=4), env={**ENV, **env}, cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    assert (restarted.parent / "restarted.fault").exists()  # the fault happened
    assert "resumed from" in done.stdout + done.stderr
    assert [r["step"] for r in metrics(restarted)] == [1, 2, 3, 4]  # step 3 logged once, by the restarted group
    assert_same_metrics_and_weights(plain, restarted)


def test_samplers_that_differ_in_log_probs_give_no_gap_and_do_not_hang(data):
    """One rank's sampler gives log-probs and the other's none (schedule=static: each rank keeps rollouts of its own
    prompts, so both kinds are kept every step): the gap is not measured (no mismatch/* keys), on both ranks alike;
    a correction that needs them stops both with one line."""
    out = data / "mixed"
    static = ["schedule=static"]
    done = subprocess.run(torchrun(2, "--master_port", str(free_port())) + [str(SCRIPT)]
                          + args(data, out, steps=2, extra=static),
                          env={**ENV, "LOGPROBS_RANKS": "0"}, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(out)
    assert len(rows) == 2 and all(not any(k.startswith("mismatch/") for k in row) for row in rows), rows
    done = subprocess.run(torchrun(2, "--master_port", str(free_port())) + [str(SCRIPT)]
                          + args(data, data / "mixed_tis", steps=1, extra=static + ["mismatch_correction=tis"]),
                          env={**ENV, "LOGPROBS_RANKS": "0"}, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert done.stderr.count("mismatch_correction=tis needs the sampler's log-probs") == 2, done.stderr[-3000:]


def test_a_rank_with_only_fillers_measures_the_gap_with_the_others(data):
    """Three ranks, three prompts of 4 rollouts a step, groups of 2 and three mini-batches: each mini-batch holds
    one group's 2 kept rollouts, so one rank trains fillers only in each; with log-probs everywhere the gap is
    measured and logged, and the run ends; the saved step holds every rank's rollouts."""
    out = data / "fillers"
    done = subprocess.run(torchrun(3, "--master_port", str(free_port())) + [str(SCRIPT)]
                          + args(data, out, steps=2, extra=["prompts_per_step=3", "rollouts_per_prompt=4",
                                                            "group_size=2", "updates_per_step=3",
                                                            "save_rollouts_every=2"]),
                          env={**ENV, "LOGPROBS_RANKS": "all"}, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2, rows
    assert all(r["perf/update_filler_frac"] > 0 and "mismatch/logp_abs_diff_mean" in r for r in rows), rows
    saved = [json.loads(x) for x in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert [(r["problem_index"], r["sample"]) for r in saved] == [(g, i) for g in range(3) for i in range(4)]
    assert sum(r["kept"] for r in saved) == 6  # every rank's rollouts, in one file: RoC kept 2 of each group


def test_a_rank_with_another_update_plan_stops_every_rank_naming_it(data):
    """Rank 1 of 3 computes another update plan (one filler slot more): the plans' digests are compared before the
    update, and the ranks stop with one line naming rank 1, instead of hanging in the update's collectives."""
    done = subprocess.run(torchrun(3, "--master_port", str(free_port())) + [str(SCRIPT)]
                          + args(data, data / "altered", steps=1), env={**ENV, "ALTER_PLAN": "1"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "update plan: rank 1 computed another update plan than ranks 0, 2" in done.stderr, done.stderr[-3000:]
    assert "made no progress" not in done.stderr


def test_two_nodes_whose_restart_counts_differ_meet_on_one_attempt(data):
    """Two torchrun agents, one process each: node 1's worker exits before the group starts and its agent restarts
    it alone (TORCHELASTIC_RESTART_COUNT 1 there, 0 on node 0). The ranks agree on the attempt through the store,
    meet, and the run ends normally; a launch whose node 1 does not restart stops with one line naming rank 1
    within init_timeout_s."""
    out, port = data / "restart_counts", str(free_port())
    node = lambda rank, restarts, out, init: subprocess.Popen(  # noqa: E731
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(rank),
         "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, "--max_restarts",
         str(restarts), str(SCRIPT)] + args(data, out, steps=1, extra=[f"init_timeout_s={init}"]),
        env={**ENV, "EXIT_BEFORE_GROUP": "1"}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first, second = node(0, 0, out, 240), node(1, 1, out, 240)
    _, err0 = first.communicate(timeout=600)
    _, err1 = second.communicate(timeout=120)
    assert (out.parent / "restart_counts.early").read_text() == "0"  # node 1's first worker left, and came back
    assert first.returncode == 0 and second.returncode == 0, err0[-2000:] + err1[-2000:]
    assert [r["step"] for r in metrics(out)] == [1]
    out, port = data / "no_restart", str(free_port())
    first, second = node(0, 0, out, 20), node(1, 0, out, 20)
    _, err0 = first.communicate(timeout=300)
    second.communicate(timeout=120)
    assert first.returncode != 0
    assert "process group: attempt 1: rank(s) 1 did not join within 20 s" in err0, err0[-3000:]


def test_the_store_bench_counts_a_poll_s_operations_old_and_new():
    """bench/store_load.py on 4 clients: the old loop's poll is 3 + 3 peers' round trips, the new one's 4; the
    table's rows and the ratio line are printed."""
    done = subprocess.run([sys.executable, "bench/store_load.py", "--clients", "4", "--seconds", "1.0", "--poll",
                           "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {tuple(line.split()[:2]): line.split() for line in done.stdout.splitlines()[2:]}
    assert float(rows[("4", "old")][3]) == 6.0 and float(rows[("4", "new")][3]) == 4.0
    ratio = float(done.stdout.split("4 new/old store operations: ")[1].split()[0])
    assert 0.5 < ratio < 0.8  # 4 / 6, to the polls' timing
