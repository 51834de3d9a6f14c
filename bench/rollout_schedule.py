"""One RL step's rollout phase at the report's scale, simulated: a plan, not a measurement.

    .venv/bin/python bench/rollout_schedule.py [--ranks 64 --prompts 512 --rollouts 32 --budget 12288 --seed 0]
    .venv/bin/python bench/rollout_schedule.py --trajectories runs/eval/trajectories.jsonl

The rStar2-Agent report (§3.2, its rollout scheduler) observes that assigning rollouts to inference engines
statically leaves engines idle: rollout lengths vary widely and the step waits for the slowest engine. This script
compares, for one step of B prompts x 2G rollouts on one colocated engine per rank:
- static: schedule=static's contiguous shares, prompt i on rank i // (B / ranks);
- the claim rules of schedule.py as train.py runs them: a rank claims the next `claim_size` unclaimed rollouts (in
  (prompt, index) order; the config's, 1 for the 14B recipe) while its engine has free KV cache and nothing it
  claimed waits (`free_kv`, the report's rule and the 14B configs'), or while fewer than rollout_batch_size of its
  rollouts are unfinished (`count`), until the step's rollouts run out; each under two admissions (below);
- the fluid bound: the work perfectly divisible: every engine at the steady state of a cache full of reservations
  for the whole step, all finishing together, or the longest rollout decoded alone if that takes longer;
- references: both rules claiming whole prompts (claim_size = 2G), and free KV less each running sequence's way to
  the step's mean length (a rule that would need that mean, e.g. from the last step).
With whole prompts the step cannot end before the last claimed group finishes on its one engine, and a hard
prompt's group can need more than one engine's KV cache, decoding in waves: the tail the table measures. Claims of
single rollouts spread a prompt over engines instead, and each engine that holds one of its rollouts reads the
prompt itself: the `prefills` column counts the (prompt, engine) pairs, and the line under the table what the
extra prompt reads cost against the decoded tokens (vLLM's prefix caching shares a prompt's blocks only within an
engine).

Assumptions (each a choice, printed above the table):
- lengths: per prompt a log-normal median (difficulty: hard prompts give long rollouts), per rollout a log-normal
  around it, capped at the budget (the capped ones are truncated rollouts); or drawn from a run's trajectories
  (`--trajectories`: eval.py's trajectories.jsonl, rows grouped by (benchmark, problem_index); a step's prompt is a
  random problem of the file and its rollouts random rows of that problem, both with replacement);
- every response token is decoded, one per sequence per engine step (tool responses, which are read in one
  prefill, and the tool's own latency are not modelled; prefill is free);
- an engine step takes a + b x running sequences + c x tokens in the KV cache seconds, the terms added (no overlap):
  a = reading the bf16 weights at the GPU's memory bandwidth, c = reading one token's keys and values, b = a
  sequence's 2 x params FLOPs at the GPU's peak bf16 rate. The model's shape and the KV cache's size (its tokens)
  come from tools/memory_plan.py for the config. Peak rates make every time optimistic by about the same factor; the
  idle fractions are what is compared;
- admission `ideal`: a sequence is admitted (first come, first served, head of line) only while its eventual KV
  need, prompt + response tokens, fits beside what the running sequences will need: no preemption, and the cache
  packed as well as knowing the lengths allows. Admission `vllm` (`VllmEngine`), as vLLM's v1 scheduler: admitted
  while what it holds now fits, the newest preempted when the cache runs out and recomputed when readmitted
  (its generated tokens charged at b each). At most max_num_seqs run. `--seeds N` prints the config's rule and the
  count rule under both, seed by seed, and closes with the config rule's worst step / fluid bound under `vllm`.
"""
import argparse
import heapq
import json
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import memory_plan  # noqa: E402

H200_BANDWIDTH = 4.8e12   # bytes/s, HBM3e (NVIDIA's H200 datasheet)
H200_BF16_FLOPS = 989e12  # dense bf16 tensor FLOP/s (NVIDIA's H200 datasheet, without sparsity)


@dataclass(frozen=True)
class DecodeCost:
    """Seconds per decode step of one engine: a + b x running sequences + c x tokens in its KV cache."""
    a: float
    b: float
    c: float

    def steps(self, k: int, n: int, kv: float) -> float:
        """Seconds for k steps of n sequences holding kv tokens at the first step (each step adds n tokens)."""
        return k * (self.a + self.b * n + self.c * kv) + self.c * n * k * (k - 1) / 2


def decode_cost(shape: memory_plan.Shape, bandwidth: float = H200_BANDWIDTH,
                flops: float = H200_BF16_FLOPS) -> DecodeCost:
    """A memory-bound decode step: the bf16 weights read once per step, each cached token's keys and values read
    once, and each sequence's forward (2 FLOPs per parameter) at the peak rate."""
    return DecodeCost(a=memory_plan.COMPUTE_BYTES * shape.params / bandwidth, b=2 * shape.params / flops,
                      c=shape.kv_bytes_per_token / bandwidth)


# ============================================================================ response lengths
def sample_lengths(rng: np.random.Generator, prompts: int, rollouts: int, budget: int, median: float = 3500.0,
                   prompt_sigma: float = 0.6, rollout_sigma: float = 0.5) -> np.ndarray:
    """(prompts, rollouts) response lengths: a prompt's median exp(N(log median, prompt_sigma)), its rollouts
    exp(N(log of that, rollout_sigma)), rounded, between 1 and the budget (the budget: truncated)."""
    centre = np.log(median) + prompt_sigma * rng.standard_normal((prompts, 1))
    lengths = np.exp(centre + rollout_sigma * rng.standard_normal((prompts, rollouts)))
    return np.clip(np.rint(lengths), 1, budget).astype(np.int64)


def lengths_from_trajectories(path, rng: np.random.Generator, prompts: int, rollouts: int,
                              budget: int) -> np.ndarray:
    """(prompts, rollouts) lengths drawn from a JSONL file's `response_tokens`: each prompt a random problem of the
    file, its rollouts random rows of that problem (with replacement), capped at the budget. Rows are grouped by
    (benchmark, problem_index); rows without problem_index form one group (no per-problem correlation)."""
    groups = defaultdict(list)
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            groups[(row.get("benchmark"), row.get("problem_index"))].append(int(row["response_tokens"]))
    if not groups:
        raise ValueError(f"{path}: no rows with response_tokens")
    pools = [np.array(v) for v in groups.values()]
    picked = rng.integers(len(pools), size=prompts)
    lengths = np.stack([rng.choice(pools[g], size=rollouts) for g in picked])
    return np.clip(lengths, 1, budget).astype(np.int64)


# ============================================================================ engines and policies
class Engine:
    """One rank's engine: its waiting queue (lengths, first come first served) and its running sequences, which it
    decodes from one finish to the next."""

    def __init__(self, capacity: float, max_seqs: int, prompt_tokens: int):
        self.capacity, self.max_seqs, self.prompt_tokens = capacity, max_seqs, prompt_tokens
        self.waiting: deque[int] = deque()
        self.length = np.zeros(0, np.int64)     # running sequences' response lengths
        self.remaining = np.zeros(0, np.int64)  # and the steps each has left
        self.kv = 0          # tokens in the KV cache now
        self.reserved = 0    # eventual KV need of the running sequences
        self.time = 0.0      # when the engine's last event happened
        self.busy = 0.0      # seconds spent decoding
        self.prompts: list[int] = []

    def take(self, prompt: int, lengths) -> None:
        self.prompts.append(prompt)
        self.waiting.extend(int(x) for x in lengths)

    def free(self) -> float:
        """KV tokens a claim rule sees as free: the cache less what the running sequences will eventually need."""
        return self.capacity - self.reserved

    def admit(self) -> None:
        """Start waiting sequences, in order, while the head's eventual need fits."""
        new = []
        while (self.waiting and len(self.length) + len(new) < self.max_seqs
               and self.reserved + self.prompt_tokens + self.waiting[0] <= self.capacity):
            n = self.waiting.popleft()
            new.append(n)
            self.reserved += self.prompt_tokens + n
            self.kv += self.prompt_tokens
        if new:
            self.length = np.concatenate([self.length, new])
            self.remaining = np.concatenate([self.remaining, new])

    def advance(self, cost: DecodeCost) -> bool:
        """Decode up to the next finish; False when nothing runs."""
        n = len(self.remaining)
        if n == 0:
            return False
        k = int(self.remaining.min())
        dt = cost.steps(k, n, self.kv)
        self.time += dt
        self.busy += dt
        self.remaining -= k
        self.kv += n * k
        done = self.remaining == 0
        freed = int(done.sum()) * self.prompt_tokens + int(self.length[done].sum())
        self.kv -= freed
        self.reserved -= freed
        self.length, self.remaining = self.length[~done], self.remaining[~done]
        return True


class VllmEngine(Engine):
    """An engine that admits as vLLM's v1 scheduler does: by the cache in use now, not by eventual lengths. A waiting
    sequence starts (first come, first served) while its prompt and what it has generated fit in the free cache; each
    decode step every running sequence needs one more token's room, and when the cache runs out the newest running
    sequence is preempted (vLLM's FCFS policy): its keys and values dropped, it goes back to the head of the queue
    with what it has generated, and is recomputed when readmitted, costing `b` x its generated tokens of prefill
    (the prompt's prefill stays free, as everywhere in this model)."""

    def __init__(self, capacity: float, max_seqs: int, prompt_tokens: int):
        super().__init__(capacity, max_seqs, prompt_tokens)
        self.waiting: deque[tuple[int, int]] = deque()  # (response length, tokens generated before a preemption)
        self.preemptions = 0
        self.recompute = 0  # generated tokens read again after preemptions

    def take(self, prompt: int, lengths) -> None:
        self.prompts.append(prompt)
        self.waiting.extend((int(x), 0) for x in lengths)

    growth = 0.0  # free() less what each sequence will still write up to this many response tokens (a reference)

    def free(self) -> float:
        """What vLLM's KV cache manager reports: free blocks now; with `growth`, less each running or waiting
        sequence's way to that many response tokens."""
        if not self.growth:
            return self.capacity - self.kv
        done = np.concatenate([self.length - self.remaining, [d for _, d in self.waiting]])
        waiting = len(self.waiting) * self.prompt_tokens + sum(d for _, d in self.waiting)
        return self.capacity - self.kv - waiting - np.maximum(self.growth - done, 0).sum()

    def admit(self) -> None:
        new = []
        while (self.waiting and len(self.length) + len(new) < self.max_seqs
               and self.kv + self.prompt_tokens + self.waiting[0][1] <= self.capacity):
            n, done = self.waiting.popleft()
            new.append((n, n - done))
            self.kv += self.prompt_tokens + done
            self.recompute += done
        if new:
            self.length = np.concatenate([self.length, [n for n, _ in new]])
            self.remaining = np.concatenate([self.remaining, [r for _, r in new]])

    def advance(self, cost: DecodeCost) -> bool:
        """Decode up to the next finish or the step where the cache runs out; then preempt the newest sequences
        until every running one has room for its next token. False when nothing runs."""
        while len(self.remaining) and self.kv + len(self.remaining) > self.capacity:
            n, done = int(self.length[-1]), int(self.length[-1] - self.remaining[-1])
            self.kv -= self.prompt_tokens + done
            self.waiting.appendleft((n, done))
            self.length, self.remaining = self.length[:-1], self.remaining[:-1]
            self.preemptions += 1
        n = len(self.remaining)
        if n == 0:
            return False
        k = int(min(self.remaining.min(), (self.capacity - self.kv) // n))
        redo = self.recompute * cost.b  # the preempted sequences' recompute, charged when they run again
        self.recompute = 0
        dt = cost.steps(k, n, self.kv) + redo
        self.time += dt
        self.busy += dt
        self.remaining -= k
        self.kv += n * k
        done = self.remaining == 0
        self.kv -= int(done.sum()) * self.prompt_tokens + int(self.length[done].sum())
        self.length, self.remaining = self.length[~done], self.remaining[~done]
        return True


ADMISSIONS = {"ideal": Engine, "vllm": VllmEngine}  # --admission: how an engine starts waiting sequences


def simulate(lengths: np.ndarray, ranks: int, capacity: float, cost: DecodeCost, policy: str = "dynamic",
             prompt_tokens: int = 0, max_seqs: int = memory_plan.VLLM_MAX_SEQS, min_free: float | None = None,
             max_unfinished: int | None = None, per_prompt: int = 1, admission: str = "ideal",
             growth: float = 0.0) -> dict:
    """One step's rollouts of `lengths` (claims, rollouts per claim) on `ranks` engines of `capacity` KV tokens;
    `per_prompt` consecutive claims are one prompt's rollouts.

    policy "static": claim i on rank i // (claims / ranks) from the start. "dynamic": an engine claims the next
    one whenever nothing it claimed waits and its unreserved KV is at least min_free tokens (default: one more
    rollout of any length, prompt_tokens + the longest length), or, given max_unfinished, whenever fewer of its
    sequences than that are waiting or running (schedule.py's rule, rollout_batch_size); engines at the same moment
    claim in turn, one prompt each. Events are handled in time order (a heap), jumping from one finish to the next.
    Returns per-engine `finish` and `busy` seconds, each engine's `prompts` (one entry per claim), `prefills` (the
    (prompt, engine) pairs), the step `time` and `idle` (the mean over engines of (step time - busy) / step time)."""
    n_prompts = len(lengths)
    if (lengths + prompt_tokens).max() > capacity:
        raise ValueError(f"a rollout of {int(lengths.max()) + prompt_tokens} tokens does not fit a KV cache of "
                         f"{capacity:,.0f} tokens")
    engines = [ADMISSIONS[admission](capacity, max_seqs, prompt_tokens) for _ in range(ranks)]
    for e in engines:
        e.growth = growth
    if policy == "static":
        if n_prompts % ranks:
            raise ValueError(f"{n_prompts} prompts do not divide over {ranks} ranks")
        share = n_prompts // ranks
        for i in range(n_prompts):
            engines[i // share].take(i // per_prompt, lengths[i])
        claimed = n_prompts
    elif policy == "dynamic":
        claimed = 0
        min_free = prompt_tokens + int(lengths.max()) if min_free is None else min_free
    else:
        raise ValueError(f"unknown policy {policy!r}")

    def wants(e: Engine) -> bool:
        if max_unfinished is not None:
            return claimed < n_prompts and len(e.waiting) + len(e.length) < max_unfinished
        return claimed < n_prompts and not e.waiting and e.free() >= min_free

    heap = [(0.0, r, r) for r in range(ranks)]  # (time, order, rank): ties go round the ranks in turn
    order = ranks
    while heap:
        _, _, r = heapq.heappop(heap)
        e = engines[r]
        if wants(e):
            e.take(claimed // per_prompt, lengths[claimed])
            claimed += 1
            e.admit()
        else:
            e.admit()
            if not e.advance(cost):
                continue  # nothing running, nothing to claim: done
        heapq.heappush(heap, (e.time, order, r))
        order += 1
    finish = np.array([e.time for e in engines])
    busy = np.array([e.busy for e in engines])
    step = float(finish.max())
    return {"finish": finish, "busy": busy, "prompts": [e.prompts for e in engines], "time": step,
            "prefills": sum(len(set(e.prompts)) for e in engines),
            "preemptions": sum(getattr(e, "preemptions", 0) for e in engines),
            "idle": float(np.mean((step - busy) / step)) if step > 0 else 0.0}


def ideal(lengths: np.ndarray, ranks: int, capacity: float, cost: DecodeCost, prompt_tokens: int = 0,
          max_seqs: int = memory_plan.VLLM_MAX_SEQS, admission: str = "ideal") -> dict:
    """The work perfectly divisible: each engine decodes 1/ranks of all tokens at the steady state of a full cache
    (as many sequences as the reservations allow: a sequence of length L holds prompt + L tokens for L steps, so
    capacity x sum L / sum L (prompt + L) run on average; at most max_seqs and the sequences per engine), each step
    costing a + b n + c n x the step-weighted mean cached tokens of a sequence. The step takes that, or the longest
    rollout decoded alone if that is longer (the others then idle). Packing never keeps a cache that full (the head
    of the queue waits for room), so the simulated policies stay above it. Same keys as `simulate` (no `prompts`)."""
    n_len = lengths.ravel().astype(float)
    p = prompt_tokens
    per_sequence_kv = (n_len * (p + (n_len - 1) / 2)).sum() / n_len.sum()
    # admission "vllm": the cache full of what the sequences hold now (a sequence of length L holds p + L / 2 tokens
    # on average over its L steps), not of their reservations
    held = per_sequence_kv if admission == "vllm" else (n_len * (p + n_len)).sum() / n_len.sum()
    n = min(capacity / held, max_seqs, n_len.size / ranks)
    fluid = n_len.sum() / ranks / n * (cost.a + cost.b * n + cost.c * n * per_sequence_kv)
    step = max(fluid, cost.steps(int(n_len.max()), 1, p))
    busy = np.full(ranks, fluid)
    return {"finish": busy, "busy": busy, "time": step, "idle": float(np.mean((step - busy) / step))}


# ============================================================================ the printed plan
def engine_plan(config_path: str) -> tuple[memory_plan.Shape, float, dict]:
    """(model shape, the vLLM engine's KV cache tokens, the config's step sizes) from a training config, by
    tools/memory_plan.py's rules. Loads train.TrainConfig (imports torch: a couple of seconds)."""
    import train
    from plumbing.config import load_config
    path = Path(config_path)
    cfg = load_config(train.TrainConfig, [path if path.is_file() else ROOT / path])
    found = memory_plan.shape_of(cfg.model_path, cfg.model_shape)
    if isinstance(found, str):
        raise SystemExit(found)
    shape = found[0]
    engine = memory_plan.vllm_engine(shape, fraction=cfg.vllm_gpu_memory_utilization, gpu_gb=cfg.gpu_memory_gb,
                                     tp=cfg.vllm_tensor_parallel_size, eager=cfg.vllm_enforce_eager)
    sizes = {"prompts": cfg.prompts_per_step, "rollouts": cfg.rollouts_per_prompt,
             "budget": cfg.max_response_tokens, "slots": cfg.rollout_batch_size, "claim": cfg.claim_size,
             "rule": cfg.claim_rule}
    return shape, engine["kv_cache_tokens"], sizes


def claim_kw(rule: str, slots: int, prompt_tokens: int) -> dict:
    """simulate's keywords for a claim rule (schedule.CLAIM_RULES): count (max_unfinished) or free_kv (nothing
    waiting and a free token of cache; under the ideal admission, free means unreserved)."""
    return {"max_unfinished": slots} if rule == "count" else {"min_free": 1}


def sweep(args, prompts: int, rollouts: int, budget: int, kv_tokens: float, cost: DecodeCost, slots: int,
          claim: int, rule: str) -> None:
    """Per seed: the config's claim rule and the count rule under both admissions, against the fluid bound; then the
    config's rule's worst step / fluid bound under the vLLM-like admission."""
    print(f"{args.ranks} ranks, {prompts} prompts x {rollouts} rollouts, budget {budget:,}, config {args.config}: "
          f"claim_rule {rule}, claims of {claim} (simulated; count: < {slots} unfinished rollouts per rank)")
    print(f"{'seed':>4}  {'claim rule':<26}{'admission':<11}{'step s':>9}{'step / fluid bound':>20}{'idle':>8}"
          f"{'preempted':>11}")
    cases = [(rule, claim, "vllm"), (rule, claim, "ideal")]
    cases += [("count", c, adm) for c in (claim, 2) for adm in ("vllm", "ideal") if ("count", c, adm) not in cases]
    worst, gaps = [], []
    for seed in range(args.seeds):
        lengths = sample_lengths(np.random.default_rng(seed), prompts, rollouts, budget, args.median_tokens,
                                 args.prompt_sigma, args.rollout_sigma)
        best = ideal(lengths, args.ranks, kv_tokens, cost, args.prompt_tokens, args.max_seqs)
        for i, (r, c, adm) in enumerate(cases):
            got = simulate(lengths.reshape(-1, c), args.ranks, kv_tokens, cost, "dynamic", args.prompt_tokens,
                           args.max_seqs, per_prompt=rollouts // c, admission=adm,
                           **claim_kw(r, slots, args.prompt_tokens))
            name = f"{r} ({slots})" if r == "count" else r
            print(f"{seed:>4}  {f'{name}, claims of {c}':<26}{adm:<11}{got['time']:>9.1f}"
                  f"{got['time'] / best['time']:>19.2f}x{got['idle']:>8.1%}{got['preemptions']:>11,}")
            if i == 0:
                worst.append(got["time"] / best["time"])
                gaps.append((got["idle"] - best["idle"]) * 100)
        print(f"{seed:>4}  {'fluid bound':<26}{'':<11}{best['time']:>9.1f}{1:>19.2f}x{best['idle']:>8.1%}")
    print(f"claim_rule {rule}: idle at most {max(gaps):.1f} points above the fluid bound's (vllm admission)")
    print(f"step / fluid bound at most {max(worst):.2f}x over seeds 0-{args.seeds - 1} (vllm admission)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/qwen3-14b/stage2.yaml",
                    help="training config: model shape, engine KV cache, default step sizes")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--prompts", type=int, help="prompts per step (default: the config's)")
    ap.add_argument("--rollouts", type=int, help="rollouts per prompt, 2G (default: the config's)")
    ap.add_argument("--budget", type=int, help="max response tokens (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--median-tokens", type=float, default=3500.0, help="median of the per-prompt medians")
    ap.add_argument("--prompt-sigma", type=float, default=0.6, help="log-normal sigma across prompts")
    ap.add_argument("--rollout-sigma", type=float, default=0.5, help="log-normal sigma within a prompt")
    ap.add_argument("--trajectories", help="JSONL with response_tokens (and problem_index) to draw lengths from")
    ap.add_argument("--prompt-tokens", type=int, default=300, help="prompt tokens per sequence in the KV cache")
    ap.add_argument("--kv-tokens", type=float, help="KV cache tokens per engine (default: memory_plan's)")
    ap.add_argument("--max-seqs", type=int, default=memory_plan.VLLM_MAX_SEQS)
    ap.add_argument("--slots", type=int, help="schedule.py's claim limit, unfinished rollouts per rank (default: "
                    "the config's rollout_batch_size)")
    ap.add_argument("--claim", type=int, help="rollouts one claim takes in the balanced row (default: the config's "
                    "claim_size)")
    ap.add_argument("--rule", choices=["free_kv", "count"], help="the claim rule (default: the config's claim_rule)")
    ap.add_argument("--seeds", type=int, help="instead of one step's table: seeds 0..N-1, one line each (balanced "
                    "against whole-prompt claims and ideal)")
    ap.add_argument("--bandwidth-tbs", type=float, default=H200_BANDWIDTH / 1e12)
    ap.add_argument("--tflops", type=float, default=H200_BF16_FLOPS / 1e12)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    shape, kv_tokens, sizes = engine_plan(args.config)
    kv_tokens = args.kv_tokens or kv_tokens
    prompts, rollouts, budget = (args.prompts or sizes["prompts"], args.rollouts or sizes["rollouts"],
                                 args.budget or sizes["budget"])
    cost = decode_cost(shape, args.bandwidth_tbs * 1e12, args.tflops * 1e12)
    if args.seeds:
        return sweep(args, prompts, rollouts, budget, kv_tokens, cost, args.slots or sizes["slots"],
                     args.claim or sizes["claim"], args.rule or sizes["rule"])
    rng = np.random.default_rng(args.seed)
    if args.trajectories:
        lengths = lengths_from_trajectories(args.trajectories, rng, prompts, rollouts, budget)
        source = f"drawn from {args.trajectories}"
    else:
        lengths = sample_lengths(rng, prompts, rollouts, budget, args.median_tokens, args.prompt_sigma,
                                 args.rollout_sigma)
        source = (f"log-normal: prompt medians around {args.median_tokens:.0f} (sigma {args.prompt_sigma}), "
                  f"rollouts around theirs (sigma {args.rollout_sigma})")
    t1 = time.perf_counter()
    kw = dict(prompt_tokens=args.prompt_tokens, max_seqs=args.max_seqs)
    slots, claim = args.slots or sizes["slots"], args.claim or sizes["claim"]
    if rollouts % claim:
        raise SystemExit(f"--claim {claim} does not divide the {rollouts} rollouts of a prompt")

    rule = args.rule or sizes["rule"]

    def claimed(size, by, admission):
        return simulate(lengths.reshape(-1, size), args.ranks, kv_tokens, cost, "dynamic", per_prompt=rollouts // size,
                        admission=admission, **claim_kw(by, slots, args.prompt_tokens), **kw)
    ours = [(f"{by} ({slots}), claims of {claim}" if by == "count" else f"{by}, claims of {claim}", adm,
             claimed(claim, by, adm)) for by in dict.fromkeys([rule, "count", "free_kv"]) for adm in ADMISSIONS]
    rows = [("static (schedule=static)", "ideal", simulate(lengths, args.ranks, kv_tokens, cost, "static", **kw)),
            *sorted(ours, key=lambda row: row[1] != "vllm"),
            ("fluid bound", "", ideal(lengths, args.ranks, kv_tokens, cost, **kw)),
            ("ref: free_kv less mean growth", "vllm",
             simulate(lengths.reshape(-1, claim), args.ranks, kv_tokens, cost, "dynamic", per_prompt=rollouts // claim,
                      admission="vllm", min_free=args.prompt_tokens + lengths.mean(), growth=lengths.mean(), **kw)),
            ("ref: count, whole prompts", "ideal", claimed(rollouts, "count", "ideal")),
            ("ref: free_kv, whole prompts", "ideal", claimed(rollouts, "free_kv", "ideal"))]
    t2 = time.perf_counter()

    per_prompt = lengths.mean(axis=1)
    print(f"One RL step's rollouts, simulated (a plan, not a measurement); config {args.config}")
    print(f"  step       {args.ranks} ranks x 1 engine; {prompts} prompts x {rollouts} rollouts "
          f"({prompts * rollouts:,} sequences, static share {prompts / args.ranks:g} prompts per rank), "
          f"budget {budget:,} response tokens, seed {args.seed}")
    print(f"  lengths    {source}; mean {lengths.mean():,.0f}, median {np.median(lengths):,.0f}, "
          f"{(lengths >= budget).mean():.1%} truncated at the budget; prompt means from {per_prompt.min():,.0f} "
          f"to {per_prompt.max():,.0f}; {lengths.sum() / 1e6:.1f}M tokens in all")
    print(f"  engine     KV cache {kv_tokens:,.0f} tokens (memory_plan.vllm_engine for the config), prompt "
          f"{args.prompt_tokens} tokens per sequence, at most {args.max_seqs} sequences. Admission ideal: a sequence "
          f"starts when its eventual prompt + response fits beside the others' (no preemption); vllm: when its "
          f"prompt + what it generated fits now, the newest preempted and recomputed when the cache runs out")
    print(f"  decode     step = {cost.a * 1e3:.2f} ms + {cost.b * 1e6:.1f} us x sequences + {cost.c * 1e9:.1f} ns x "
          f"cached tokens: {shape.params / 1e9:.1f}B params, bf16 weights and {shape.kv_bytes_per_token:,} B/token "
          f"KV read at {args.bandwidth_tbs} TB/s, 2 FLOPs/param at {args.tflops:g} TFLOP/s; tool calls and prefill "
          f"free (a preempted sequence's recompute: {cost.b * 1e6:.1f} us per generated token)")
    print(f"  claims     schedule.py's rules, the next {claim} rollout(s) ((prompt, index) order) a claim: count while "
          f"fewer than {slots} of a rank's rollouts are unfinished (rollout_batch_size); free_kv while nothing it "
          f"claimed waits and its engine has free KV (the report's rule); the config's: {rule}. Reference: free KV "
          f"less each sequence's way to the mean length ({lengths.mean():,.0f}, e.g. the last step's), by vLLM's "
          f"admission")
    print()
    print(f"{'policy':<34}{'admission':<11}{'step s':>8}{'step / fluid bound':>20}{'idle':>7}{'slowest s':>11}"
          f"{'fastest s':>11}{'prefills':>10}{'preempted':>11}")
    fluid = rows[[name for name, _, _ in rows].index("fluid bound")][2]
    bound = fluid["time"]
    for name, adm, r in rows:
        tail = f"{r['prefills']:>10,}{r['preemptions']:>11,}" if "prefills" in r else ""
        print(f"{name:<34}{adm:<11}{r['time']:>8.1f}{r['time'] / bound:>19.2f}x{r['idle']:>7.1%}"
              f"{r['finish'].max():>11.1f}{r['finish'].min():>11.1f}" + tail)
    mine = rows[1][2]
    extra = (mine["prefills"] - prompts) * args.prompt_tokens
    print(f"prefix sharing: the {rule} row reads {mine['prefills'] - prompts:,} prompts more than one engine per "
          f"prompt would, {extra / 1e6:.2f}M prompt tokens prefilled beside {lengths.sum() / 1e6:.1f}M decoded "
          f"({extra / lengths.sum():.1%}; a prefill token costs a fraction of a decoded one)")
    print(f"claim_rule {rule} (vllm admission): step {mine['time'] / bound:.2f}x the fluid bound, idle "
          f"{(mine['idle'] - fluid['idle']) * 100:.1f} points above its")
    print(f"(lengths {t1 - t0:.1f} s with the config, simulation {t2 - t1:.1f} s)")


if __name__ == "__main__":
    main()
