"""Who rolls out which prompt, and who trains on which rollout: the report's rollout scheduler (§3.2) across ranks.

One step's work is uneven: some prompts give rollouts of a few hundred tokens, others of the whole budget. With a
fixed share per rank, the rank whose prompts are hard decodes several times as many tokens as the one whose prompts
are easy, and every rank waits for it at the update's first collective. The update has the same shape: ranks keep
different numbers of rollouts of different lengths after dropping equal groups, and every optimizer step waits for
the rank with the most tokens. Two parts, both picked by the config field `schedule` (`SCHEDULES`):

- Claiming (phase 2). The step's prompts sit behind one shared counter in the process group's store (the TCP store
  that torchrun and `accelerate launch` already run); a rank claims the next prompt (`store.add(key, 1)`), all 2G
  rollouts of it so that RoC and the group's advantages stay on one rank, whenever fewer than `capacity` of its
  rollouts are unfinished (`rollout_batch_size`: the requests its engine runs at once), until the prompts run out.
  A rank whose prompts finish early takes more; nobody holds work its engine cannot start.
- Balancing (before phases 7-8). The kept rollouts of each mini-batch are spread over ranks so that each rank trains
  on about the same number of tokens (`balanced_destinations`), moving as few as it can (`exchange`). The loss
  divides by the global token count, so where a rollout is trained changes nothing but float rounding.

What the report describes and what this does: the report's scheduler dispatches single requests to engines by their
free KV cache, from one controller. Here there is no controller: each rank claims whole prompts when its count of
unfinished rollouts leaves room, and the engine (vLLM, or samplers/hf.py) packs its own KV cache. Single-rollout
claiming would balance better (bench/rollout_schedule.py estimates how much), but RoC would then need each group
gathered onto one rank first. On one process there is nobody to share with: the rank claims the whole step at once,
exactly what the static schedule does.

Results do not depend on which rank rolled a group out beyond the sampling noise each rank has anyway: the step's
prompts are `train.prompt_indices`, RoC's generators are seeded by the group's position in the step, and mini-batches
are cut by that position (`train.minibatch_of`). Under a sampling policy, which rank draws a group's rollouts now
depends on timing on more than one process: runs on several processes repeat exactly only with `schedule=static`.
"""
import math

import torch

import accel


def static_claims(n_groups: int, rank: int, world: int):
    """The fixed schedule: this rank's contiguous share of the step's groups, all at the first call."""
    share = list(range(rank * n_groups // world, (rank + 1) * n_groups // world))

    def claim(running: int) -> list[int]:
        out, share[:] = share[:], []
        return out
    return claim


def store_claims(store, key: str, n_groups: int, rollouts_per_group: int, capacity: float):
    """Claims through a shared counter: claim(running) -> the positions of the groups taken now, one at a time while
    `running` (this rank's unfinished rollouts) plus what it has just taken stays under `capacity`; [] once the
    counter has passed n_groups (the store is not asked again)."""
    done = False

    def claim(running: int) -> list[int]:
        nonlocal done
        out = []
        while not done and running + len(out) * rollouts_per_group < capacity:
            position = store.add(key, 1) - 1  # add returns the counter after adding: every value goes to one rank
            if position >= n_groups:
                done = True
            else:
                out.append(position)
        return out
    return claim


def balanced_destinations(sizes: list[list[tuple[int, int]]]) -> list[list[int]]:
    """sizes[r][i] = (tokens, mini-batch) of rank r's i-th kept rollout -> dest[r][i], the rank that trains it.
    Per mini-batch: each rank keeps its own rollouts, largest first, while it stays under the mean load (its first
    rollout always); the rest go, largest first, each to the rank with the least load so far (longest processing
    time first). Every rank ends within one rollout of the mean, and a mini-batch already balanced moves nothing.
    A pure function of `sizes`, so every rank computes the same plan."""
    world = len(sizes)
    dest = [[r] * len(s) for r, s in enumerate(sizes)]
    for u in sorted({m for s in sizes for _, m in s}):
        items = sorted(((n, r, i) for r, s in enumerate(sizes) for i, (n, m) in enumerate(s) if m == u),
                       key=lambda item: -item[0])
        mean = sum(n for n, _, _ in items) / world
        load, pool = [0] * world, []
        for n, r, i in items:
            if load[r] == 0 or load[r] + n <= mean:
                load[r] += n
            else:
                pool.append((n, r, i))
        for n, r, i in pool:
            dest[r][i] = min(range(world), key=lambda q: (load[q], q))
            load[dest[r][i]] += n
    return dest


def stay_destinations(sizes: list[list[tuple[int, int]]]) -> list[list[int]]:
    """The unbalanced update: every rank trains on the rollouts it kept."""
    return [[r] * len(s) for r, s in enumerate(sizes)]


# config `schedule` -> (how a rank claims the step's groups, where the kept rollouts are trained)
SCHEDULES = {"balanced": ("store", balanced_destinations), "static": ("static", stay_destinations)}


class Claims:
    """rollout()'s `more` for one step: claims groups with `take` (`static_claims` or `store_claims`), remembers
    their step positions in claiming order (`positions`), and returns each claimed prompt `per_group` times."""

    def __init__(self, take, prompts: list[str], per_group: int):
        self.take, self.prompts, self.per_group, self.positions = take, prompts, per_group, []

    def __call__(self, running: int) -> list[str]:
        got = self.take(running)
        self.positions += got
        return [self.prompts[g] for g in got for _ in range(self.per_group)]


def step_claims(schedule: str, step: int, prompts: list[str], per_group: int, capacity: int, accelerator) -> Claims:
    """The claims of one step's prompts (its B, in step order) on this rank, for the config's schedule."""
    rank, world, n = accelerator.process_index, accelerator.num_processes, len(prompts)
    if SCHEDULES[schedule][0] == "static":
        take = static_claims(n, rank, world)
    elif world == 1:  # one engine: it takes the whole step at once, as the static schedule does
        take = store_claims(torch.distributed.HashStore(), "claims", n, per_group, math.inf)
    else:
        store = torch.distributed.distributed_c10d._get_default_store()
        take = store_claims(store, f"rollout_claims/{step}", n, per_group, capacity)
    return Claims(take, prompts, per_group)


def exchange(accelerator, items: list, dest: list[list[int]]) -> list:
    """Move this rank's items to the ranks `dest` names (every rank's plan, the same on all): returns the items this
    rank keeps, in order, then those it receives, in the sending rank's order. Only moving items travel."""
    rank = accelerator.process_index
    if all(d == r for r, ds in enumerate(dest) for d in ds):
        return items
    sent = accel.all_gather(accelerator, [(d, x) for x, d in zip(items, dest[rank]) if d != rank])
    return [x for x, d in zip(items, dest[rank]) if d == rank] + [x for msgs in sent for d, x in msgs if d == rank]


def wait_fraction(times: list[float]) -> float:
    """The share of the ranks' time spent waiting for the slowest one: sum(max - t) / (ranks x max)."""
    longest = max(times)
    return sum(longest - t for t in times) / (len(times) * longest) if longest > 0 else 0.0


def balance_update(accelerator, kept: list, rollout_s: float, template: list, schedule: str) -> tuple[list, object,
                                                                                                     dict]:
    """Before phases 7-8: this rank's kept [(trajectory, advantage, mini-batch)] -> the ones it trains on under the
    schedule; a trajectory for the mask-0 filler micro-batches (the first rank's first rollout: a rank may have
    rolled out none); and the step's balance metrics as {name: (value, 1)}, the same on every rank.
    One gather of every rank's rollout time and kept sizes; another of the rollouts that move, if any do."""
    world = accelerator.num_processes
    sizes = [(len(t.prompt_ids) + len(t.response_ids), m) for t, _, m in kept]
    ranks = accel.all_gather(accelerator, (rollout_s, sizes, template))
    every = [s for _, s, _ in ranks]
    dest = SCHEDULES[schedule][1](every)
    loads = {}  # (mini-batch, rank) -> tokens it trains on
    for s, ds in zip(every, dest):
        for (n, m), d in zip(s, ds):
            loads[m, d] = loads.get((m, d), 0) + n
    minibatches = sorted({m for m, _ in loads})
    idle = sum(max(loads.get((m, r), 0) for r in range(world)) - loads.get((m, q), 0)
               for m in minibatches for q in range(world))
    busiest = world * sum(max(loads.get((m, r), 0) for r in range(world)) for m in minibatches)
    moved = sum(d != r for r, ds in enumerate(dest) for d in ds)
    metrics = {"perf/rollout_wait_frac": (wait_fraction([t for t, _, _ in ranks]), 1.0),
               "perf/rollout_max_s": (max(t for t, _, _ in ranks), 1.0),
               "perf/update_token_wait_frac": (idle / busiest if busiest else 0.0, 1.0),
               "perf/update_moved_frac": (moved / max(1, sum(map(len, every))), 1.0)}
    return exchange(accelerator, kept, dest), next(t[0] for _, _, t in ranks if t), metrics
