"""bench/rollout_schedule.py: the decode-cost arithmetic, the three policies on cases small enough to work out by
hand, the claim rule's coverage on a realistic case, the length sources, and the printed plan."""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import rollout_schedule as rs  # noqa: E402
from tools.memory_plan import PUBLIC_CONFIGS, Shape  # noqa: E402

pytestmark = pytest.mark.spec  # the one-minute tier: make test-fast

UNIT = rs.DecodeCost(a=1.0, b=0.0, c=0.0)  # one second per step, whatever runs: times count steps


def test_steps_is_the_sum_of_single_steps():
    cost = rs.DecodeCost(a=0.5, b=0.25, c=0.125)
    by_step = sum(cost.a + cost.b * 3 + cost.c * (7 + 3 * j) for j in range(5))
    assert cost.steps(5, 3, 7) == pytest.approx(by_step)


def test_decode_cost_of_qwen3_14b_on_h200():
    cost = rs.decode_cost(Shape.from_config(PUBLIC_CONFIGS["qwen3-14b"]))
    assert cost.a == pytest.approx(2 * 14_768_307_200 / 4.8e12)  # 6.15 ms: the bf16 weights read once
    assert cost.b == pytest.approx(2 * 14_768_307_200 / 989e12)
    assert cost.c == pytest.approx(163_840 / 4.8e12)              # one token's K and V, 40 layers x 8 heads x 128


def test_equal_lengths_all_policies_agree_and_nobody_idles():
    # 4 prompts x 2 rollouts of 10 tokens, prompts of 5: a cache of 60 holds 4 sequences, 2 prompts per engine
    lengths = np.full((4, 2), 10)
    cost = rs.DecodeCost(a=1.0, b=0.1, c=0.01)
    by_hand = 10 * (1 + 4 * 0.1 + 0.01 * 4 * 5) + 0.01 * 4 * 10 * 9 / 2  # 17.8: 4 sequences from 20 cached tokens
    results = [rs.simulate(lengths, 2, 60, cost, "static", prompt_tokens=5),
               rs.simulate(lengths, 2, 60, cost, "dynamic", prompt_tokens=5),
               rs.ideal(lengths, 2, 60, cost, prompt_tokens=5)]
    for r in results:
        assert r["time"] == pytest.approx(by_hand)
        assert r["idle"] == pytest.approx(0.0)
    assert results[1]["prompts"] == [[0, 2], [1, 3]]  # engines claim in turn at the start


def test_one_long_prompt_by_hand():
    # one rollout per prompt, lengths 30, 10, 10, 10; a cache of 30 tokens; 1 s per step
    lengths = np.array([[30], [10], [10], [10]])
    static = rs.simulate(lengths, 2, 30, UNIT, "static")
    # rank 0 (prompts 0, 1): 30 steps, then prompt 1 fits: 40; rank 1 (prompts 2, 3) together: 10
    assert list(static["finish"]) == [40, 10]
    assert static["idle"] == pytest.approx((0 + 30 / 40) / 2)
    dynamic = rs.simulate(lengths, 2, 30, UNIT, "dynamic")
    # rank 0 takes the long one and has no room left; rank 1 takes the others one after another
    assert dynamic["prompts"] == [[0], [1, 2, 3]]
    assert list(dynamic["finish"]) == [30, 30] and dynamic["idle"] == 0
    # a rank that claims whenever nothing waits holds a prompt its full cache cannot start: back to 40
    eager = rs.simulate(lengths, 2, 30, UNIT, "dynamic", min_free=0)
    assert eager["prompts"] == [[0, 2], [1, 3]] and eager["time"] == 40
    ideal = rs.ideal(lengths, 2, 30, UNIT)
    # 1.5 sequences fit on average (30 x 60 / (30^2 + 3 x 10^2)), 30 tokens per engine: 20 s; the longest alone 30
    assert ideal["time"] == 30 and ideal["idle"] == pytest.approx(1 - 20 / 30)


def test_dynamic_claims_every_prompt_once_and_static_is_rank_share():
    lengths = rs.sample_lengths(np.random.default_rng(1), 128, 32, 12288)
    cost = rs.decode_cost(Shape.from_config(PUBLIC_CONFIGS["qwen3-14b"]))
    dynamic = rs.simulate(lengths, 16, 251_679, cost, "dynamic", prompt_tokens=300)
    claimed = [p for ps in dynamic["prompts"] for p in ps]
    assert sorted(claimed) == list(range(128))
    for ps in dynamic["prompts"]:
        assert ps == sorted(ps)  # each rank's claims come in index order
    static = rs.simulate(lengths, 16, 251_679, cost, "static", prompt_tokens=300)
    assert static["prompts"] == [list(range(8 * r, 8 * r + 8)) for r in range(16)]
    # (at this small scale, seed 1, dynamic is no faster than static: a hard prompt claimed last sets both)
    assert min(static["time"], dynamic["time"]) > rs.ideal(lengths, 16, 251_679, cost, prompt_tokens=300)["time"]
    # the busy seconds are the same decoding work, differently packed: within a few percent of each other
    assert dynamic["busy"].sum() == pytest.approx(static["busy"].sum(), rel=0.05)
    # schedule.py's rule: claims while fewer than 64 of a rank's sequences are unfinished (2 prompts of 32)
    counted = rs.simulate(lengths, 16, 251_679, cost, "dynamic", prompt_tokens=300, max_unfinished=64)
    assert sorted(p for ps in counted["prompts"] for p in ps) == list(range(128))
    assert counted["busy"].sum() == pytest.approx(static["busy"].sum(), rel=0.05)


def test_vllm_admission_by_hand_preempts_the_newest_and_recomputes_it():
    # two rollouts of 6 tokens, no prompt, a cache of 10 tokens, one engine
    lengths = np.array([[6], [6]])
    ideal = rs.simulate(lengths, 1, 10, UNIT, "static")
    assert ideal["time"] == 12 and ideal["preemptions"] == 0  # 6 + 6 > 10: one after the other
    vllm = rs.simulate(lengths, 1, 10, UNIT, "static", admission="vllm")
    # both start (empty now); after 5 steps the cache is full, the newest is preempted with 5 tokens done; the
    # first ends at 6, the second is readmitted with its 5 tokens and ends at 7
    assert vllm["time"] == 7 and vllm["preemptions"] == 1
    cost = rs.DecodeCost(a=1.0, b=0.5, c=0.0)
    # 5 steps of 2 (10 s), 1 step of 1 (1.5 s), the recompute of 5 tokens (2.5 s) and its last step (1.5 s)
    assert rs.simulate(lengths, 1, 10, cost, "static", admission="vllm")["time"] == pytest.approx(15.5)


def test_free_kv_claims_under_vllm_admission_fill_the_cache_the_count_rule_leaves_half_empty():
    lengths = rs.sample_lengths(np.random.default_rng(0), 64, 32, 12288)
    cost = rs.decode_cost(Shape.from_config(PUBLIC_CONFIGS["qwen3-14b"]))
    runs = {rule: rs.simulate(lengths.reshape(-1, 1), 8, 251_679, cost, "dynamic", prompt_tokens=300, per_prompt=32,
                              admission="vllm", **rs.claim_kw(rule, 24, 300)) for rule in ("free_kv", "count")}
    bound = rs.ideal(lengths, 8, 251_679, cost, prompt_tokens=300)["time"]
    assert sorted(p for ps in runs["free_kv"]["prompts"] for p in ps) == sorted(list(range(64)) * 32)
    assert runs["free_kv"]["time"] < 1.1 * bound < 1.3 * bound < runs["count"]["time"]
    assert runs["free_kv"]["preemptions"] > 0 == runs["count"]["preemptions"]
    # the fluid bound under the cache's current use is lower still: vLLM's admission pays for it in preemptions
    assert rs.ideal(lengths, 8, 251_679, cost, prompt_tokens=300, admission="vllm")["time"] < 0.9 * bound


def test_refusals():
    with pytest.raises(ValueError, match="does not fit"):
        rs.simulate(np.array([[40]]), 1, 30, UNIT)
    with pytest.raises(ValueError, match="do not divide"):
        rs.simulate(np.ones((3, 1), int), 2, 30, UNIT, "static")


def test_sampled_lengths_are_seeded_capped_and_correlated_within_a_prompt():
    a = rs.sample_lengths(np.random.default_rng(0), 512, 32, 12288)
    assert a.shape == (512, 32) and a.min() >= 1 and a.max() == 12288
    assert np.array_equal(a, rs.sample_lengths(np.random.default_rng(0), 512, 32, 12288))
    assert 0.02 < (a == 12288).mean() < 0.1 and 4000 < a.mean() < 5000
    # prompt difficulty: the spread of prompt means is far above what 32 independent draws would give
    logs = np.log(a)
    assert logs.mean(axis=1).std() > 2 * logs.std(axis=1).mean() / np.sqrt(32)


def test_lengths_from_trajectories_keep_problems_together(tmp_path):
    rows = ([{"benchmark": "b", "problem_index": 0, "response_tokens": 100}] * 3
            + [{"benchmark": "b", "problem_index": 1, "response_tokens": 20000}] * 2)
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = rs.lengths_from_trajectories(path, np.random.default_rng(0), 50, 8, 12288)
    assert lengths.shape == (50, 8)
    assert all(len(set(row)) == 1 for row in lengths.tolist())  # a prompt's rollouts come from one problem
    assert set(lengths[:, 0].tolist()) == {100, 12288}          # both problems drawn, the long one capped


def test_main_prints_the_plan_with_the_config_kv_cache(capsys):
    rs.main(["--ranks", "8", "--prompts", "64"])
    out = capsys.readouterr().out
    assert "KV cache 251,679 tokens" in out and "budget 12,288" in out and "32 rollouts" in out
    assert "step / fluid bound" in out
    rows = {tuple(line[:45].split()) for line in out.splitlines()}
    for row in [("static", "(schedule=static)", "ideal"), ("free_kv,", "claims", "of", "1", "vllm"),
                ("count", "(24),", "claims", "of", "1", "vllm"), ("free_kv,", "claims", "of", "1", "ideal"),
                ("fluid", "bound"), ("ref:", "free_kv,", "whole", "prompts", "ideal")]:
        assert row in rows, row


def test_the_sweep_closes_with_the_config_rule_s_worst_step_over_the_bound(capsys):
    rs.main(["--ranks", "8", "--prompts", "64", "--seeds", "2"])
    out = capsys.readouterr().out
    assert "claim_rule free_kv, claims of 1" in out and out.count("fluid bound") >= 2
    assert re.search(r"step / fluid bound at most \d\.\d\dx over seeds 0-1 \(vllm admission\)\n$", out)


def test_smaller_claims_are_a_what_if_row(capsys):
    rs.main(["--ranks", "8", "--prompts", "64", "--claim", "4", "--rule", "count"])
    assert "count (24), claims of 4" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not divide"):
        rs.main(["--ranks", "8", "--prompts", "64", "--claim", "5"])
