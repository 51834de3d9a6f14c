"""schedule.py: rollouts claimed through a shared counter cover a step exactly once at any world size, a fast rank
takes more, the update's rollouts are spread by tokens with few moves, and rollout() takes claimed work as its
rollouts end. (The multi-process runs are in tests/test_train_invariance.py; the timing in bench/rollout_balance.py.)"""
import random

import pytest
import torch

from rollout import rollout
from schedule import static_claims, step_claims, store_claims, wait_fraction
from plumbing.update_plan import FILLER_TOKENS, MicroBatch, lockstep_metrics, plan_update
from test_rollout import ANSWER_TURN, FMT, TOK, FakeTool, ScriptedSampler

pytestmark = pytest.mark.spec


def play(world: int, n_slots: int, claim_size: int, capacity: float, seed: int) -> list[list[int]]:
    """Ranks interleaved at random on one store: each finishes some of its unfinished rollouts, then claims.
    Returns the slots each rank claimed; checks that no claim is made while the rank's engine is full."""
    store, rng = torch.distributed.HashStore(), random.Random(seed)
    claims = [store_claims(store, "step", n_slots, claim_size, capacity) for _ in range(world)]
    running, taken, quiet = [0] * world, [[] for _ in range(world)], 0
    while quiet < 50 * world:  # until every rank has asked many times in a row and got nothing
        r = rng.randrange(world)
        running[r] -= rng.randint(0, running[r])
        got = claims[r](running[r])
        if capacity < float("inf"):  # claims only while under capacity: the last one may pass it by claim_size - 1
            assert len(got) < max(0, capacity - running[r]) + claim_size
        running[r] += len(got)
        taken[r] += got
        quiet = 0 if got else quiet + 1
    return taken


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("claim_size", [1, 3, 4])
def test_claims_cover_every_rollout_of_a_step_exactly_once_at_any_world_size(world, claim_size):
    """B prompts x 4 rollouts, claims of 1 (the report's per-request dispatch), 3 (not dividing a group) and 4
    (whole prompts), engines of capacity 1 to unbounded, ranks interleaved at random."""
    for seed in range(5):
        n = 4 * world * random.Random(seed).randint(1, 6)
        for capacity in (1, 4, 16, float("inf")):
            taken = play(world, n, claim_size, capacity, seed)
            assert sorted(s for t in taken for s in t) == list(range(n)), (seed, capacity)
            assert all(t == sorted(t) for t in taken)  # each rank's claims in step order
            if world > 1 and capacity == 1 and claim_size == 1 and n >= 4 * world:
                spread = [{r for r, t in enumerate(taken) for i in range(4) if g * 4 + i in t} for g in range(n // 4)]
                assert max(map(len, spread)) > 1  # a prompt's rollouts ran on several ranks


def test_a_rank_claims_only_while_its_engine_has_room():
    claim = store_claims(torch.distributed.HashStore(), "k", 10, 4, capacity=6)  # 10 slots, claims of 4
    assert claim(0) == list(range(8))  # 0 and 4 running are under 6; 8 is not
    assert claim(6) == []
    assert claim(5) == [8, 9]  # the last claim is short
    assert claim(0) == []
    one = store_claims(torch.distributed.HashStore(), "k", 5, 1, capacity=2)
    assert one(0) == [0, 1] and one(1) == [2] and one(2) == [] and one(0) == [3, 4] and one(0) == []


def test_a_fast_rank_takes_what_a_slow_one_leaves():
    store = torch.distributed.HashStore()
    slow, fast = (store_claims(store, "k", 12, 1, capacity=2) for _ in range(2))
    assert slow(0) == [0, 1]  # then it never finishes anything
    got = fast(0)
    while (more := fast(0)):  # finishes everything at once
        got += more
    assert got == list(range(2, 12)) and slow(1) == []


def test_static_claims_give_the_contiguous_share_of_whole_groups_once():
    for world in (1, 2, 3):
        shares = []
        for rank in range(world):
            claim = static_claims(12, 2, rank, world)  # 6 groups of 2
            shares.append(claim(0))
            assert claim(0) == []
        assert shares == [list(range(r * 6 // world * 2, (r + 1) * 6 // world * 2)) for r in range(world)]


def test_a_rollouts_seed_depends_on_its_place_in_the_step_not_on_who_draws_it():
    from schedule import Claims, rollout_seed
    store = torch.distributed.HashStore()
    a, b = (Claims(store_claims(store, "k", 4, 1, capacity=1), ["p", "q"], 2, step=3, seed=7) for _ in range(2))
    assert a(0) == ["p"] and b(0) == ["p"] and a(0) == ["q"] and b(0) == ["q"]
    assert (a.slots, b.slots) == ([0, 2], [1, 3])
    assert a.seed(1, 0) == rollout_seed(7, 3, 2, 0) and b.seed(0, 2) == rollout_seed(7, 3, 1, 2)
    seeds = {rollout_seed(7, st, sl, t) for st in range(3) for sl in range(64) for t in range(4)}
    assert len(seeds) == 3 * 64 * 4 and max(seeds) < 2**62  # distinct over steps, slots and turns


@pytest.mark.parametrize("recipe", ["qwen3-14b", "tiny"])
def test_no_two_rollouts_of_a_three_stage_recipe_share_a_seed(recipe):
    """The recipe's three stages have seeds of their own, and every (seed, step, slot, turn) of the recipe fits
    rollout_seed's fields, where it is a bijection: no two turns of the recipe share a seed. Counted: every turn of
    every rollout for tiny; for qwen3-14b (8.6M rollouts, up to 15 turns) the first turn of every rollout of each
    stage's first, second and last step, and every turn of 1,024 of their slots."""
    from plumbing.config import load_config
    from plumbing.train_config import TrainConfig
    from schedule import SEED_FIELDS, rollout_seed
    stages = [load_config(TrainConfig, [f"configs/{recipe}/stage{k}.yaml"]) for k in (1, 2, 3)]
    assert len({c.seed % 2**SEED_FIELDS["seed"] for c in stages}) == 3, [c.seed for c in stages]
    for c in stages:
        assert c.steps <= 2**SEED_FIELDS["step"] and c.max_turns <= 2**SEED_FIELDS["turn"]
        assert c.prompts_per_step * c.rollouts_per_prompt <= 2**SEED_FIELDS["slot"]
    seen, n = set(), 0
    for c in stages:
        slots = c.prompts_per_step * c.rollouts_per_prompt
        steps = {0, 1, c.steps - 1} if recipe == "qwen3-14b" else range(c.steps)
        for step in steps:
            every_turn = slots if recipe == "tiny" else 1024
            seen.update(rollout_seed(c.seed, step, slot, t) for slot in range(slots)
                        for t in range(c.max_turns if slot < every_turn else 1))
            n += every_turn * c.max_turns + slots - every_turn
    assert len(seen) == n
    assert rollout_seed(0, 0, 0, 0) != rollout_seed(1, 0, 0, 0) != 0  # the stage's seed changes every seed


def test_rollout_seeds_look_random():
    """A real hash, not a counter: consecutive slots' seeds differ in about half their 62 bits, and the top bits
    are used."""
    from schedule import rollout_seed
    seeds = [rollout_seed(0, 5, slot, 0) for slot in range(1000)]
    flips = [bin(a ^ b).count("1") for a, b in zip(seeds, seeds[1:])]
    assert 26 < sum(flips) / len(flips) < 36, sum(flips) / len(flips)
    assert max(seeds) >= 2**61 and min(seeds) < 2**58


def mb(rows, width):
    return MicroBatch(rows, width)


def metrics(plan, tokens, owners) -> dict:
    return {k: v for k, (v, _) in lockstep_metrics(plan, tokens, owners).items()}


def test_the_one_row_plan_on_a_worked_example():
    tokens, owners, minibatch = [100, 90, 10, 5], [0, 0, 0, 1], [0, 0, 0, 0]
    # balanced: two bins of <= 120 tokens by LPT (100 | 90 + 10, then 5 onto the first of the tied bins), one slot;
    # the bin rank 0 holds more of goes to rank 0 (ties: the heavier bin first), the other to rank 1
    spread = plan_update(tokens, owners, minibatch, 1, 2, 120, 0, True, "one_row")
    assert spread == [[[mb([[0, 3]], 105), mb([[1, 2]], 100)]]]
    # static: rank 0 packs its own 200 tokens into two bins (100 | 90 + 10), rank 1 its 5 into one: two slots, and
    # rank 1 runs a filler in the second
    static = plan_update(tokens, owners, minibatch, 1, 2, 120, 0, False, "one_row")
    assert static == [[[mb([[0]], 100), mb([[3]], 5)], [mb([[1, 2]], 100), mb([], 0)]]]
    m = metrics(static, tokens, owners)
    # every slot costs its largest part on both ranks: 2 x (100 + 100) token slots carry 205 useful tokens
    assert m["perf/update_lockstep_eff"] == 205 / 400 and m["perf/update_filler_frac"] == FILLER_TOKENS / 400
    assert m["perf/update_slot_wait_frac"] == (400 - 205 - 2) / 400 and m["perf/update_moved_frac"] == 0
    m = metrics(spread, tokens, owners)
    assert m["perf/update_lockstep_eff"] == 205 / 210 and m["perf/update_moved_frac"] == 3 / 4
    assert m["perf/update_slots"] == 1 and m["perf/update_filler_frac"] == 0


def test_the_rows_plan_on_a_worked_example():
    tokens, owners, minibatch = [100, 90, 10, 5, 60, 40], [0, 0, 0, 0, 1, 1], [0] * 6
    # widths tried: the longest (100) and ceil(305 / 2) = 153 (one row a rank); at 100 best fit gives the rows
    # [0] [1, 2] [4, 5] [3], two a rank (200 token slots a rank), at 153 three rows (two on one rank: 306)
    spread = plan_update(tokens, owners, minibatch, 1, 2, 300, 0, True, "rows")
    assert spread == [[[mb([[0], [1, 2]], 100), mb([[4, 5], [3]], 100)]]]  # rollout 3 moves to rank 1
    m = metrics(spread, tokens, owners)
    assert m["perf/update_lockstep_eff"] == 305 / 400 and m["perf/update_pad_frac"] == 95 / 400
    assert m["perf/update_moved_frac"] == 1 / 6 and m["perf/update_slot_wait_frac"] == 0
    # static: rank 0 packs its four into three rows, rank 1 its two into one; rank 1 waits 200 token slots
    static = plan_update(tokens, owners, minibatch, 1, 2, 300, 0, False, "rows")
    assert static == [[[mb([[0], [1, 2], [3]], 100), mb([[4, 5]], 100)]]]
    m = metrics(static, tokens, owners)
    assert m["perf/update_lockstep_eff"] == 305 / 600 and m["perf/update_slot_wait_frac"] == 200 / 600
    # a budget of two rows a micro-batch: rank 0's three rows take two slots, and rank 1 a filler in the second
    static = plan_update(tokens, owners, minibatch, 1, 2, 200, 0, False, "rows")
    assert static == [[[mb([[0], [1, 2]], 100), mb([[4, 5]], 100)], [mb([[3]], 100), mb([], 100)]]]


def test_padded_micro_batches_count_their_padding():
    # micro-batches of 2 rollouts, padded: [100, 90] costs 200 token slots (10 of them padding), [10, 5] 20 (5)
    plan = plan_update([100, 90, 10, 5], [0, 0, 0, 0], [0] * 4, 1, 1, 0, 2, True, "padded")
    assert plan == [[[mb([[0], [1]], 100)], [mb([[2], [3]], 10)]]]
    m = metrics(plan, [100, 90, 10, 5], [0] * 4)
    assert m["perf/update_lockstep_eff"] == 205 / 220 and m["perf/update_pad_frac"] == 15 / 220


@pytest.mark.parametrize("layout", ["one_row", "rows"])
def test_an_empty_mini_batch_has_no_slots_the_first_as_the_others(layout):
    plan = plan_update([7], [1], [1], 3, 2, 50, 0, True, layout)
    assert plan[0] == []  # no fillers: the update skips it (tests/test_empty_minibatch.py)
    assert [[p.items() for p in slot] for slot in plan[1]] == [[[], [0]]] and plan[2] == []


@pytest.mark.parametrize("layout", ["padded", "one_row", "rows"])
@pytest.mark.parametrize("spread", [True, False])
def test_every_plan_trains_each_rollout_once_in_equal_slot_counts(spread, layout):
    rng = random.Random(0)
    for _ in range(200):
        world, updates, size = rng.randint(1, 6), rng.randint(1, 3), 3
        budget = 0 if layout == "padded" else rng.choice([300, 1000])
        n = rng.randint(0, 30)
        tokens = [rng.choice([rng.randint(20, 60), rng.randint(200, 900)]) for _ in range(n)]
        owners, minibatch = [rng.randrange(world) for _ in range(n)], [rng.randrange(updates) for _ in range(n)]
        plan = plan_update(tokens, owners, minibatch, updates, world, budget, size, spread, layout)
        assert plan == plan_update(tokens, owners, minibatch, updates, world, budget, size, spread, layout)  # pure
        placed = sorted(i for slots in plan for slot in slots for part in slot for i in part.items())
        assert placed == list(range(n))
        assert len(plan) == updates
        for u, slots in enumerate(plan):
            assert all(len(slot) == world for slot in slots)
            for slot in slots:
                for r, part in enumerate(slot):
                    items = part.items()
                    assert all(minibatch[i] == u for i in items)
                    assert spread or all(owners[i] == r for i in items)  # static: each rank its own
                    assert all(sum(tokens[i] for i in row) <= part.width for row in part.rows)  # rows hold them
                    if layout == "padded":
                        assert len(items) <= size and all(len(row) == 1 for row in part.rows)
                    else:  # within the budget, or one row, of one rollout longer than it
                        assert part.forwarded() <= budget or len(part.rows) == 1
            if layout == "one_row" and spread and any(minibatch[i] == u for i in range(n)):
                # LPT: within a slot, parts differ by at most the longest rollout
                longest = max(tokens[i] for slot in slots for part in slot for i in part.items())
                for slot in slots:
                    loads = [sum(tokens[i] for i in part.items()) for part in slot]
                    assert max(loads) - min(loads) <= longest
            if layout == "rows" and spread:  # every rank's rows as many as any other's, give or take one
                counts = [sum(len(slot[r].rows) for slot in slots) for r in range(world)]
                assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("layout", ["one_row", "rows"])
def test_a_balanced_plan_is_less_idle_than_keeping_rollouts_home(layout):
    """Skewed: rank 0 sampled the long rollouts. Both plans train the same rollouts; spreading them wastes fewer
    lockstep token slots."""
    rng = random.Random(1)
    tokens = [rng.randint(300, 400) for _ in range(16)] + [rng.randint(20, 40) for _ in range(16)]
    owners, minibatch = [0] * 16 + [1] * 8 + [2] * 8, [0] * 32
    eff = {s: metrics(plan_update(tokens, owners, minibatch, 1, 3, 1200, 0, s, layout), tokens, owners)[
        "perf/update_lockstep_eff"] for s in (True, False)}
    assert eff[True] > 0.8 and eff[True] > 2 * eff[False], eff


def test_wait_fraction():
    assert wait_fraction([1.0, 2.0]) == 0.25
    assert wait_fraction([3.0, 3.0, 3.0]) == 0.0
    assert wait_fraction([0.0, 0.0]) == 0.0


def test_rollout_takes_more_work_as_its_rollouts_end():
    scripts = {f"problem {i}": [ANSWER_TURN] for i in range(5)}
    asked, queue = [], [[f"problem {i}"] for i in range(1, 5)]

    def more(running):
        asked.append(running)
        return queue.pop(0) if queue and running < 2 else []

    trajs = rollout(["problem 0"], ScriptedSampler(scripts), FakeTool(), TOK, FMT, 2000, 5, more=more)
    assert [t.problem for t in trajs] == [f"problem {i}" for i in range(5)]  # in the order given
    assert all(t.end_reason == "answer" for t in trajs)
    # at the start with 1 running it takes one more and is asked again with 2; after the engine step that ended
    # both, with 0, then 1, then 2
    assert asked[:5] == [1, 2, 0, 1, 2] and not queue


def test_the_step_line_shows_the_wait_only_when_it_is_large():
    from train import log_line
    assert "wait 0.35" in log_line(3, {"rollout/reward_mean": 0.5, "perf/rollout_wait_frac": 0.35})
    assert "wait" not in log_line(3, {"rollout/reward_mean": 0.5, "perf/rollout_wait_frac": 0.1})


def test_one_process_claims_the_whole_step_at_once_under_either_schedule():
    from plumbing.accel import Peers
    one = Peers(600, "test")  # no process group: rank 0 of 1, no store
    prompts = ["a", "b", "c"]
    for schedule, claim_size in (("balanced", 1), ("balanced", 2), ("static", 1)):
        claims = step_claims(schedule, 0, prompts, 2, 1, claim_size, 0, one)  # a capacity of 1 binds only across ranks
        assert claims(0) == ["a", "a", "b", "b", "c", "c"] and claims(0) == [] and claims.slots == [0, 1, 2, 3, 4, 5]


class RoomyEngine:
    """A sampler that reports kv_room(): the engine's free room, set by the test."""
    def __init__(self, free):
        self.free = free

    def kv_room(self):
        return self.free


def test_free_kv_rule_claims_while_the_engine_has_room_and_stops_when_it_is_full():
    from schedule import count_rule, free_kv_rule
    engine = RoomyEngine(free=4096)
    claim = store_claims(torch.distributed.HashStore(), "k", 6, 2, capacity=1, room=free_kv_rule(engine, 1))
    assert claim(5) == [0, 1]  # one claim per ask: the engine sees it before the next (the count of 1 is ignored)
    assert claim(7) == [2, 3]
    engine.free = 0  # full: nothing, however few rollouts run ...
    assert claim(3) == [] and claim(1) == []
    assert claim(0) == [4, 5]  # ... unless none does: a rank with nothing unfinished always claims
    assert claim(0) == []
    counted = store_claims(torch.distributed.HashStore(), "k", 6, 1, 2, room=count_rule(object(), 2))
    assert counted(0) == [0, 1] and counted(1) == [2]


def test_free_kv_rule_stops_in_one_line_naming_what_is_missing_when_the_engine_cannot_say():
    """No silent fall-back to the count rule: an engine without kv_room, or one whose kv_room gives None, stops the
    run with one line that says what it lacks (the sampler's own words where it has them)."""
    from schedule import free_kv_rule

    class Explains(RoomyEngine):
        def kv_room_missing(self):
            return "this engine has no scheduler"
    for engine, missing in [(object(), "object has no kv_room()"),
                            (RoomyEngine(None), "RoomyEngine.kv_room() gives None"),
                            (Explains(None), "this engine has no scheduler")]:
        with pytest.raises(SystemExit) as stop:
            free_kv_rule(engine, 2)
        assert str(stop.value) == (f"config error: claim_rule=free_kv claims while the engine's KV cache has room, "
                                   f"and {missing}; claim_rule=count claims by the count of unfinished rollouts "
                                   "instead")


def test_free_kv_claims_in_a_rollout_follow_the_engine_and_give_the_same_trajectories():
    """rollout() on an engine that holds 2 requests: under free_kv it claims while the engine has room, whichever
    rollouts are in their tool calls; the trajectories are those of the count rule (seeded per turn)."""
    from schedule import Claims, free_kv_rule

    class SmallEngine(ScriptedSampler):
        def kv_room(self):
            return max(0, 2 - len(self._pending()))

    scripts = {f"problem {i}": [ANSWER_TURN] for i in range(6)}
    out = {}
    for rule in ("free_kv", "count"):
        engine = SmallEngine(scripts)
        room = free_kv_rule(engine, 1) if rule == "free_kv" else None
        claims = Claims(store_claims(torch.distributed.HashStore(), "k", 6, 1, 1, room),
                        [f"problem {i}" for i in range(6)], 1, step=0, seed=0)
        seen = []

        def more(running, claims=claims, engine=engine, seen=seen):
            got = claims(running)
            seen.append((len(engine._pending()), len(got)))
            return got
        out[rule] = rollout([], engine, FakeTool(), TOK, FMT, 2000, 5, more=more, seeds=claims.seed)
        if rule == "free_kv":  # claims while fewer than 2 requests are queued, none once 2 are
            assert all(got == 0 for queued, got in seen if queued >= 2)
            assert (0, 1) in seen and (1, 1) in seen
    assert [t.problem for t in out["free_kv"]] == [f"problem {i}" for i in range(6)]
    assert [t.response_ids for t in out["free_kv"]] == [t.response_ids for t in out["count"]]
def test_the_update_plan_digest_names_the_ranks_that_differ():
    from plumbing.update_plan import MicroBatch, check_same_plan, plan_digest
    plan = plan_update([10, 20, 30], [0, 1, 0], [0, 0, 0], 1, 2, 40, 0, True, "one_row")
    kept = {0: (1.0, 0), 1: (-1.0, 0), 2: (0.5, 0)}
    same = plan_digest(plan, kept, [0, 1, 2], False)
    assert plan_digest(plan_update([10, 20, 30], [0, 1, 0], [0, 0, 0], 1, 2, 40, 0, True, "one_row"), kept,
                       [0, 1, 2], False) == same
    check_same_plan([same, same, same])
    altered = plan_digest(plan + [[[MicroBatch([], 0)] * 2]], kept, [0, 1, 2], False)
    other_adv = plan_digest(plan, {**kept, 2: (0.25, 0)}, [0, 1, 2], False)
    assert len({same, altered, other_adv, plan_digest(plan, kept, [0, 1, 2], True)}) == 4
    with pytest.raises(SystemExit, match=r"^update plan: rank 1 computed another update plan than ranks 0, 2 "):
        check_same_plan([same, altered, same])
    with pytest.raises(SystemExit, match=r"^update plan: ranks 0, 3 computed another update plan than ranks 1, 2 "):
        check_same_plan([altered, same, same, other_adv])


def test_free_kv_against_count_in_the_bench_runs_in_abba_order_and_averages_each_rule():
    """bench/rollout_balance.py --rules: each rule runs --rounds times, every other round reversed, so a machine
    that slows from one run to the next slows both rules alike; each rule's metrics are its runs' mean."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import rollout_balance as rb
    assert rb.abba(["count", "free_kv"], 2) == ["count", "free_kv", "free_kv", "count"]
    assert rb.abba(["count", "free_kv"], 3) == ["count", "free_kv", "free_kv", "count", "count", "free_kv"]
    assert rb.abba(["count", "free_kv"], 1) == ["count", "free_kv"]
    # a drift of +1 s per run charges count and free_kv alike in ABBA order: 0 + 3 against 1 + 2
    drift = {}
    for i, name in enumerate(rb.abba(["count", "free_kv"], 2)):
        drift.setdefault(name, []).append({"perf/rollout_max_s": 6.0 + i})
    assert rb.mean_runs(drift["count"]) == rb.mean_runs(drift["free_kv"]) == {"perf/rollout_max_s": 7.5}
