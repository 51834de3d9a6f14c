"""The update's plan measured where it runs: train.py on 2 and 3 CPU processes, DDP (torchrun) and FSDP2 (accelerate
launch with tests/cpu_fsdp.py), the old plan against the new, side by side in one run, on steps whose rollouts are
skewed (half the prompts long).

    .venv/bin/python bench/update_plan.py [--steps 4 --prompts 12 --worlds 2 3 --backends ddp fsdp]

Plans (each a train.py config; the rest is configs/tiny/stage1.yaml with configs/tiny/rl.yaml's update):
- old: schedule=static, micro-batches of `micro_batch_size: 8` rollouts padded to their longest
  (max_tokens_per_micro_batch=0), and a filler that is a full copy of one of the rank's rollouts with its loss mask
  zeroed, as the update before the token plan ran it;
- static: each rank its own rollouts, packed into micro-batches of at most 2,048 tokens (the tiny config's budget);
- balanced (the default config): the same budget, the rollouts spread over ranks x micro-batch slots.
The step: `--prompts` prompts x 8 rollouts, half of the prompts long (every rollout decodes `--long` tokens) and half
short (`--short`), a coin for the reward (crc32 of the text) so that groups keep rollouts, G = 4 kept of each,
updates_per_step=2; the steps after the first are counted.

Efficiency is counted twice. `reported`: what train.py logs (perf/update_lockstep_eff, from its plan). `census`:
read from the model's forwards alone, by a hook on the prepared model that sees every forward that takes gradients:
its input's token slots (rows x width), and which of the sequences in it (blocks of position_ids, or of the
attention mask when padded) receive any gradient on their logits in the backward. The census's efficiency is the
tokens of those sequences / (ranks x the sum over the forwards, in the order every rank runs them, of the largest
rank's token slots). The old plan's reported value counts its fillers as two tokens, which they are not: its census
is the one to read.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))  # after the root: bench/code_tool.py is a benchmark, not the tool
PLANS = {"old": ["schedule=static", "max_tokens_per_micro_batch=0", "micro_batch_size=8"],
         "static": ["schedule=static", "max_tokens_per_micro_batch=2048"],
         "balanced": ["schedule=balanced", "max_tokens_per_micro_batch=2048"]}


# ============================================================================ inside each process
def census_hook(path: Path, step: list):
    """A forward hook (with kwargs) that appends, for every forward under autograd, {step, slots, useful} to path
    once its backward has run: slots = the input's rows x width, useful = the tokens of the sequences whose logits
    received any gradient."""
    import torch

    def blocks(kwargs) -> list[tuple[int, int, int]]:
        """(row, start, end) of each sequence of the input: from position_ids (a new block wherever the position
        does not follow the one before it) or from the attention mask (a padded row's tokens)."""
        if kwargs.get("position_ids") is not None:
            pos, out = kwargs["position_ids"].tolist(), []
            for r, row in enumerate(pos):
                start = 0
                for t in range(1, len(row) + 1):
                    if t == len(row) or row[t] != row[t - 1] + 1:
                        out.append((r, start, t))
                        start = t
            return out
        mask = kwargs["attention_mask"].tolist()
        return [(r, 0, sum(row)) for r, row in enumerate(mask)]

    def hook(module, args, kwargs, output):
        logits = output.logits
        if not (torch.is_grad_enabled() and logits.requires_grad):
            return
        slots, spans = kwargs["input_ids"].numel(), blocks(kwargs)

        def seen(grad):
            hit = grad.detach().abs().sum(-1) > 0  # (rows, width): positions whose logits take gradient
            useful = sum(e - s for r, s, e in spans if bool(hit[r, s:e].any()))
            with open(path, "a") as f:
                f.write(json.dumps({"step": step[0], "slots": slots, "useful": useful}) + "\n")
        logits.register_hook(seen)
    return hook


def worker(argv: list[str], plan: str, long: int, short: int) -> None:
    """Inside the launcher: train.main with the budget-by-prompt sampler, the coin reward, the census hook, and for
    the old plan its copy fillers."""
    import train
    from rollout_balance import budget_sampler, coin_reward

    budget_sampler(train, long, short)
    coin_reward(train)
    out = Path(next(a for a in argv if a.startswith("out_dir=")).split("=", 1)[1])
    rank, step = int(os.environ.get("RANK", 0)), [0]
    real_setup, real_step = train.setup, train.train_step

    def setup(cfg, *args):
        at, run = real_setup(cfg, *args)
        run.model.register_forward_hook(census_hook(out / f"census{rank}.jsonl", step), with_kwargs=True)
        return at, run

    def train_step(at, cfg, run):
        step[0] = at
        return real_step(at, cfg, run)
    train.setup, train.train_step = setup, train_step
    if plan == "old":
        copy_fillers(train)
    train.main(argv)


def copy_fillers(train) -> None:
    """The old plan's filler: a copy of one of this rank's rollouts of the step, its loss mask zeroed (the update
    before the token plan copied the step's first rollout to every rank), instead of two pad tokens."""
    from plumbing import batches
    from plumbing.update_plan import TrainRow
    real_work, first = train.update_work, {}

    def update_work(acc, scores, kept, local, *args, **kwargs):
        t = local[min(local)]
        first["row"] = TrainRow(t.prompt_ids, t.response_ids, [0] * len(t.response_ids), t.logprobs)
        return real_work(acc, scores, kept, local, *args, **kwargs)

    def filler_row(pad_id, measured):
        row = first["row"]
        return TrainRow(row.prompt_ids, row.response_ids, row.loss_mask, row.logprobs if measured else None)
    train.update_work, batches.filler_row = update_work, filler_row


# ============================================================================ the runs
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def census(out: Path, world: int, first: int) -> float:
    """The census efficiency of each step from `first` on, from every rank's census file, averaged over the steps
    (as the logged metric is)."""
    per_rank = [[json.loads(line) for line in (out / f"census{r}.jsonl").read_text().splitlines()]
                for r in range(world)]
    steps = sorted({x["step"] for rows in per_rank for x in rows if x["step"] >= first})
    effs = []
    for step in steps:
        mine = [[x for x in rows if x["step"] == step] for rows in per_rank]
        if len({len(rows) for rows in mine}) != 1:
            raise SystemExit(f"{out}: step {step}: the ranks ran different numbers of forwards: "
                             f"{[len(r) for r in mine]}")
        useful = sum(x["useful"] for rows in mine for x in rows)
        lockstep = sum(max(x["slots"] for x in forwards) for forwards in zip(*mine))
        effs.append(useful / (world * lockstep))
    return sum(effs) / len(effs)


def prepare(root: Path, prompts: int) -> Path:
    """The tiny base model and the skewed problems under root."""
    from plumbing.data import write_jsonl
    from rollout_balance import skewed_problems
    from tiny.model import build_tiny
    build_tiny(root / "base", max_positions=512)
    write_jsonl(root / "train.jsonl", skewed_problems(prompts))
    return root


def run(root: Path, world: int, backend: str, plan: str, args) -> dict:
    """One launch of train.py; the means over the counted steps of what it logged, and the census."""
    out = root / f"{backend}{world}-{plan}"
    me = [str(Path(__file__).resolve()), "--worker", "--plan", plan, "--long", str(args.long), "--short",
          str(args.short), "--"]
    if backend == "ddp":
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
                  str(free_port())] + me
    else:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "configs/accelerate/fsdp_1node_8gpu.yaml"), "--num_processes", str(world),
                  "--main_process_port", str(free_port()), str(ROOT / "tests/cpu_fsdp.py")] + me
    cmd = launch + ["configs/tiny/stage1.yaml", f"model_path={root / 'base'}", f"data=[{root / 'train.jsonl'}]",
                    f"out_dir={out}", f"steps={args.steps}", f"prompts_per_step={args.prompts}",
                    "rollouts_per_prompt=8", "group_size=4", "updates_per_step=2", f"rollout_batch_size={args.slots}",
                    f"max_response_tokens={args.long}", "max_turns=1", "eval_data=null", "eval_every=0",
                    f"save_every={args.steps}", "torch_threads=1", "tool_workers=1", "log_every=1000",
                    "mixed_precision=no"] + PLANS[plan]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{plan} on {world} {backend} processes failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    return {"update_s": mean("perf/update_s"), "reported": mean("perf/update_lockstep_eff"),
            "census": census(out, world, first=1), "slots": mean("perf/update_slots"),
            "pad": mean("perf/update_pad_frac")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="RL steps per run (the first is not counted)")
    p.add_argument("--prompts", type=int, default=12, help="prompts per step, half of them long")
    p.add_argument("--long", type=int, default=256, help="tokens every rollout of a long prompt decodes")
    p.add_argument("--short", type=int, default=32, help="tokens every rollout of a short prompt decodes")
    p.add_argument("--slots", type=int, default=16, help="rollout_batch_size: rollouts a rank runs at once")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    p.add_argument("--backends", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    p.add_argument("--plans", nargs="+", choices=list(PLANS), default=list(PLANS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.worker:
        return worker([a for a in rest if a != "--"], args.plan, args.long, args.short)
    with tempfile.TemporaryDirectory() as tmp:
        root = prepare(Path(tmp), args.prompts)
        print(f"tiny model, {args.prompts} prompts x 8 rollouts a step (G = 4 kept), half long ({args.long} tokens) "
              f"and half short ({args.short}), 2 updates a step, {args.steps - 1} steps counted, fp32")
        print(f"{'backend':>7} {'procs':>5} {'plan':>9} {'update s':>9} {'eff census':>11} {'eff reported':>13} "
              f"{'padding':>8} {'slots':>6}")
        for backend in args.backends:
            for world in args.worlds:
                results = {plan: run(root, world, backend, plan, args) for plan in args.plans}
                for plan, r in results.items():
                    reported = "n/a" if plan == "old" else f"{r['reported']:.3f}"
                    print(f"{backend:>7} {world:>5} {plan:>9} {r['update_s']:>9.2f} {r['census']:>11.3f} "
                          f"{reported:>13} {r['pad']:>8.1%} {r['slots']:>6.1f}")
                if "old" in results and "balanced" in results:
                    ratio = results["old"]["update_s"] / results["balanced"]["update_s"]
                    print(f"{backend:>7} {world:>5} {'ratio':>9} {ratio:>8.2f}x  (old plan's update seconds / "
                          "balanced's)")


if __name__ == "__main__":
    main()
