"""The rollout scheduler measured: train.py on 2 and 3 CPU processes (torchrun, gloo), schedule=static against
schedule=balanced claiming whole prompts (claim_size = rollouts per prompt), pairs (claim_size 2) and single
rollouts (claim_size 1), side by side in one run, on a step whose prompts are skewed (half of them long); with
--rules, the two claim rules instead (claim_rule count against free_kv, single rollouts).

    .venv/bin/python bench/rollout_balance.py [--steps 6 --prompts 12 --rollouts 8 --slots 4 --long 288 --short 24]
    .venv/bin/python bench/rollout_balance.py --rules --worlds 2   # claim_rule count against free_kv, ABBA

By default a prompt has more rollouts than an engine runs at once (8 against 4), as at the report's scale (2G = 32
rollouts a prompt against 24 a 14B engine runs, configs/qwen3-14b): a long prompt claimed whole then decodes in
waves on one rank. `--rollouts 4 --slots 8 --prompts 24` is the other shape, a prompt well inside one engine.

The work is real where the scheduler acts: train.py's own step, the tiny model decoding in samplers/hf.py
(rollout_batch_size rollouts at a time per rank), claims through torchrun's store, the update's forward and backward
under DDP. Two things are arranged so that the step has the shape of a real one: every request runs its whole budget
(no stop token), a long prompt's budget being `--long` tokens and a short one's `--short`; and the reward is a coin
(crc32 of the rollout's text), so that groups keep rollouts and the update has work. Each step's prompts are
`prompt_indices`'s draw (every problem once, in a new order), the same for both schedules. Printed per setting, the mean over the steps after the first
(warm-up): the step time, the slowest rank's rollout time, the share of rollout time ranks waited for the slowest
(`perf/rollout_wait_frac`), the update's lockstep efficiency (`perf/update_lockstep_eff`), and the update time.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LONG_MARK = "LONG"
COLUMNS = [("step s", "perf/step_s"), ("rollout s", "perf/rollout_max_s"), ("rollout wait", "perf/rollout_wait_frac"),
           ("update eff", "perf/update_lockstep_eff"), ("update s", "perf/update_s")]


def budget_sampler(train, long: int, short: int) -> None:
    """train.py's sampler runs every request to its budget: `long` tokens for a prompt that says LONG_MARK, `short`
    otherwise (no stop token)."""
    from samplers.hf import HFSampler

    class BudgetSampler(HFSampler):
        def add(self, key, prompt, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
            cap = long if LONG_MARK in self.tokenizer.decode(prompt[:200]) else short
            super().add(key, prompt, min(max_new_tokens, cap), temperature, top_p)

    from plumbing import rl_stage
    rl_stage.make_sampler = lambda cfg, model, tokenizer: BudgetSampler(model, tokenizer, cfg.rollout_batch_size,
                                                                        stop_ids=[])


def coin_reward(train) -> None:
    """train.py's reward becomes a coin: crc32 of the rollout's text, odd or even."""
    def coin(trajs, golds):
        for t in trajs:
            t.reward = float(zlib.crc32(t.text.encode()) % 2)
        return [SimpleNamespace(correct=t.reward == 1.0, timed_out=False) for t in trajs]
    train.score_trajectories = coin


def skewed_problems(n: int) -> list[dict]:
    """n problems, every other one LONG_MARK."""
    return [{"problem": f"{LONG_MARK if i % 2 else 'short'} problem {i}: 1+{i}?", "answer": str(i + 1)}
            for i in range(n)]


def worker(argv: list[str], long: int, short: int) -> None:
    """Inside torchrun: train.main with the budget-by-prompt sampler and the coin reward."""
    import train
    budget_sampler(train, long, short)
    coin_reward(train)
    train.main(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# printed name -> (schedule, claim_size; None: a whole prompt's rollouts, claim_rule)
SETTINGS = {"static": ("static", None, "count"), "prompts": ("balanced", None, "count"),
            "pairs": ("balanced", 2, "count"), "rollouts": ("balanced", 1, "count")}
# --rules: the two claim rules side by side, single rollouts a claim (schedule.CLAIM_RULES)
RULES = {"count": ("balanced", 1, "count"), "free_kv": ("balanced", 1, "free_kv")}


def run(root: Path, world: int, name: str, args, tag: str = "") -> dict:
    """One setting's run of train.py on `world` processes in its own out_dir (a run in an old one would resume):
    the mean of each column over the steps after the first."""
    schedule, claim_size, rule = {**SETTINGS, **RULES}[name]
    claim_size = claim_size or args.rollouts
    out = root / f"{name}{world}{tag}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(free_port()), str(Path(__file__).resolve()), "--worker", "--long", str(args.long), "--short",
           str(args.short), "--", "configs/tiny/stage1.yaml", f"model_path={root / 'base'}",
           f"data=[{root / 'train.jsonl'}]", f"out_dir={out}", f"schedule={schedule}", f"claim_size={claim_size}", f"claim_rule={rule}",
           f"steps={args.steps}",
           f"prompts_per_step={args.prompts}", f"rollouts_per_prompt={args.rollouts}", f"group_size={args.rollouts // 2}",
           f"rollout_batch_size={args.slots}",
           f"max_response_tokens={args.long}", "max_turns=1", "eval_data=null",
           "eval_every=0", f"save_every={args.steps}", "torch_threads=1", "tool_workers=1", "log_every=1000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} on {world} processes failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return {key: sum(r[key] for r in rows) / len(rows) for key in [k for _, k in COLUMNS] + ["perf/rollout_s"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="RL steps per run (the first is not counted)")
    p.add_argument("--prompts", type=int, default=12, help="prompts per step, half of them long: every problem once")
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per prompt (2G; RoC keeps half)")
    p.add_argument("--long", type=int, default=288, help="tokens every rollout of a long prompt decodes")
    p.add_argument("--short", type=int, default=24, help="tokens every rollout of a short prompt decodes")
    p.add_argument("--slots", type=int, default=4, help="rollout_batch_size: rollouts a rank runs at once")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--rules", action="store_true", help="the claim rules instead: count (< --slots unfinished) "
                   "against free_kv (the engine has a free slot), single-rollout claims")
    p.add_argument("--rounds", type=int, default=2, help="--rules: runs of each rule, in ABBA order (ABBA...), "
                   "averaged: a run that follows another runs slower on a VM, whichever rule it is")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.worker:
        return worker([a for a in rest if a != "--"], args.long, args.short)
    from plumbing.data import write_jsonl
    from tiny.model import build_tiny
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_tiny(root / "base", max_positions=512)
        write_jsonl(root / "train.jsonl", skewed_problems(args.prompts))
        print(f"tiny model, {args.prompts} prompts x {args.rollouts} rollouts a step, half LONG ({args.long} tokens) and half short "
              f"({args.short}), {args.slots} rollouts at a time per rank, {args.steps - 1} steps counted")
        if args.rules:
            return compare_rules(root, args)
        print("claims: static = fixed shares; prompts = balanced, whole prompts; pairs = balanced, 2 rollouts; "
              "rollouts = balanced, single rollouts")
        print(f"{'processes':>9} {'claims':>9} " + " ".join(f"{name:>12}" for name, _ in COLUMNS))
        for world in args.worlds:
            results = {name: run(root, world, name, args) for name in SETTINGS}
            for name, r in results.items():
                print(f"{world:>9} {name:>9} " + " ".join(
                    f"{r[k]:>11.1%} " if k.endswith(("frac", "eff")) else f"{r[k]:>12.2f}" for _, k in COLUMNS))
            wait = {name: r["perf/rollout_wait_frac"] for name, r in results.items()}
            s, b = results["static"], results["rollouts"]
            print(f"{world:>9} {'ratio':>9} {s['perf/step_s'] / b['perf/step_s']:>11.2f}x  (static / rollouts step "
                  f"time); rollout wait {wait['rollouts'] / max(wait['static'], 1e-9):.2f} of static's, "
                  f"{wait['rollouts'] / max(wait['prompts'], 1e-9):.2f} of whole prompts'; pairs "
                  f"{wait['pairs'] / max(wait['static'], 1e-9):.2f} and {wait['pairs'] / max(wait['prompts'], 1e-9):.2f}")


def abba(names: list[str], rounds: int) -> list[str]:
    """The order of `rounds` runs of each name, every other round reversed (A B B A A B ...): a drift over the
    runs (a VM that slows as it stays busy, a cache that warms) falls on every name alike, which running all of
    A's then all of B's, or A before B each time, would charge to one of them."""
    return [name for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def mean_runs(runs: list[dict]) -> dict:
    """Each metric's mean over the runs of one setting."""
    return {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}


def compare_rules(root: Path, args) -> None:
    """The count rule against free_kv on the same steps, single-rollout claims, --rounds runs of each in ABBA
    order, averaged: the rollout phase's seconds (the slowest rank's), the share of it the ranks spent idle waiting
    for the slowest, and on 2 processes each rank's idle share (the other rank's time is 2 x the mean less the
    slowest's). The two rules do the same work here (on the hf sampler with one turn per rollout a rank's unfinished
    rollouts are its engine's requests): which one ran first decided the ratio when each ran once, count first."""
    print("claim rules: count = claim while fewer than --slots rollouts are unfinished; free_kv = while the engine "
          "(samplers/hf.py) has a free slot")
    print(f"{args.rounds} runs of each rule in ABBA order, averaged")
    print(f"{'processes':>9} {'claim rule':>10} {'rollout s':>10} {'mean idle':>10} {'each rank idle':>16} "
          f"{'step s':>8}")
    for world in args.worlds:
        runs = {name: [] for name in RULES}
        for name in abba(list(RULES), args.rounds):
            runs[name].append(run(root, world, name, args, tag=f"-{len(runs[name])}"))
        print(f"{world:>9} {'runs':>10} " + "  ".join(f"{name} " + " / ".join(f"{r['perf/rollout_max_s']:.2f}"
              for r in rs) for name, rs in runs.items()) + f"  (rollout s, order {' '.join(abba(list(RULES), args.rounds))})")
        results = {name: mean_runs(rs) for name, rs in runs.items()}
        for name, r in results.items():
            slowest, mean = r["perf/rollout_max_s"], r["perf/rollout_s"]
            each = f"0.0% / {(2 * slowest - 2 * mean) / slowest:.1%}" if world == 2 and slowest > 0 else "-"
            print(f"{world:>9} {name:>10} {slowest:>10.2f} {r['perf/rollout_wait_frac']:>10.1%} {each:>16} "
                  f"{r['perf/step_s']:>8.2f}")
        c, f = results["count"], results["free_kv"]
        print(f"{world:>9} {'ratio':>10} {c['perf/rollout_max_s'] / f['perf/rollout_max_s']:>9.2f}x  (count / free_kv "
              f"rollout seconds)")


if __name__ == "__main__":
    main()
