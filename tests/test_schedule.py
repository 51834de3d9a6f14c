"""schedule.py: prompts claimed through a shared counter cover a step exactly once at any world size, a fast rank
takes more, the update's rollouts are spread by tokens with few moves, and rollout() takes claimed work as its
rollouts end. (The multi-process runs are in tests/test_train_invariance.py; the timing in bench/rollout_balance.py.)"""
import random

import pytest
import torch

from rollout import rollout
from schedule import (balanced_destinations, static_claims, stay_destinations, step_claims, store_claims,
                      wait_fraction)
from test_rollout import ANSWER_TURN, FMT, TOK, FakeTool, ScriptedSampler

pytestmark = pytest.mark.spec


def play(world: int, n_groups: int, per_group: int, capacity: float, seed: int) -> list[list[int]]:
    """Ranks interleaved at random on one store: each finishes some of its unfinished rollouts, then claims.
    Returns the positions each rank claimed; checks that no claim is made while the rank's engine is full."""
    store, rng = torch.distributed.HashStore(), random.Random(seed)
    claims = [store_claims(store, "step", n_groups, per_group, capacity) for _ in range(world)]
    running, taken, quiet = [0] * world, [[] for _ in range(world)], 0
    while quiet < 50 * world:  # until every rank has asked many times in a row and got nothing
        r = rng.randrange(world)
        running[r] -= rng.randint(0, running[r])
        got = claims[r](running[r])
        assert len(got) <= max(1, -(-(capacity - running[r]) // per_group)) if capacity < float("inf") else True
        running[r] += per_group * len(got)
        taken[r] += got
        quiet = 0 if got else quiet + 1
    return taken


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_claims_cover_every_group_of_a_step_exactly_once_at_any_world_size(world):
    for seed in range(5):
        n = world * random.Random(seed).randint(1, 6)
        for capacity in (1, 4, 16, float("inf")):
            taken = play(world, n, 4, capacity, seed)
            assert sorted(g for t in taken for g in t) == list(range(n)), (seed, capacity)
            assert all(t == sorted(t) for t in taken)  # each rank's claims in step order


def test_a_rank_claims_only_while_its_engine_has_room():
    claim = store_claims(torch.distributed.HashStore(), "k", 10, 4, capacity=10)
    assert claim(0) == [0, 1, 2]  # 0, 4 and 8 running are under 10; 12 is not
    assert claim(9) == [3]
    assert claim(10) == []
    assert claim(0) == [4, 5, 6]
    assert claim(0) == [7, 8, 9]
    assert claim(0) == []


def test_a_fast_rank_takes_what_a_slow_one_leaves():
    store = torch.distributed.HashStore()
    slow, fast = (store_claims(store, "k", 12, 4, capacity=8) for _ in range(2))
    assert slow(0) == [0, 1]  # then it never finishes anything
    got = fast(0)
    while (more := fast(0)):  # finishes everything at once
        got += more
    assert got == list(range(2, 12)) and slow(7) == []


def test_static_claims_give_the_contiguous_share_once():
    for world in (1, 2, 3):
        shares = []
        for rank in range(world):
            claim = static_claims(6, rank, world)
            shares.append(claim(0))
            assert claim(0) == []
        assert shares == [list(range(r * 6 // world, (r + 1) * 6 // world)) for r in range(world)]


def test_balanced_destinations_on_a_worked_example():
    # mean 102.5: rank 0 keeps its 100, gives away 90 and 10; both go to rank 1, the lighter one each time
    sizes = [[(100, 0), (90, 0), (10, 0)], [(5, 0)]]
    assert balanced_destinations(sizes) == [[0, 1, 1], [1]]
    assert stay_destinations(sizes) == [[0, 0, 0], [1]]
    # an already balanced mini-batch moves nothing; each mini-batch is balanced on its own
    assert balanced_destinations([[(50, 0), (10, 1)], [(50, 0), (30, 1)]]) == [[0, 0], [1, 1]]
    assert balanced_destinations([[(10, 0), (10, 0), (10, 0), (10, 0)], [], []]) == [[0, 1, 2, 0], [], []]


def test_balanced_destinations_end_within_one_rollout_of_the_mean():
    rng = random.Random(0)
    for _ in range(200):
        world, updates = rng.randint(1, 6), rng.randint(1, 3)
        sizes = [[(rng.choice([rng.randint(20, 60), rng.randint(500, 900)]), rng.randrange(updates))
                  for _ in range(rng.randint(0, 9))] for _ in range(world)]
        dest = balanced_destinations(sizes)
        assert dest == balanced_destinations(sizes)  # a pure function: every rank plans the same
        assert [len(d) for d in dest] == [len(s) for s in sizes] and all(0 <= d < world for ds in dest for d in ds)
        for u in range(updates):
            items = [(n, r, d) for s, ds, r in zip(sizes, dest, range(world)) for (n, m), d in zip(s, ds) if m == u]
            if not items:
                continue
            load = [sum(n for n, _, d in items if d == q) for q in range(world)]
            before = [sum(n for n, r, _ in items if r == q) for q in range(world)]
            assert max(load) <= sum(load) / world + max(n for n, _, _ in items)
            assert max(load) <= max(before)  # never worse than not moving


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
    # at the start with 1 running it takes one more and is asked again with 2; when one ends, with 1 again
    assert asked[:4] == [1, 2, 1, 2] and min(asked) == 0 and not queue


def test_the_step_line_shows_the_wait_only_when_it_is_large():
    from train import log_line
    assert "wait 0.35" in log_line(3, {"rollout/reward_mean": 0.5, "perf/rollout_wait_frac": 0.35})
    assert "wait" not in log_line(3, {"rollout/reward_mean": 0.5, "perf/rollout_wait_frac": 0.1})


def test_one_process_claims_the_whole_step_at_once_under_either_schedule():
    from types import SimpleNamespace
    one = SimpleNamespace(process_index=0, num_processes=1)
    prompts = ["a", "b", "c"]
    for schedule in ("balanced", "static"):
        claims = step_claims(schedule, 0, prompts, 2, 1, one)  # a capacity of 1 binds only across ranks
        assert claims(0) == ["a", "a", "b", "b", "c", "c"] and claims(0) == [] and claims.positions == [0, 1, 2]
