"""Who rolls out which prompt, and who trains on which rollout: the report's rollout scheduler (§3.2) across ranks,
and the plan of the update that every rank runs in lockstep.

One step's work is uneven: some prompts give rollouts of a few hundred tokens, others of the whole budget. With a
fixed share per rank, the rank whose prompts are hard decodes several times as many tokens as the one whose prompts
are easy, and every rank waits for it. The update has the same shape, and under FSDP (and DDP) it runs in lockstep:
every micro-batch is a collective step on every rank (each layer's all-gather and reduce-scatter), so a mini-batch
costs the sum over its micro-batch slots of the slowest rank's slot, not the largest rank's total. The config field
`schedule` (`SCHEDULES`) picks how both are shared:

- Claiming (phase 2). The step's rollouts, in (prompt, index) order, sit behind one shared counter in the process
  group's store (the TCP store that torchrun and `accelerate launch` already run); a rank claims the next
  `claim_size` of them (`store.add(key, 1)`) whenever fewer than `capacity` of its rollouts are unfinished
  (`rollout_batch_size`: the requests its engine runs at once), until they run out. A rank whose rollouts finish
  early takes more; nobody holds work its engine cannot start; one prompt's rollouts may run on several ranks.
- Scores (before phases 4-6). Every rank gathers every rollout's few numbers (`gather_scores`: its place in the
  step, reward, the penalty's counts, its lengths; not its tokens), so the equal-group drop, Resample-on-Correct
  and the advantages (grpo_roc.select_step) are computed for the whole step, alike on every rank, whichever rank
  sampled a rollout.
- The update's plan (before phases 7-8, `plan_update`). Each mini-batch's kept rollouts are cut into micro-batches
  of at most `max_tokens_per_micro_batch` tokens (or of `micro_batch_size` rollouts when that is 0), and every rank
  gets the same number of micro-batch slots with about the same tokens in each slot. How a micro-batch is laid out
  decides what it costs (`layout_for`): under flash attention one packed row, partitioned over ranks x slots by
  tokens, longest processing time first; under sdpa or eager attention rows about as wide as the longest rollout
  (every pair of a row's tokens is scored), filled best fit and dealt to ranks in counts at most one apart. Under
  `balanced` the rollouts go wherever the plan puts them (each part to the rank that already holds most of its
  tokens); under `static` each rank keeps its own, packed the same way, so the two differ only in where rollouts
  train. A rank with nothing for a slot runs a filler, a two-token sequence built locally that trains nothing, so
  every rank joins every collective.
- The exchange (`exchange`). Each kept rollout the plan moves goes from the rank that sampled it straight to the
  one that trains it, as tensors (point-to-point): its token ids, loss mask and sampler log-probs; its advantage
  and mini-batch every rank knows already. Dropped rollouts never move.
The loss divides by the global token count, so where a rollout is trained, and with which others, changes nothing
but float rounding.

What the report describes and what this does: the report's scheduler dispatches single requests to engines by their
free KV cache, from one controller. Here there is no controller: each rank claims a few rollouts when its count of
unfinished rollouts leaves room, and the engine (vLLM, or samplers/hf.py) packs its own KV cache. On one process
there is nobody to share with: the rank claims the whole step at once, exactly what the static schedule does.

Results do not depend on which rank rolled a rollout out: the step's prompts are `train.prompt_indices`, RoC's
generators are seeded by the group's position in the step, mini-batches are cut by that position
(`train.minibatch_of`), and every turn samples from its own seed (`rollout_seed`). What still differs between runs on
several processes is which requests share a decode step, which on a GPU changes the forward's float rounding.
"""
import bisect
import heapq
import math
from dataclasses import dataclass

import torch

import accel


# ============================================================================ phase 1: claims
def static_claims(n_slots: int, per_group: int, rank: int, world: int):
    """The fixed schedule: the slots of this rank's contiguous share of the step's groups, all at the first call."""
    groups = n_slots // per_group
    share = list(range(rank * groups // world * per_group, (rank + 1) * groups // world * per_group))

    def claim(running: int) -> list[int]:
        out, share[:] = share[:], []
        return out
    return claim


def store_claims(store, key: str, n_slots: int, claim_size: int, capacity: float):
    """Claims through a shared counter: claim(running) -> the step slots taken now, `claim_size` consecutive ones a
    claim, claim after claim while `running` (this rank's unfinished rollouts) plus what it has just taken stays
    under `capacity`; [] once the counter has passed the last claim (the store is not asked again)."""
    claims, done = -(-n_slots // claim_size), False

    def claim(running: int) -> list[int]:
        nonlocal done
        out = []
        while not done and running + len(out) < capacity:
            c = store.add(key, 1) - 1  # add returns the counter after adding: every value goes to one rank
            if c >= claims:
                done = True
            else:
                out += range(c * claim_size, min((c + 1) * claim_size, n_slots))
        return out
    return claim


def rollout_seed(seed: int, step: int, slot: int, turn: int) -> int:
    """The sampling seed of one turn of one rollout, a function of (seed, step, slot, turn) only, so the engine that
    draws a rollout does not change its random numbers. 31 bits, as every sampler takes: a mix of (seed, step) in the
    high bits, slot x 64 + turn below them (distinct within a step for turns below 64)."""
    high = (seed * 1_000_003 + step * 10_007) % 1_021
    return (high * 2**21 + slot * 64 + turn) % 2**31


class Claims:
    """rollout()'s `more` for one step: claims slots with `take` (`static_claims` or `store_claims`), remembers
    each rollout's slot (`slots`: group position x per_group + index in the group, in the order of the
    trajectories) and returns its prompt; `seed(i, turn)` is the sampling seed of trajectory i's turn."""

    def __init__(self, take, prompts: list[str], per_group: int, step: int, seed: int, beat=lambda: None):
        self.take, self.prompts, self.per_group, self.slots = take, prompts, per_group, []
        self.step, self.base_seed, self.beat = step, seed, beat

    def __call__(self, running: int) -> list[str]:
        self.beat()  # asked after every engine step: this rank's heartbeat (accel.Peers)
        got = self.take(running)
        self.slots += got
        return [self.prompts[s // self.per_group] for s in got]

    def seed(self, i: int, turn: int) -> int:
        return rollout_seed(self.base_seed, self.step, self.slots[i], turn)


# config `schedule` -> (how a rank claims the step's rollouts, whether the update's plan moves rollouts)
SCHEDULES = {"balanced": ("store", True), "static": ("static", False)}


def step_claims(schedule: str, step: int, prompts: list[str], per_group: int, capacity: int, claim_size: int,
                seed: int, peers) -> Claims:
    """The claims of one step's rollouts (its B prompts x per_group, in step order) on this rank, for the config's
    schedule; `claim_size` rollouts a claim under `balanced`. peers: accel.Peers, started on this step (its store,
    the step's key under the launch's identity, the heartbeat)."""
    rank, world, n = peers.rank, peers.world, len(prompts) * per_group
    if SCHEDULES[schedule][0] == "static":
        take = static_claims(n, per_group, rank, world)
    elif world == 1:  # one engine: it takes the whole step at once, as the static schedule does
        take = store_claims(torch.distributed.HashStore(), "claims", n, claim_size, math.inf)
    else:
        take = store_claims(peers.store, peers.key("claims"), n, claim_size, capacity)
    return Claims(take, prompts, per_group, step, seed, peers.beat)


def wait_fraction(times: list[float]) -> float:
    """The share of the ranks' time spent waiting for the slowest one: sum(max - t) / (ranks x max)."""
    longest = max(times)
    return sum(longest - t for t in times) / (len(times) * longest) if longest > 0 else 0.0


# ============================================================================ scores: what every rank learns
@dataclass(frozen=True)
class Score:
    """One rollout's numbers, gathered from every rank: what phases 4-6 and the update's plan read."""
    slot: int             # its place in the step: group position x 2G + index in the group
    rank: int             # the rank that sampled it (and holds its tokens)
    reward: float
    tool_calls: int
    failed_calls: int
    answer_blocks: int
    turns: int
    prompt_tokens: int
    response_tokens: int
    sampled_tokens: int   # tokens under the loss mask (the policy's own)
    has_logprobs: bool    # the sampler gave its log-probs

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


def gather_scores(accelerator, slots: list[int], trajs: list) -> list[Score]:
    """Every rank's rollouts of the step as Scores, sorted by slot: one gather of a few numbers per rollout."""
    rows = torch.tensor([[s, t.reward, t.num_tool_calls, t.num_failed_tool_calls, t.num_answer_blocks, t.num_turns,
                          len(t.prompt_ids), len(t.response_ids), sum(t.loss_mask), t.logprobs is not None]
                         for s, t in zip(slots, trajs)], dtype=torch.float64).reshape(-1, 10)
    out = [Score(int(r[0]), rank, float(r[1]), *(int(x) for x in r[2:9]), bool(r[9]))
           for rank, part in enumerate(accel.all_gather_rows(accelerator, rows)) for r in part.tolist()]
    return sorted(out, key=lambda s: s.slot)


# ============================================================================ the update's plan (pure)
FILLER_TOKENS = 2  # a filler micro-batch: two tokens, no target trained


@dataclass
class MicroBatch:
    """One micro-batch as its tensors lay it out: rows of sequences end to end, every row `width` tokens, padding
    included. In a plan the rows hold item indices, in a RankWork TrainRows. No rows: a filler."""
    rows: list[list]
    width: int

    def forwarded(self) -> int:
        """Token slots the forward runs: rows x width (a filler: FILLER_TOKENS)."""
        return len(self.rows) * self.width if self.rows else FILLER_TOKENS

    def items(self) -> list:
        return [i for row in self.rows for i in row]


def layout_for(budget: int, one_row: bool) -> str:
    """How micro-batches are laid out as tensors.
    padded  (budget 0): micro-batches of `micro_batch_size` rollouts, one per row, padded to the longest.
    one_row (a budget, attention that keeps packed sequences apart at the cost of their own lengths only: flash
            attention's varlen kernels): every micro-batch one row of at most `budget` tokens.
    rows    (a budget, sdpa, eager or flex attention): these build a block-diagonal mask for a packed row and compute
            all of its row x row scores, so rows stay about as wide as the longest rollout and a micro-batch holds
            budget // width of them."""
    return "padded" if not budget else "one_row" if one_row else "rows"


def lpt_bins(items: list[int], tokens: list[int], count: int, budget: float) -> list[list[int]] | None:
    """Longest processing time first: items (largest first) each into the bin with the fewest tokens so far, `count`
    bins. None when an item would push a bin that already holds something past `budget` (so the least loaded bin
    cannot take it: more bins are needed). An item longer than the budget goes into an empty bin, alone."""
    bins, heap = [[] for _ in range(count)], [(0, b) for b in range(count)]
    for i in sorted(items, key=lambda i: (-tokens[i], i)):
        load, b = heapq.heappop(heap)
        if bins[b] and load + tokens[i] > budget:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + tokens[i], b))
    return bins


def token_bins(items: list[int], tokens: list[int], budget: int, multiple: int) -> list[list[int]]:
    """The fewest bins, a multiple of `multiple`, that an LPT partition fills within `budget` tokens each."""
    total = sum(tokens[i] for i in items)
    over = sum(tokens[i] > budget / 2 for i in items)  # no two of these share a bin
    k = multiple * max(1, math.ceil(total / (multiple * budget)), math.ceil(over / multiple))
    while (bins := lpt_bins(items, tokens, k, budget)) is None:
        k += multiple
    return bins


def count_bins(items: list[int], tokens: list[int], size: int, multiple: int) -> list[list[int]]:
    """Bins of at most `size` items, a multiple of `multiple` of them, the items sorted by length and cut into
    consecutive runs as even as the count allows (each padded micro-batch holds sequences of similar length)."""
    order = sorted(items, key=lambda i: (-tokens[i], i))
    k = multiple * max(1, math.ceil(len(order) / (multiple * size)))
    cuts = [len(order) * b // k for b in range(k + 1)]
    return [order[a:b] for a, b in zip(cuts, cuts[1:])]


def fit_rows(items: list[int], tokens: list[int], width: int) -> list[list[int]]:
    """Items laid end to end in rows of `width` tokens: longest first, each into the row it leaves least room in
    (best fit decreasing). An item longer than the width gets a row of its own."""
    rows, free = [], []  # free: sorted (room left, row)
    for i in sorted(items, key=lambda i: (-tokens[i], i)):
        k = bisect.bisect_left(free, (tokens[i], -1))
        if k == len(free):
            rows.append([i])
            room, r = width - tokens[i], len(rows) - 1
        else:
            room, r = free.pop(k)
            rows[r].append(i)
            room -= tokens[i]
        bisect.insort(free, (room, r))
    return rows


def deal(things: list, parts: int) -> list[list]:
    """things cut into `parts` consecutive runs whose sizes differ by at most one, the larger runs first."""
    q, extra = divmod(len(things), parts)
    cuts = [p * q + min(p, extra) for p in range(parts + 1)]
    return [things[a:b] for a, b in zip(cuts, cuts[1:])]


def rank_rows(rows: list[list[int]], owners: list[int], tokens: list[int], world: int) -> list[list[list[int]]]:
    """Rows to ranks, their counts as even as they go (at most one apart): each row, fullest first, to the rank
    that holds most of its tokens among those with room left."""
    base, extra = divmod(len(rows), world)
    held = [[] for _ in range(world)]
    for row in sorted(rows, key=lambda row: (-sum(tokens[i] for i in row), row)):
        free = [r for r in range(world) if len(held[r]) < base + (extra > 0)]
        r = max(free, key=lambda r: (sum(tokens[i] for i in row if owners[i] == r), -r))
        extra -= len(held[r]) == base
        held[r].append(row)
    return held


def row_widths(items: list[int], tokens: list[int], world: int, budget: int) -> list[int]:
    """The row widths worth trying for a mini-batch: the longest rollout, and each wider one (up to twice that and
    the budget) at which every rank's rows could hold the tokens exactly, m rows each. A wider row can even out the
    ranks' row counts, but it costs attention (its square under sdpa), hence the cap."""
    longest, total = max(tokens[i] for i in items), sum(tokens[i] for i in items)
    top = max(longest, min(budget, 2 * longest))
    widths, m = [longest], 1
    while (w := math.ceil(total / (world * m))) > longest:
        if w <= top:
            widths.append(w)
        m += 1
    return sorted(set(widths))


def row_plan(items: list[int], tokens: list[int], owners: list[int], world: int, budget: int,
             spread: bool) -> list[list[MicroBatch]]:
    """A mini-batch's slots in the `rows` layout: rows of one width (`row_widths`: the one whose most-loaded rank
    forwards fewest tokens), `budget // width` rows a micro-batch, every rank's rows dealt into the same number of
    slots. spread: all rows dealt to ranks (`rank_rows`); else each rank packs its own."""
    def held_at(width):
        if spread:
            return rank_rows(fit_rows(items, tokens, width), owners, tokens, world)
        return [fit_rows([i for i in items if owners[i] == r], tokens, width) for r in range(world)]
    options = [(max(len(h) for h in held) * w, w, held) for w in row_widths(items, tokens, world, budget)
               for held in [held_at(w)]]
    _, width, held = min(options, key=lambda o: o[:2])
    per_slot = max(1, budget // width)
    depth = max(1, max(math.ceil(len(h) / per_slot) for h in held))
    dealt = [deal(h, depth) for h in held]
    return [[MicroBatch(dealt[r][s], width) for r in range(world)] for s in range(depth)]


def as_micro_batch(items: list[int], tokens: list[int], layout: str) -> MicroBatch:
    """A bin of items in the `padded` (a row each) or `one_row` layout."""
    if layout == "padded":
        return MicroBatch([[i] for i in items], max((tokens[i] for i in items), default=0))
    return MicroBatch([items] if items else [], sum(tokens[i] for i in items))


def align_slots(bins: list[MicroBatch], owners: list[int], tokens: list[int], world: int) -> list[list[MicroBatch]]:
    """Bins (a multiple of `world`) -> slots [s][r]: sorted by forwarded tokens, each run of `world` bins one slot,
    so a slot's parts cost about the same; within a slot each part goes to the free rank holding most of its
    tokens."""
    bins = sorted(bins, key=lambda b: (-b.forwarded(), b.items()))
    slots = []
    for s in range(0, len(bins), world):
        parts, slot = bins[s:s + world], [None] * world
        held = sorted(((sum(tokens[i] for i in part.items() if owners[i] == r), p, r) for p, part in enumerate(parts)
                       for r in range(world)), key=lambda x: (-x[0], x[1], x[2]))
        placed = set()
        for _, p, r in held:
            if p not in placed and slot[r] is None:
                slot[r] = parts[p]
                placed.add(p)
        slots.append(slot)
    return slots


def bin_plan(items: list[int], tokens: list[int], owners: list[int], world: int, budget: int, size: int,
             spread: bool, layout: str) -> list[list[MicroBatch]]:
    """A mini-batch's slots in the `padded` or `one_row` layout: bins of `size` rollouts or of at most `budget`
    tokens (LPT), `world` parts a slot; static: each rank's own bins, the most any rank has."""
    def bins(own, multiple):  # an empty bin: a filler
        cut = token_bins(own, tokens, budget, multiple) if budget else count_bins(own, tokens, size, multiple)
        return [as_micro_batch(b, tokens, layout) for b in cut]
    if spread:
        return align_slots(bins(items, world), owners, tokens, world)
    own = [sorted((b for b in bins([i for i in items if owners[i] == r], 1) if b.rows),
                  key=lambda b: (-b.forwarded(), b.items())) for r in range(world)]
    return [[b[s] if s < len(b) else MicroBatch([], 0) for b in own] for s in range(max(1, *map(len, own)))]


def plan_update(tokens: list[int], owners: list[int], minibatch: list[int], updates: int, world: int, budget: int,
                size: int, spread: bool, layout: str) -> list[list[list[MicroBatch]]]:
    """The micro-batch slots of every mini-batch: plan[u][s][r] = the MicroBatch (of indices into tokens, owners and
    minibatch) rank r trains in slot s of mini-batch u; one without rows is a filler. Every rank has the same number
    of slots in a mini-batch, and mini-batch 0 at least one (a step whose groups were all dropped still steps
    AdamW). tokens[i]: item i's prompt + response tokens; owners[i]: the rank that holds it; budget: tokens per
    micro-batch (0: micro-batches of `size` items, padded); layout: `layout_for`. spread: items may move
    (`balanced`); else each rank trains its own (`static`). A pure function: every rank computes the same plan."""
    plan = []
    for u in range(updates):
        items = [i for i, m in enumerate(minibatch) if m == u]
        if not items:
            plan.append([[MicroBatch([], 0) for _ in range(world)]] if u == 0 else [])
        elif layout == "rows":
            plan.append(row_plan(items, tokens, owners, world, budget, spread))
        else:
            plan.append(bin_plan(items, tokens, owners, world, budget, size, spread, layout))
    return plan


def lockstep_metrics(plan: list, tokens: list[int], owners: list[int]) -> dict:
    """What the plan's update really runs, as {name: (value, 1)}: every slot costs its largest part's forwarded
    tokens on every rank; the rest of a slot's token slots are padding (inside a real micro-batch), fillers, or a
    rank waiting for the slowest."""
    world = len(plan[0][0]) if plan and plan[0] else 1
    useful = pad = filler = lockstep = moved = kept = 0
    for slots in plan:
        for slot in slots:
            for r, part in enumerate(slot):
                items = part.items()
                if items:
                    useful += sum(tokens[i] for i in items)
                    pad += part.forwarded() - sum(tokens[i] for i in items)
                    moved += sum(owners[i] != r for i in items)
                    kept += len(items)
                else:
                    filler += part.forwarded()
            lockstep += max(part.forwarded() for part in slot)
    total = max(world * lockstep, 1)
    return {"perf/update_lockstep_eff": (useful / total, 1.0), "perf/update_pad_frac": (pad / total, 1.0),
            "perf/update_filler_frac": (filler / total, 1.0),
            "perf/update_slot_wait_frac": ((total - useful - pad - filler) / total, 1.0),
            "perf/update_slots": (float(sum(len(s) for s in plan)), 1.0),
            "perf/update_moved_frac": (moved / max(kept, 1), 1.0)}


# ============================================================================ the exchange
@dataclass
class TrainRow:
    """What the update needs of one kept rollout, and all that the exchange moves of it (Trajectory's names)."""
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float] | None  # the sampler's, aligned with response_ids; None if it gave none
    advantage: float = 0.0


def filler_row(pad_id: int, measured: bool) -> TrainRow:
    """A filler micro-batch's one sequence: FILLER_TOKENS pad tokens, nothing under the loss mask."""
    return TrainRow([pad_id], [pad_id] * (FILLER_TOKENS - 1), [0] * (FILLER_TOKENS - 1),
                    [0.0] * (FILLER_TOKENS - 1) if measured else None)


def exchange(accelerator, moves: list[tuple[int, int, int]], scores: dict, local: dict, measured: bool) -> dict:
    """Send this rank's rollouts that train elsewhere, receive those that train here: point-to-point, one int64
    tensor (token ids and loss mask) and, when measured, one float32 tensor (sampler log-probs) per pair of ranks
    that trade. moves: (slot, from rank, to rank) for every moving rollout, in slot order, the same on every rank;
    scores: slot -> Score (the receiver sizes its buffers from the lengths); local: slot -> the Trajectory or
    TrainRow this rank holds. Returns slot -> TrainRow for everything received (advantages left to the caller)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    if world == 1 or not moves:
        return {}
    dist, device = torch.distributed, accelerator.device
    ops, inbox = [], {}
    for peer in range(world):
        if peer == rank:
            continue
        out = [s for s, a, b in moves if a == rank and b == peer]
        if out:
            rows = [local[s] for s in out]
            ops.append(dist.P2POp(dist.isend, torch.tensor(
                [x for t in rows for x in t.prompt_ids + t.response_ids + t.loss_mask], device=device), peer, tag=0))
            if measured:
                ops.append(dist.P2POp(dist.isend, torch.tensor([x for t in rows for x in t.logprobs],
                                                               dtype=torch.float32, device=device), peer, tag=1))
        got = [s for s, a, b in moves if a == peer and b == rank]
        if got:
            n_int = sum(scores[s].tokens + scores[s].response_tokens for s in got)
            inbox[peer] = (got, torch.empty(n_int, dtype=torch.long, device=device),
                           torch.empty(sum(scores[s].response_tokens for s in got), device=device) if measured
                           else None)
            ops.append(dist.P2POp(dist.irecv, inbox[peer][1], peer, tag=0))
            if measured:
                ops.append(dist.P2POp(dist.irecv, inbox[peer][2], peer, tag=1))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    received = {}
    for got, ints, floats in inbox.values():
        ints, floats, a, b = ints.tolist(), floats.tolist() if floats is not None else None, 0, 0
        for s in got:
            p, r = scores[s].prompt_tokens, scores[s].response_tokens
            received[s] = TrainRow(ints[a:a + p], ints[a + p:a + p + r], ints[a + p + r:a + p + 2 * r],
                                   floats[b:b + r] if measured else None)
            a, b = a + p + 2 * r, b + r
    return received


@dataclass
class RankWork:
    """This rank's part of one step's update (phases 7-8); every rank's has the same shape."""
    minibatches: list[list[MicroBatch]]  # [mini-batch][slot] -> the micro-batch of TrainRows it trains there
    counts: list[dict]  # [mini-batch] -> {"tokens": sampled tokens, "sequences": rollouts}, over every rank
    measured: bool      # every kept rollout carries the sampler's log-probs: the gap is measured (on every rank)


def update_work(accelerator, scores: list[Score], kept: dict, local: dict, updates: int, budget: int, size: int,
                schedule: str, layout: str) -> tuple[RankWork, dict]:
    """Plan the step's update and move the rollouts it trains (the same plan on every rank, from the gathered
    scores). kept: slot -> (advantage, mini-batch) of every kept rollout of the step; local: slot -> this rank's
    rollouts (Trajectory); layout: `layout_for`. Returns this rank's RankWork and the plan's metrics
    (`lockstep_metrics`)."""
    rank, by_slot = accelerator.process_index, {s.slot: s for s in scores}
    order = sorted(kept)
    tokens, owners = [by_slot[s].tokens for s in order], [by_slot[s].rank for s in order]
    plan = plan_update(tokens, owners, [kept[s][1] for s in order], updates, accelerator.num_processes, budget, size,
                       SCHEDULES[schedule][1], layout)
    measured = all(by_slot[s].has_logprobs for s in order)
    moves = sorted((order[i], owners[i], r) for slots in plan for slot in slots for r, part in enumerate(slot)
                   for i in part.items() if owners[i] != r)
    rows = {**local, **exchange(accelerator, moves, by_slot, local, measured)}

    def row(i: int) -> TrainRow:
        t = rows[order[i]]
        return TrainRow(t.prompt_ids, t.response_ids, t.loss_mask, t.logprobs if measured else None,
                        kept[order[i]][0])
    counts = [{"tokens": sum(by_slot[s].sampled_tokens for s in order if kept[s][1] == u),
               "sequences": sum(kept[s][1] == u for s in order)} for u in range(updates)]
    mine = [[MicroBatch([[row(i) for i in r] for r in slot[rank].rows], slot[rank].width) for slot in slots]
            for slots in plan]
    return RankWork(mine, counts, measured), lockstep_metrics(plan, tokens, owners)
