"""One RL step's update (phases 7-8) at the report's scale, simulated: a plan, not a measurement.

    .venv/bin/python bench/update_schedule.py [--ranks 64 --prompts 512 --seed 0 --budget 49152]

Under FSDP every micro-batch is a collective step on every rank (each layer's all-gather, each reduce-scatter), so a
mini-batch costs the sum over its micro-batch slots of the slowest rank's slot. This script builds one step's kept
rollouts at the report's scale and prices three plans of its update:
- static, micro-batches of rollouts: each rank trains what it kept, `micro_batch_size` rollouts per micro-batch
  padded to the longest, every rank running the most micro-batches any rank has; a rank short of them runs a filler
  that is a full copy of a real rollout (the step's first) with its loss mask zeroed (the update before it planned
  by tokens);
- balanced, micro-batches of rollouts: the kept rollouts first spread over ranks by tokens (each rank keeps its own
  largest first while under the mean, the rest longest first to the least loaded rank), then cut as above;
- packed (update_plan.plan_update, what train.py runs): micro-batches of at most `--budget` tokens, the rollouts
  partitioned over ranks x slots by tokens (LPT) so every rank has the same number of slots of about the same
  tokens; fillers of two tokens; laid out as update_plan.layout_for says (under sdpa rows about as wide as the longest
  rollout, every rank's row count within one of the others'; `--attention flash` one row a micro-batch).
`static` (packed, each rank its own) is printed too: schedule=static under the packed plan.

The step: B prompts x 2G rollouts with bench/rollout_schedule.py's length model (a per-prompt log-normal median,
rollouts log-normal around it, capped at the budget), half the groups dropped as equal (at random), G kept per group
(at random), each rollout held by the rank that sampled it in that script's simulation of the rollout phase (static
shares for the static plans, schedule.py's claims for the others). One optimizer step per RL step (the shipped
configs' updates_per_step), so one mini-batch.

Costs (each a choice, printed above the table), per slot on each rank, for the config's model on an H200:
- tokens: 8 x params FLOPs per token (forward 2, backward 4, the checkpointed forward again 2) at the peak bf16
  rate, for every token forwarded (padding and fillers included);
- attention: 4 x layers x heads x head_dim x n^2 FLOPs per attended block of n tokens (QK^T and AV, forward and
  backward and recompute, the causal half), a row's full square under sdpa (its mask keeps sequences apart, the
  kernel computes every pair), each sequence's own under flash attention's varlen kernels;
- collectives: the slot's all-gather of the bf16 weights and reduce-scatter of the fp32 gradients within a node of 8
  over NVLink, not overlapped (a fixed cost per slot);
and the slot takes as long as its slowest rank. Peak rates make every second optimistic by about the same factor;
the plans are what is compared.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import rollout_schedule  # noqa: E402
from tools import memory_plan  # noqa: E402

NVLINK = 450e9  # bytes/s one way per H200 (NVIDIA's datasheet: 900 GB/s NVLink, both directions)


def kept_step(rng, lengths: np.ndarray, keep: int) -> list[tuple[int, int]]:
    """(prompt, rollout) of the kept rollouts: half of the prompts' groups dropped at random, `keep` of each other
    group's rollouts at random."""
    prompts, rollouts = lengths.shape
    groups = sorted(rng.choice(prompts, size=prompts // 2, replace=False).tolist())
    return [(g, int(i)) for g in groups for i in sorted(rng.choice(rollouts, size=keep, replace=False).tolist())]


def owners_of(assignment: list[list[int]], prompts: int) -> list[int]:
    """prompt -> the rank that rolled it out, from rollout_schedule.simulate's per-engine prompt lists."""
    owner = [0] * prompts
    for rank, mine in enumerate(assignment):
        for p in mine:
            owner[p] = rank
    return owner


def spread_by_tokens(tokens: list[int], owners: list[int], world: int) -> list[int]:
    """The balanced update before it planned micro-batch slots: each rank keeps its own rollouts largest first while
    it stays under the mean load (its first always), the rest go largest first to the least loaded rank."""
    order = sorted(range(len(tokens)), key=lambda i: -tokens[i])
    mean, load, dest, pool = sum(tokens) / world, [0] * world, list(owners), []
    for i in order:
        r = owners[i]
        if load[r] == 0 or load[r] + tokens[i] <= mean:
            load[r] += tokens[i]
        else:
            pool.append(i)
    for i in pool:
        dest[i] = min(range(world), key=lambda q: (load[q], q))
        load[dest[i]] += tokens[i]
    return dest


def count_plan(tokens: list[int], dest: list[int], world: int, size: int) -> list[list]:
    """Micro-batches of `size` rollouts, each rank's sorted by length, padded, slot s = each rank's s-th (or a
    filler)."""
    from plumbing.update_plan import MicroBatch, as_micro_batch
    per_rank = [sorted((i for i in range(len(tokens)) if dest[i] == r), key=lambda i: tokens[i]) for r in range(world)]
    chunks = [[as_micro_batch(m[j:j + size], tokens, "padded") for j in range(0, len(m), size)] for m in per_rank]
    depth = max(len(c) for c in chunks)
    return [[c[s] if s < len(c) else MicroBatch([], 0) for c in chunks] for s in range(depth)]


class Costs:
    """Seconds of one rank's part of a slot: a x tokens + b x attended pairs + c (see the module docstring)."""

    def __init__(self, shape: memory_plan.Shape, flops: float, shard: int = 8):
        self.a = 8 * shape.params / flops
        self.b = 4 * shape.layers * shape.heads * shape.head_dim / flops
        collective = (memory_plan.COMPUTE_BYTES + memory_plan.MASTER_BYTES) * shape.params * (shard - 1) / shard
        self.c = collective / NVLINK

    def seconds(self, tokens: int, pairs: float) -> float:
        return self.a * tokens + self.b * pairs + self.c


def price(plan: list[list], tokens: list[int], one_row: bool, filler: int, costs: Costs) -> dict:
    """A plan's lockstep (slots of update_plan.MicroBatch): useful tokens / (ranks x sum over slots of the largest
    part's forwarded tokens), the shares of padding and fillers in those token slots, and the update's seconds
    (each slot its slowest part). Attended pairs: each row's full square (padded rows, and packed rows under sdpa),
    or each sequence's own in one row (flash attention's varlen kernels). filler: a filler's tokens."""
    world = len(plan[0])
    useful = pad = fill = lockstep = seconds = 0
    for slot in plan:
        forwarded, times = [], []
        for part in slot:
            lengths = [tokens[i] for i in part.items()]
            if not lengths:
                n, pairs = filler, filler ** 2 / 2
                fill += n
            else:
                n = part.forwarded()
                pairs = sum(x ** 2 for x in lengths) / 2 if one_row else len(part.rows) * part.width ** 2 / 2
                useful += sum(lengths)
                pad += n - sum(lengths)
            forwarded.append(n)
            times.append(costs.seconds(n, pairs))
        lockstep += max(forwarded)
        seconds += max(times)
    total = world * lockstep
    return {"slots": len(plan), "eff": useful / total, "pad": pad / total, "filler": fill / total, "s": seconds}


def simulate_step(args, seed: int, shape, kv_tokens: float, decode) -> list[tuple[str, dict]]:
    from plumbing import update_plan
    rng = np.random.default_rng(seed)
    lengths = rollout_schedule.sample_lengths(rng, args.prompts, args.rollouts, args.response_budget,
                                              args.median_tokens, args.prompt_sigma, args.rollout_sigma)
    kept = kept_step(rng, lengths, args.rollouts // 2)
    tokens = [int(lengths[g, i]) + args.prompt_tokens for g, i in kept]
    kw = dict(prompt_tokens=args.prompt_tokens)
    static_owner = owners_of(rollout_schedule.simulate(lengths, args.ranks, kv_tokens, decode, "static", **kw)
                             ["prompts"], args.prompts)
    claimed_owner = owners_of(rollout_schedule.simulate(lengths, args.ranks, kv_tokens, decode, "dynamic",
                                                        max_unfinished=args.slots, **kw)["prompts"], args.prompts)
    home = {"static": [static_owner[g] for g, _ in kept], "balanced": [claimed_owner[g] for g, _ in kept]}
    costs = Costs(shape, args.tflops * 1e12)
    first = tokens[0]  # the old filler: a copy of the step's first rollout
    one_row = args.attention == "flash"
    rows = []
    rows.append(("static, micro-batches of rollouts", price(count_plan(
        tokens, home["static"], args.ranks, args.micro_batch), tokens, False, first, costs)))
    rows.append(("balanced, micro-batches of rollouts", price(count_plan(
        tokens, spread_by_tokens(tokens, home["balanced"], args.ranks), args.ranks, args.micro_batch), tokens,
        False, first, costs)))
    layout = update_plan.layout_for(args.budget, one_row)
    for name, spread, owner in (("static, packed", False, home["static"]),
                                ("balanced, packed (train.py)", True, home["balanced"])):
        plan = update_plan.plan_update(tokens, owner, [0] * len(tokens), 1, args.ranks, args.budget, 1, spread,
                                    layout)[0]
        rows.append((name, price(plan, tokens, one_row, update_plan.FILLER_TOKENS, costs)))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/qwen3-14b/stage2.yaml",
                    help="training config: model shape, engine, step sizes, token budget, micro_batch_size")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--prompts", type=int, help="prompts per step (default: the config's)")
    ap.add_argument("--rollouts", type=int, help="rollouts per prompt, 2G (default: the config's)")
    ap.add_argument("--budget", type=int, help="tokens per micro-batch (default: the config's)")
    ap.add_argument("--micro-batch", type=int, default=1, help="rollouts per micro-batch of the unpacked plans")
    ap.add_argument("--attention", choices=["sdpa", "flash"], default="sdpa")
    ap.add_argument("--seed", type=int, nargs="+", default=[0])
    ap.add_argument("--median-tokens", type=float, default=3500.0)
    ap.add_argument("--prompt-sigma", type=float, default=0.6)
    ap.add_argument("--rollout-sigma", type=float, default=0.5)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--tflops", type=float, default=rollout_schedule.H200_BF16_FLOPS / 1e12)
    args = ap.parse_args(argv)

    import train
    from plumbing.config import load_config
    path = Path(args.config)
    cfg = load_config(train.TrainConfig, [path if path.is_file() else ROOT / path])
    shape, kv_tokens, sizes = rollout_schedule.engine_plan(args.config)
    args.prompts, args.rollouts = args.prompts or sizes["prompts"], args.rollouts or sizes["rollouts"]
    args.response_budget, args.slots = sizes["budget"], sizes["slots"]
    args.budget = args.budget or cfg.max_tokens_per_micro_batch
    if not args.budget:
        raise SystemExit(f"{args.config} cuts micro-batches by count (max_tokens_per_micro_batch: 0): give --budget")
    decode = rollout_schedule.decode_cost(shape)
    costs = Costs(shape, args.tflops * 1e12)
    print(f"One RL step's update, simulated (a plan, not a measurement); config {args.config}")
    print(f"  step       {args.ranks} ranks; {args.prompts} prompts x {args.rollouts} rollouts, half the groups "
          f"dropped, {args.rollouts // 2} kept per group ({args.prompts // 2 * args.rollouts // 2:,} rollouts), "
          f"lengths as bench/rollout_schedule.py draws them (budget {args.response_budget:,}, prompt "
          f"{args.prompt_tokens} tokens), one mini-batch")
    print(f"  plans      unpacked: {args.micro_batch} rollout(s) per micro-batch, padded, fillers a copy of a real "
          f"rollout; packed: at most {args.budget:,} tokens per micro-batch, {args.attention} layout, fillers "
          f"of 2 tokens")
    print(f"  costs      per slot and rank: {costs.a * 1e9:.2f} s per 1e9 tokens ({shape.params / 1e9:.1f}B params, "
          f"8 FLOPs/param/token) + {costs.b * 1e12:.3f} s per 1e12 attended pairs + {costs.c:.3f} s of collectives "
          f"(bf16 gather + fp32 reduce-scatter over 8 GPUs at {NVLINK / 1e9:.0f} GB/s); {args.tflops:g} TFLOP/s; "
          f"a slot lasts as long as its slowest rank")
    print()
    print(f"{'seed':>4}  {'plan':<38}{'slots':>7}{'lockstep eff':>14}{'padding':>9}{'fillers':>9}{'update s':>10}")
    for seed in args.seed:
        rows = simulate_step(args, seed, shape, kv_tokens, decode)
        for name, r in rows:
            print(f"{seed:>4}  {name:<38}{r['slots']:>7}{r['eff']:>14.3f}{r['pad']:>9.1%}{r['filler']:>9.1%}"
                  f"{r['s']:>10.1f}")
        new, old = rows[-1][1], rows[0][1]
        print(f"{seed:>4}  packed and balanced: lockstep efficiency {new['eff']:.3f} (the aim: >= 0.90), update "
              f"{old['s'] / new['s']:.2f}x faster than static with micro-batches of rollouts")


if __name__ == "__main__":
    main()
