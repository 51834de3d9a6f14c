"""Who rolls out which prompt: the report's rollout scheduler (§3.2) across ranks, and what every rank learns of the
step's rollouts afterwards.

One step's work is uneven: some prompts give rollouts of a few hundred tokens, others of the whole budget. With a
fixed share per rank, the rank whose prompts are hard decodes several times as many tokens as the one whose prompts
are easy, and every rank waits for it. The config field `schedule` (`SCHEDULES`) picks how the work is shared:

- Claiming (phases 1-2). The step's rollouts, in (prompt, index) order, sit behind one shared counter in the process
  group's store (the TCP store that torchrun and `accelerate launch` already run); a rank claims the next
  `claim_size` of them (`store.add(key, 1)`) whenever its claim rule finds room (`CLAIM_RULES`, config
  `claim_rule`): its engine can start one more now (`free_kv`), or fewer than `rollout_batch_size` of its rollouts
  are unfinished (`count`), until they run out. A rank whose rollouts finish early takes more; nobody holds work
  its engine cannot start; one prompt's rollouts may run on several ranks.
  Under `static` each rank rolls out a fixed, contiguous share of the step's prompts instead.
- Scores (before phases 4-6). Every rank gathers every rollout's few numbers (`gather_scores`: its place in the
  step, reward, the penalty's counts, its lengths; not its tokens), so the equal-group drop, Resample-on-Correct
  (grpo_roc.select_step), the advantages and the loss's normaliser (train.py) are computed for the whole step,
  alike on every rank, whichever rank sampled a rollout. The update then trains each kept rollout where its plan
  puts it (plumbing/update_plan.py: micro-batches by tokens, balanced for the lockstep FSDP runs in; under
  `static` each rank keeps its own).

What the report describes and what this does: the report's scheduler dispatches single requests to engines by their
free KV cache, from one controller. Here there is no controller: each rank asks its own engine, claiming while it
says it has room for one more (`claim_rule: free_kv`, the real configs' rule: the engine's free KV cache now, as
vLLM admits), or while its count of unfinished rollouts leaves room (`claim_rule: count`), and the engine (vLLM, or
samplers/hf.py) packs its own KV cache. bench/rollout_schedule.py simulates both at 64 ranks. On one process there
is nobody to share with: the rank claims the whole step at once, exactly what the static schedule does.

Results do not depend on which rank rolled a rollout out: the step's prompts are `train.prompt_indices`, RoC's
generators are seeded by the group's position in the step, mini-batches are cut by that position
(`train.minibatch_of`), and every turn samples from its own seed (`rollout_seed`). What still differs between runs on
several processes is which requests share a decode step, which on a GPU changes the forward's float rounding.
"""
import math
from dataclasses import dataclass

import torch

from plumbing import accel


# ============================================================================ phase 1: claims
def static_claims(n_slots: int, per_group: int, rank: int, world: int):
    """The fixed schedule: the slots of this rank's contiguous share of the step's groups, all at the first call."""
    groups = n_slots // per_group
    share = list(range(rank * groups // world * per_group, (rank + 1) * groups // world * per_group))

    def claim(running: int) -> list[int]:
        out, share[:] = share[:], []
        return out
    return claim


def store_claims(store, key: str, n_slots: int, claim_size: int, capacity: float, room=None):
    """Claims through a shared counter: claim(running) -> the step slots taken now, `claim_size` consecutive ones a
    claim, claim after claim while the rank has room: room(running, taken) with `running` this rank's unfinished
    rollouts and `taken` the slots this call has already taken (a claim rule below; default `count_rule` with
    `capacity`); [] once the counter has passed the last claim (the store is not asked again)."""
    claims, done = -(-n_slots // claim_size), False
    room = room or count_rule(None, capacity)

    def claim(running: int) -> list[int]:
        nonlocal done
        out = []
        while not done and room(running, len(out)):
            c = store.add(key, 1) - 1  # add returns the counter after adding: every value goes to one rank
            if c >= claims:
                done = True
            else:
                out += range(c * claim_size, min((c + 1) * claim_size, n_slots))
        return out
    return claim


# ============================================================================ claim rules (config `claim_rule`)
def count_rule(sampler, capacity: float):
    """Room while fewer than `capacity` (rollout_batch_size) of the rank's rollouts are unfinished: a count, which
    holds a rollout waiting for its tool call as one that decodes, and knows nothing of the engine's cache."""
    return lambda running, taken: running + taken < capacity


def free_kv_rule(sampler, capacity: float):
    """The report's rule (§3.2): room while the engine says it can start one more rollout now, `sampler.kv_room()`
    > 0 (vLLM: nothing waits and its KV cache has free blocks; samplers/hf.py: a free slot), one claim per ask, so
    the engine has seen the last one before the next; a rank with nothing unfinished always has room. An engine
    that cannot say stops the run with one line (`check_kv_room`): its claims never quietly follow another rule."""
    check_kv_room(sampler)
    return lambda running, taken: taken == 0 and (running == 0 or sampler.kv_room() > 0)


def kv_room_missing(sampler) -> str | None:
    """What keeps `sampler` from reporting its free KV cache to free_kv_rule, in words (the sampler's own
    `kv_room_missing()` where it has one); None when it can."""
    name = type(sampler).__name__
    if not callable(getattr(sampler, "kv_room", None)):
        return f"{name} has no kv_room()"
    if sampler.kv_room() is None:
        return getattr(sampler, "kv_room_missing", lambda: None)() or f"{name}.kv_room() gives None"
    return None


def check_kv_room(sampler) -> None:
    """SystemExit with one line naming what is missing when `sampler` cannot report its free KV cache."""
    missing = kv_room_missing(sampler)
    if missing:
        raise SystemExit(f"config error: claim_rule=free_kv claims while the engine's KV cache has room, and "
                         f"{missing}; claim_rule=count claims by the count of unfinished rollouts instead")


CLAIM_RULES = {"free_kv": free_kv_rule, "count": count_rule}


# rollout_seed's fields, in bits: seed (its low bits), step, slot, turn; 62 in all
SEED_FIELDS = {"seed": 16, "step": 16, "slot": 22, "turn": 8}
MASK62 = 2**62 - 1


def rollout_seed(seed: int, step: int, slot: int, turn: int) -> int:
    """The sampling seed of one turn of one rollout, a function of (seed, step, slot, turn) only, so the engine that
    draws a rollout does not change its random numbers. The four are packed into 62 bits (`SEED_FIELDS`: seeds
    that differ in their low 16 bits, 65,536 steps, 4M slots a step, 256 turns) and hashed by a bijection (xor-shift
    and odd multiplications modulo 2^62, splitmix64's finaliser on 62 bits): seeds look random, and no two turns of a
    run, or of runs whose seeds differ in those bits (the stages of a recipe), share one while the fields fit."""
    x = 0
    for value, bits in zip((seed, step, slot, turn), SEED_FIELDS.values()):
        x = (x << bits) | (value % 2**bits)
    x = (x + 0x1E3779B97F4A7C15) & MASK62  # splitmix64's increment: (0, 0, 0, 0) is not seed 0
    for shift, odd in ((31, 0x3F58476D1CE4E5B9), (27, 0x14D049BB133111EB), (31, 1)):
        x = ((x ^ (x >> shift)) * odd) & MASK62
    return x


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
                seed: int, peers, rule: str = "count", sampler=None) -> Claims:
    """The claims of one step's rollouts (its B prompts x per_group, in step order) on this rank, for the config's
    schedule; `claim_size` rollouts a claim under `balanced`, while the config's claim rule (`CLAIM_RULES`) finds
    room on `sampler` (capacity: rollout_batch_size). peers: accel.Peers, started on this step (its store, the
    step's key under the launch's identity, the heartbeat)."""
    rank, world, n = peers.rank, peers.world, len(prompts) * per_group
    if SCHEDULES[schedule][0] == "static":
        take = static_claims(n, per_group, rank, world)
    elif world == 1:  # one engine: it takes the whole step at once, as the static schedule does
        take = store_claims(torch.distributed.HashStore(), "claims", n, claim_size, math.inf)
    else:
        take = store_claims(peers.store, peers.key("claims"), n, claim_size, capacity,
                            CLAIM_RULES[rule](sampler, capacity))
    return Claims(take, prompts, per_group, step, seed, peers.beat)


def wait_fraction(times: list[float]) -> float:
    """The share of the ranks' time spent waiting for the slowest one: sum(max - t) / (ranks x max)."""
    longest = max(times)
    return sum(longest - t for t in times) / (len(times) * longest) if longest > 0 else 0.0


# ============================================================================ scores: what every rank learns
@dataclass(frozen=True)
class Score:
    """One rollout's numbers, gathered from every rank: what phases 4-6, the update's plan and its normaliser read."""
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
