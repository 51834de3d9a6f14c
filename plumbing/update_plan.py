"""The plan of the RL update that every rank runs in lockstep (train.py's phases 7-8), and the exchange that puts
each kept rollout where the plan trains it; a first read can skip it (the loss divides by the global token count,
so where a rollout is trained, and with which others, changes nothing but float rounding).

Under FSDP (and DDP) the update runs in lockstep: every micro-batch is a collective step on every rank (each layer's
all-gather and reduce-scatter), so a mini-batch costs the sum over its micro-batch slots of the slowest rank's slot,
not the largest rank's total.
- The plan (`plan_update`, a pure function every rank computes alike from the gathered scores). Each mini-batch's
  kept rollouts are cut into micro-batches of at most `max_tokens_per_micro_batch` tokens (or of `micro_batch_size`
  rollouts when that is 0), and every rank gets the same number of micro-batch slots with about the same tokens in
  each slot. How a micro-batch is laid out decides what it costs (`layout_for`): under flash attention one packed
  row, partitioned over ranks x slots by tokens, longest processing time first; under sdpa or eager attention rows
  about as wide as the longest rollout (every pair of a row's tokens is scored), filled best fit and dealt to ranks
  in counts at most one apart. Under `schedule=balanced` the rollouts go wherever the plan puts them (each part to
  the rank that already holds most of its tokens); under `static` each rank keeps its own, packed the same way, so
  the two differ only in where rollouts train. A rank with nothing for a slot runs a filler, a two-token sequence
  built locally that trains nothing, so every rank joins every collective. A mini-batch with no kept rollout has
  no slots: the update takes no optimizer or scheduler step for it. Before anything moves, the ranks compare a
  digest of the plan (`plan_digest`); one that differs stops every rank with one line naming it.
- The exchange (`exchange`). Each kept rollout the plan moves goes from the rank that sampled it straight to the
  one that trains it, as tensors (point-to-point): its token ids, loss mask and sampler log-probs; its advantage
  and mini-batch every rank knows already. Dropped rollouts never move.
- What it costs (`lockstep_metrics`): the share of the lockstep's token slots that carry a kept rollout's tokens,
  the rest being padding, fillers and ranks waiting for a slot's slowest (docs/metrics.md, `perf/update_*`).
"""
import bisect
import hashlib
import heapq
import math
from dataclasses import dataclass

import torch

from plumbing import accel
from schedule import SCHEDULES, Score


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
    (best fit decreasing). An item longer than the width gets a row of its own. SFT packs its micro-batches with its
    own first fit decreasing (`sft.pack`, rows as wide as the micro-batch's longest conversation): at that width the
    two give the same number of rows in all but about 1 in 10,000 random micro-batches (docs/LOG.md, 2026-12-06),
    and sharing this one would reorder SFT's rows, so SFT keeps its own."""
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
    of slots in a mini-batch; an empty mini-batch (no kept rollout on any rank) has none, and the update skips it
    (train.update_policy). tokens[i]: item i's prompt + response tokens; owners[i]: the rank that holds it; budget:
    tokens per micro-batch (0: micro-batches of `size` items, padded); layout: `layout_for`. spread: items may move
    (`balanced`); else each rank trains its own (`static`). A pure function: every rank computes the same plan."""
    plan = []
    for u in range(updates):
        items = [i for i, m in enumerate(minibatch) if m == u]
        if not items:
            plan.append([])
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


def plan_digest(plan: list, kept: dict, order: list[int], measured: bool) -> int:
    """A 63-bit digest of a step's update plan as this rank computed it: every slot's micro-batches (items, rows,
    width), the kept rollouts' advantages and mini-batches, whether log-probs are trained on."""
    text = repr(([[[(part.rows, part.width) for part in slot] for slot in slots] for slots in plan],
                 [(s, kept[s]) for s in order], measured))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def check_same_plan(digests: list[int]) -> None:
    """Every rank's plan digest (in rank order) is one, or SystemExit with one line naming the ranks that differ
    from the most common one: a plan that differs between ranks is a hang or a wrong gradient."""
    if len(set(digests)) <= 1:
        return
    common = max(set(digests), key=lambda d: (digests.count(d), -digests.index(d)))
    odd = [r for r, d in enumerate(digests) if d != common]
    raise SystemExit(f"update plan: rank{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} computed another update "
                     f"plan than rank{'s' * (len(digests) - len(odd) > 1)} "
                     f"{', '.join(str(r) for r, d in enumerate(digests) if d == common)} (digests "
                     f"{', '.join(f'{d:016x}' for d in digests)}); the ranks must run one code version and config")


@dataclass
class RankWork:
    """This rank's part of one step's update (phases 7-8); every rank's has the same shape."""
    minibatches: list[list[MicroBatch]]  # [mini-batch][slot] -> the micro-batch of TrainRows it trains there
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
    digests = accel.all_gather_rows(accelerator, torch.tensor([[plan_digest(plan, kept, order, measured)]]))
    check_same_plan([int(d) for d in torch.cat(digests).flatten()])
    moves = sorted((order[i], owners[i], r) for slots in plan for slot in slots for r, part in enumerate(slot)
                   for i in part.items() if owners[i] != r)
    rows = {**local, **exchange(accelerator, moves, by_slot, local, measured)}

    def row(i: int) -> TrainRow:
        t = rows[order[i]]
        return TrainRow(t.prompt_ids, t.response_ids, t.loss_mask, t.logprobs if measured else None,
                        kept[order[i]][0])
    mine = [[MicroBatch([[row(i) for i in r] for r in slot[rank].rows], slot[rank].width) for slot in slots]
            for slots in plan]
    return RankWork(mine, measured), lockstep_metrics(plan, tokens, owners)
