"""train.py: the step's plumbing (data order, masks, exact normaliser), the entry point end to end with a scripted
policy on the real tiny model, input errors, the dry-run plan, and the run-folder rules."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from plumbing import rl_stage
from plumbing import batches
from tools import report
from grpo_roc import group_advantages, select_step
from plumbing.data import write_jsonl
from protocol import chat_format
from rollout import rollout
from one_process import one_process_work
from scripted_policy import ScriptedSampler, say_problems
from stops import Stop, save_dies_halfway
from tiny.model import build_tiny


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "say.jsonl", say_problems(8))
    return root


def args(tiny, out, *extra):
    return ["configs/tiny/stage1.yaml", f"model_path={tiny / 'base'}", f"data=[{tiny / 'say.jsonl'}]",
            f"out_dir={out}", "prompts_per_step=2", "rollouts_per_prompt=8", "group_size=4", "steps=2",
            "eval_data=null", "save_every=1", "max_response_tokens=96", "lr=1e-2", "warmup_steps=1", *extra]


def test_prompt_indices_visit_every_problem_once_per_epoch_across_steps():
    seen = [i for step in range(5) for i in train.prompt_indices(step, per_step=3, n_data=5, seed=7)]  # 15 = 3 epochs
    for epoch in range(3):
        assert sorted(seen[5 * epoch:5 * epoch + 5]) == [0, 1, 2, 3, 4]
    assert train.prompt_indices(3, 3, 5, 7) == seen[9:12]  # a pure function of the step: resume needs nothing else


def test_pad_batch_mask_sits_on_the_targets_the_policy_sampled():
    class T:
        prompt_ids, response_ids, loss_mask = [5, 6, 7], [8, 9, 10, 11], [1, 1, 0, 1]
    batch = batches.pad_batch([T()], pad_id=0)
    targets = batch["input_ids"][0, 1:]
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 1]
    assert targets[batch["loss_mask"][0].bool()].tolist() == [8, 9, 11]


def test_select_step_off_keeps_everything_of_signal_groups():
    groups, kept = select_step([[1, 0, 1, 0], [1, 1, 1, 1]], [[0.0] * 4] * 2, 4, "off", [None, None])
    assert groups == [0] and kept == [[0, 1, 2, 3]]
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4).tolist()  # train_step's phase 6 on that group
    assert adv == pytest.approx([0.866, -0.866, 0.866, -0.866], abs=1e-3)  # (r - 0.5) / (std 0.577 + 1e-6)


def test_sampler_logprobs_sit_where_the_mask_is():
    class T:
        prompt_ids, response_ids, loss_mask, logprobs = [5, 6, 7], [8, 9, 10, 11], [1, 1, 0, 1], [-.1, -.2, 0.0, -.4]
    class U:
        prompt_ids, response_ids, loss_mask, logprobs = [5], [8], [1], [-.5]
    batch = batches.pad_batch([T(), U()], pad_id=0)
    logp = batches.sampler_logprobs([T(), U()], batch["loss_mask"].shape[1])
    # row 1: targets 6 7 | 8 9 10 11 -> the sampler's numbers on 8, 9 and 11 (10 is tool text); row 2: padded
    assert torch.allclose(logp, torch.tensor([[0, 0, -.1, -.2, 0, -.4], [-.5, 0, 0, 0, 0, 0]]))
    assert torch.equal(logp != 0, batch["loss_mask"].bool())
    U.logprobs = None
    assert batches.sampler_logprobs([T(), U()], 6) is None


def kept_batch(tiny, logprob_shift=None):
    tok = AutoTokenizer.from_pretrained(tiny / "base")
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    problems = [p["problem"] for p in say_problems(2) for _ in range(4)]

    class NoTool:
        def submit(self, code, stdin=""):
            from code_tool import ToolResult
            from concurrent.futures import Future
            f = Future()
            f.set_result(ToolResult("ok", code[6:-1] + "\n", "", 0.0))
            return f
    trajs = rollout(problems, ScriptedSampler(model, tok, logprob_shift=logprob_shift), NoTool(), tok,
                    chat_format("compact", ""), 96, 3)
    adv = [1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.0, 0.25]
    return tok, list(zip(trajs, adv))


def updated_weights(tiny, kept, micro_batch_size, **cfg):
    from accelerate import Accelerator
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(model, opt, sched)
    cfg = train.TrainConfig(micro_batch_size=micro_batch_size, grad_clip=1e9, **cfg)
    work, _, normalisers = one_process_work(kept, cfg)
    sums = train.update_policy(acc, model, opt, sched, work, normalisers, cfg, pad_id=0)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), sums


def test_update_is_the_same_whatever_the_micro_batch_size(tiny):
    """The exact global token normaliser: 8 micro-batches of 1 give the update of one batch of 8."""
    _, kept = kept_batch(tiny)
    assert len({len(t.response_ids) for t, _ in kept}) > 1  # uneven lengths: a per-micro-batch mean would differ
    w1, sums1 = updated_weights(tiny, kept, 1)
    w8, sums8 = updated_weights(tiny, kept, 8)
    base = torch.cat([p.flatten() for p in AutoModelForCausalLM.from_pretrained(tiny / "base").parameters()])
    assert (w1 - base).abs().max() > 1e-4  # the update did something
    torch.testing.assert_close(w1, w8, rtol=0, atol=1e-6)
    assert sums1["policy"][0] == pytest.approx(sums8["policy"][0], abs=1e-6)


def test_update_measures_the_gap_to_the_sampler_on_the_kept_sampled_tokens(tiny):
    """The scripted sampler reports its own model's log-probs (the trainer's weights) plus a known shift s, so
    log pi_old - log pi_sampler = -s on every sampled token: the gap metrics have exact values, and any
    misalignment of the sampler's numbers with the trainer's (a token off, tool text counted) would break them."""
    s = 0.25
    _, kept = kept_batch(tiny, logprob_shift=s)
    _, sums = updated_weights(tiny, kept, 2)
    gap = {k: total / count for k, (total, count) in sums.items() if k.startswith("mismatch/")}
    assert sums["mismatch/k3_kl"][1] == sum(sum(t.loss_mask) for t, _ in kept)  # every kept sampled token, once
    assert gap["mismatch/logp_abs_diff_mean"] == pytest.approx(s, abs=1e-5)
    assert gap["mismatch/k3_kl"] == pytest.approx(math.expm1(-s) + s, abs=1e-5)  # (r - 1) - log r at r = e^-s
    assert gap["mismatch/ratio_outside_frac"] == 0.0  # e^-0.25 = 0.78 lies in [1/2, 2]
    longest = max(sum(t.loss_mask) for t, _ in kept)
    assert gap["mismatch/seq_log_ratio_max"] == pytest.approx(s * longest, abs=1e-3)
    # weights e^{-s n_i}: the ESS fraction by hand
    w = torch.tensor([math.exp(-s * sum(t.loss_mask)) for t, _ in kept], dtype=torch.float64)
    assert gap["mismatch/seq_ess_frac"] == pytest.approx(float(w.sum() ** 2 / (len(w) * (w ** 2).sum())), abs=1e-6)
    _, kept0 = kept_batch(tiny, logprob_shift=0.0)  # an engine with the trainer's numbers: ~0 (fp32 rounding only)
    _, sums0 = updated_weights(tiny, kept0, 2)
    assert sums0["mismatch/logp_abs_diff_mean"][0] / sums0["mismatch/logp_abs_diff_mean"][1] < 1e-5
    assert sums0["mismatch/seq_ess_frac"][0] == pytest.approx(1.0, abs=1e-6)


def test_corrections_change_the_update_as_their_formulas_say(tiny):
    """On-policy, the first mini-batch's ratio is 1; with log pi_old - log pi_sampler = -s on every token, tis
    weighs every token by min(e^-s, C) = e^-s, so the loss is e^-s times the uncorrected one; seq_mask with a band
    that excludes e^-s drops every rollout (loss 0, no update). `off` ignores the sampler's numbers entirely."""
    s = 0.25
    _, kept = kept_batch(tiny, logprob_shift=s)
    w_off, off = updated_weights(tiny, kept, 2)
    _, tis = updated_weights(tiny, kept, 2, mismatch_correction="tis", mismatch_tis_cap=2.0)
    assert tis["policy"][0] == pytest.approx(math.exp(-s) * off["policy"][0], rel=1e-5)
    weight = tis["mismatch/correction_weight_mean"]  # what the correction did, logged
    assert weight[0] / weight[1] == pytest.approx(math.exp(-s), rel=1e-5)
    assert "mismatch/correction_weight_mean" not in off
    w_mask, masked = updated_weights(tiny, kept, 2, mismatch_correction="seq_mask", mismatch_seq_low=0.9)
    base = torch.cat([p.flatten() for p in AutoModelForCausalLM.from_pretrained(tiny / "base").parameters()])
    assert masked["policy"][0] == 0.0 and torch.equal(w_mask, base)
    assert masked["mismatch/correction_weight_mean"][0] == 0.0
    _, kept_plain = kept_batch(tiny)  # the same rollouts from a sampler that gives no log-probs
    w_plain, plain = updated_weights(tiny, kept_plain, 2)
    assert torch.equal(w_plain, w_off) and plain["policy"] == off["policy"]  # bit for bit
    assert not any(k.startswith("mismatch/") for k in plain)  # nothing to measure
    with pytest.raises(SystemExit, match="mismatch_correction=tis needs the sampler's log-probs"):
        updated_weights(tiny, kept_plain, 2, mismatch_correction="tis")


def test_the_gap_bench_measures_a_known_shift_and_what_the_corrections_would_do(tiny):
    """bench/sampler_gap.py's table on rollouts from an engine off by a known shift s per sampled token (log pi_old -
    log pi_sampler = -s): mean and largest |delta| are s; tis caps a token only where r = e^-s exceeds its cap 2
    (s = -1: every token, s = 0.25: none); seq_mask drops every rollout whose geometric mean e^-s leaves [0.999,
    1.001] and none when s = 0."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import sampler_gap as bench
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    cfg = train.TrainConfig()
    for s, capped, dropped in [(0.25, 0.0, 1.0), (-1.0, 1.0, 1.0), (0.0, 0.0, 0.0)]:
        _, kept = kept_batch(tiny, logprob_shift=s)
        trajs = [t for t, _ in kept]
        m = bench.gap(model, trajs, 1.0, cfg, pad_id=0, micro=3)  # 3 rows per forward: padding in play
        assert m["tokens"] == sum(sum(t.loss_mask) for t in trajs) and m["rollouts"] == 8
        assert m["logp_abs_diff_mean"] == pytest.approx(abs(s), abs=1e-5)
        assert m["token_max"] == pytest.approx(abs(s), abs=1e-5)
        assert m["tis_capped_frac"] == capped and m["seq_mask_dropped_frac"] == dropped, s


def spy_forwards(monkeypatch):
    """(input width, grad enabled) of every forward of the policy made through token_logprobs."""
    calls, original = [], train.token_logprobs

    def spy(model, batch, temperature):
        calls.append((batch["input_ids"].shape[1], torch.is_grad_enabled()))
        return original(model, batch, temperature)
    monkeypatch.setattr(train, "token_logprobs", spy)
    return calls


def test_update_scores_old_logprobs_in_its_own_forward_when_on_policy(tiny, monkeypatch):
    """With one optimizer step per RL step the policy has not moved when a micro-batch is scored, so its old
    log-probs are those of the update's own forward: one forward per micro-batch, none without grad. With two
    mini-batches the second one's old log-probs are taken before the first optimizer step (a no-grad forward)."""
    _, kept = kept_batch(tiny)
    calls = spy_forwards(monkeypatch)
    _, sums = updated_weights(tiny, kept, 2)
    assert [grad for _, grad in calls] == [True] * 4
    assert sums["ratio_mean"][0] / sums["ratio_mean"][1] == pytest.approx(1.0, abs=1e-9)
    calls.clear()
    cfg_two = train.TrainConfig(micro_batch_size=2, updates_per_step=2, grad_clip=1e9)
    from accelerate import Accelerator
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(model, opt, sched)
    work, _, normalisers = one_process_work(kept, cfg_two)
    sums = train.update_policy(acc, model, opt, sched, work, normalisers, cfg_two, pad_id=0)
    assert [grad for _, grad in calls] == [False] * 2 + [True] * 4  # micro-batches 3 and 4, before any step
    ratio = sums["ratio_mean"][0] / sums["ratio_mean"][1]
    assert ratio != pytest.approx(1.0, abs=1e-6)  # the second mini-batch saw the policy after the first step


@pytest.mark.parametrize("updates", [1, 2])
def test_the_clip_binds_only_when_updates_per_step_exceeds_one(tiny, updates):
    """One optimizer step per RL step: the old log-probs are the update's own, detached, so the ratio is 1 at every
    token, no token is clipped, and a clip wide enough never to bind gives the same weights. Two: the second
    mini-batch meets the step's old log-probs after the first step moved the policy; tokens are clipped, and the
    clipped update differs from the unclipped one."""
    _, kept = kept_batch(tiny)
    w, sums = updated_weights(tiny, kept, 2, updates_per_step=updates)
    wide, _ = updated_weights(tiny, kept, 2, updates_per_step=updates, clip_low=0.999, clip_high=1e6)
    clipped = sums["clip_frac_low"][0] + sums["clip_frac_high"][0]
    if updates == 1:
        assert clipped == 0.0 and sums["ratio_mean"][0] == pytest.approx(sums["ratio_mean"][1], abs=1e-9)
        torch.testing.assert_close(w, wide, rtol=0, atol=0)
    else:
        assert clipped > 0.0
        assert (w - wide).abs().max() > 1e-4


def test_update_micro_batches_hold_sequences_of_similar_length(tiny, monkeypatch):
    """Kept rollouts are sorted by length inside their mini-batch, so each micro-batch is padded to a length
    close to its own sequences' (fewer padded positions than in the order they were kept)."""
    _, kept = kept_batch(tiny)
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t, _ in kept]
    assert lengths != sorted(lengths)  # the kept order is not already sorted
    calls = spy_forwards(monkeypatch)
    updated_weights(tiny, kept, 2)
    ordered = sorted(lengths)
    assert sorted(width for width, _ in calls) == [max(ordered[i:i + 2]) for i in range(0, 8, 2)]
    assert sum(calls_w * 2 for calls_w, _ in calls) < sum(max(lengths[i:i + 2]) * 2 for i in range(0, 8, 2))


def test_train_entry_point_learns_on_scripted_rollouts(tiny, tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(rl_stage, "make_sampler", lambda cfg, model, tok: made.append(
        ScriptedSampler(model, tok, logprob_shift=0.0)) or made[-1])  # the trainer's own numbers: no gap
    out = tmp_path / "run"
    train.main(args(tiny, out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ["rollout/reward_mean", "rollout/tool_error_rate_in_correct", "rollout/response_tokens_mean",
                "rollout/truncated_frac", "roc/equal_group_frac", "rollout/tool_calls_mean", "loss/clip_frac_low",
                "loss/clip_frac_high", "perf/tokens_per_s", "loss/policy", "loss/grad_norm",
                "mismatch/logp_abs_diff_mean", "mismatch/k3_kl", "mismatch/ratio_outside_frac",
                "mismatch/seq_log_ratio_max", "mismatch/seq_ess_frac"]:
        assert key in rows[0], key
    assert rows[0]["mismatch/logp_abs_diff_mean"] < 1e-5 and rows[0]["mismatch/seq_ess_frac"] > 0.999
    assert 0.0 < rows[0]["rollout/reward_mean"] < 1.0  # the reward was computed, mixed within groups
    assert rows[0]["roc/equal_group_frac"] == 0.0 and rows[0]["rollout/tool_calls_mean"] > 0
    assert made[0].updates == 3  # the sampler got the weights at the start and after every update (checked)
    before = AutoModelForCausalLM.from_pretrained(tiny / "base")
    after = AutoModelForCausalLM.from_pretrained(out / "model")
    assert any(not torch.equal(a, b) for a, b in zip(after.parameters(), before.parameters()))
    for a, b in zip(made[0].model.parameters(), after.parameters()):  # the sampler's own copy holds the result
        assert torch.equal(a, b)
    assert (out / "latest").read_text().strip() == "checkpoint-2"
    assert (out / "config.yaml").is_file() and (out / "curves.png").stat().st_size > 1000
    assert (out / "sandbox.txt").read_text().startswith("code tool sandbox: ")  # what model code could reach


def test_the_step_line_shows_the_gap_when_it_is_large():
    m = {"rollout/reward_mean": 0.5, "mismatch/logp_abs_diff_mean": 2e-6}
    assert train.log_line(3, m) == "step    3 reward 0.5"
    m["mismatch/logp_abs_diff_mean"] = 0.014
    assert train.log_line(3, m) == "step    3 reward 0.5 gap 0.014"


def test_a_sampler_left_with_old_weights_stops_the_run_after_the_first_step(tiny, tmp_path, monkeypatch):
    """The scripted sampler keeps its own copy of the model; one that skips the updates is caught by the hand-off
    check (log-probs of a fixed sequence) right after step 1's update, with one line; step 1 is neither logged nor
    saved (its rollouts came from the right weights, its update never reached the sampler)."""
    monkeypatch.setattr(rl_stage, "make_sampler", lambda cfg, model, tok: ScriptedSampler(model, tok, skip_updates=True))
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"^hand-off error after step 1: the sampler's log-probs differ from the "
                                         r"trainer's by [0-9.e-]+ per token \(tolerance 0.001\)$"):
        train.main(args(tiny, out))
    assert not (out / "metrics.jsonl").exists() and not (out / "latest").exists()


def test_answer_checkers_start_before_the_first_rollout(tiny, tmp_path, monkeypatch):
    """The reward's worker processes import sympy while the first rollout runs (they used to start at the first
    check after it, and the step waited for them)."""
    events, real_rollout = [], train.rollout

    class Pool:
        def start(self):
            events.append("checkers started")
    monkeypatch.setattr(rl_stage, "default_pool", lambda: Pool())
    monkeypatch.setattr(train, "rollout", lambda *a, **kw: events.append("rollout") or real_rollout(*a, **kw))
    monkeypatch.setattr(rl_stage, "make_sampler", lambda cfg, model, tok: ScriptedSampler(model, tok))
    train.main(args(tiny, tmp_path / "run", "steps=1"))
    assert events[:2] == ["checkers started", "rollout"]


def test_run_folder_is_resumed_or_refused_never_restarted(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rl_stage, "make_sampler", lambda cfg, model, tok: ScriptedSampler(model, tok))
    out = tmp_path / "run"
    train.main(args(tiny, out, "steps=1"))
    with pytest.raises(SystemExit, match="already holds a run"):
        train.main(args(tiny, out, "steps=2", "resume=never"))
    with pytest.raises(SystemExit, match=r"another config: steps: 1 -> 2\. .*resume_allow_changes=\[steps\]"):
        train.main(args(tiny, out, "steps=2"))  # more steps than the run was started with: said, not silent
    with pytest.raises(SystemExit, match=r"another config: tool_name: 'execute_python_code_with_standard_io' -> "
                                         r"'python_code_with_standard_io'\. "):
        train.main(args(tiny, out, "steps=1", "tool_name=python_code_with_standard_io"))  # the chat format is the run's
    train.main(args(tiny, out, "steps=2", "resume_allow_changes=[steps]"))  # resume=auto continues at step 1
    assert "resumed from" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    (out / "latest").unlink()
    with pytest.raises(SystemExit, match="no checkpoint to continue from"):
        train.main(args(tiny, out, "steps=3"))


@pytest.mark.parametrize("extra, message", [
    (["model_path=/nonexistent/model"], "model_path '/nonexistent/model' is not a model folder"),
    (["data=[/nonexistent.jsonl]"], "nonexistent.jsonl: data file not found"),
    (["max_prompt_tokens=10"], "over max_prompt_tokens=10"),
    (["rollouts_per_prompt=3", "group_size=4"], "group_size <= rollouts_per_prompt"),
    (["roc_mode=best"], "roc_mode must be"),
    (["tool_error_format=short"], "tool_error_format must be one of"),
    (["mismatch_correction=is"], "mismatch_correction must be one of \\['off', 'tis', 'seq_mask'\\]"),
    (["mismatch_seq_low=1.5"], "mismatch_seq_low must be a finite number > 0 and <= 1, got 1.5"),
    (["tool_result_format=json"], "tool_result_format must be one of"),
    (["user_template=plain"], "user_template must hold \\{problem\\} once"),
    (["group_sise=4"], "unknown config key 'group_sise'"),
    (["sampler=vllm", "vllm_tensor_parallel_size=2"], "vllm_tensor_parallel_size=2: only 1 is supported"),
    (["tool_backend=docker"], "config error: tool_backend must be one of auto, servers, subprocess, got 'docker'$"),
    (["tool_backend=subprocess", "tool_require_isolation=true"], "config error: tool_require_isolation is set"),
])
def test_bad_input_stops_before_any_work_with_a_clear_message(tiny, tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        train.main(args(tiny, tmp_path / "run", *extra))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_bad_jsonl_line_names_file_and_line(tiny, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "Say 1.", "answer": "1"}\n{"problem": "Say 2."}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: 'answer'"):
        train.main(args(tiny, tmp_path / "run", f"data=[{bad}]"))


def test_dry_run_prints_the_plan_for_64_gpus_without_a_model(capsys):
    train.main(["configs/qwen3-14b/stage1.yaml", "dry_run=true", "world_size=64"])
    out = capsys.readouterr().out
    assert "world size             64" in out
    assert "512 (B) = 8 per rank" in out and "256 per rank" in out  # 8 prompts x 2G = 32 rollouts
    assert "8192 response tokens, 10 turns" in out and "300 (stage 1)" in out
    with pytest.raises(SystemExit, match="must divide over 48 processes"):
        train.main(["configs/qwen3-14b/stage1.yaml", "dry_run=true", "world_size=48"])


# ------------------------------------------------------------------------------------------ runs never lose data
def scripted(monkeypatch):
    monkeypatch.setattr(rl_stage, "make_sampler", lambda cfg, model, tok: ScriptedSampler(model, tok))


def log_steps(out):
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_from_another_runs_checkpoint_never_rewrites_this_folders_history(tiny, tmp_path, monkeypatch):
    scripted(monkeypatch)
    a, b = tmp_path / "a", tmp_path / "b"
    train.main(args(tiny, a))
    train.main(args(tiny, b))
    log = (b / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match=f"resume={a / 'checkpoint-1'} continues the run in {a}, but out_dir={b} "
                                         "holds another run, whose metrics.jsonl would be cut back to step 1"):
        train.main(args(tiny, b, f"resume={a / 'checkpoint-1'}"))
    assert (b / "metrics.jsonl").read_text() == log
    # Into an empty folder it is a new run that starts at a's step 1.
    train.main(args(tiny, tmp_path / "c", f"resume={a / 'checkpoint-1'}"))
    assert log_steps(tmp_path / "c") == [2] and log_steps(a) == [1, 2]


def test_changed_config_or_data_on_resume_is_refused_unless_allowed(tiny, tmp_path, monkeypatch):
    scripted(monkeypatch)
    out, data = tmp_path / "run", tmp_path / "say.jsonl"
    write_jsonl(data, say_problems(8))
    train.main(args(tiny, out, "steps=1", f"data=[{data}]"))
    with pytest.raises(SystemExit, match=r"prompts_per_step: 2 -> 4; lr: 0\.01 -> 0\.02\. .*"
                                         r"resume_allow_changes=\[prompts_per_step,lr\]"):
        train.main(args(tiny, out, "steps=1", f"data=[{data}]", "lr=2e-2", "prompts_per_step=4"))
    write_jsonl(data, say_problems(8, start=2))  # same path, other problems
    with pytest.raises(SystemExit, match=rf"data: the content of {data} changed"):
        train.main(args(tiny, out, "steps=1", f"data=[{data}]"))
    # Free keys (logging, checkpoint cadence) change without a word; named keys change when allowed.
    train.main(args(tiny, out, "steps=2", f"data=[{data}]", "log_every=5", "keep_checkpoints=3",
                    "resume_allow_changes=[steps,data]"))
    assert log_steps(out) == [1, 2]


def test_a_run_stopped_before_its_first_checkpoint_starts_over_with_its_log_kept(tiny, tmp_path, monkeypatch):
    scripted(monkeypatch)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("steps: 9\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "stage": 1}\n{"step": 2, "st')  # killed before a save
    train.main(args(tiny, out))
    assert log_steps(out) == [1, 2] and (out / "model" / "config.json").is_file()
    assert (out / "stopped-1" / "metrics.jsonl").read_text() == '{"step": 1, "stage": 1}\n{"step": 2, "st'
    assert (out / "stopped-1" / "config.yaml").read_text() == "steps: 9\n"


def test_the_final_model_folder_is_whole_or_absent(tiny, tmp_path, monkeypatch):
    from transformers import PreTrainedModel
    scripted(monkeypatch)
    out = tmp_path / "run"
    real = PreTrainedModel.save_pretrained

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_dies_halfway)
    with pytest.raises(Stop):
        train.main(args(tiny, out))
    assert not (out / "model").exists()
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    train.main(args(tiny, out))  # resumes at the last step and writes the model
    assert AutoModelForCausalLM.from_pretrained(out / "model") is not None
    assert not (out / "model.tmp").exists()


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny, tmp_path, monkeypatch):
    scripted(monkeypatch)
    calls = []
    real, counted = train.LOSSES["token"]

    def nan_from_step_2(logp, *a, **kw):
        calls.append(1)
        loss, metrics = real(logp, *a, **kw)
        return (loss * float("nan") if len(calls) > 1 else loss), metrics  # step 1 has one micro-batch here
    monkeypatch.setitem(train.LOSSES, "token", (nan_from_step_2, counted))
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="step 2: the loss .* is not finite; stopped, the last good checkpoint: "
                                         ".*checkpoint-1"):
        train.main(args(tiny, out, "steps=3", "max_tokens_per_micro_batch=4096"))
    assert log_steps(out) == [1] and (out / "latest").read_text().strip() == "checkpoint-1"
    assert not (out / "model").exists() and not (out / "checkpoint-2").exists()


def test_a_saved_steps_rollouts_carry_the_marks_the_update_trained_on(tiny, tmp_path, monkeypatch):
    """save_rollouts_every=2 over 2 steps: one file, step 2's 2 x 8 rollouts, each marked as RoC chose it; the kept
    ones carry the advantages and mini-batches the update trained on; the page shows the marks."""
    scripted(monkeypatch)
    trained, real_update = [], train.update_policy

    def update_policy(acc, model, optimizer, scheduler, work, *a, **k):
        trained.append(sorted((round(t.advantage, 9), u) for u, slots in enumerate(work.minibatches)
                              for micro in slots for t in micro.items()))
        return real_update(acc, model, optimizer, scheduler, work, *a, **k)
    monkeypatch.setattr(train, "update_policy", update_policy)
    out = tmp_path / "run"
    train.main(args(tiny, out, "save_rollouts_every=2", "updates_per_step=2"))
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["step_000002.jsonl"]
    records = report.load_rollouts(out / "rollouts" / "step_000002.jsonl")
    assert [(r["problem_index"], r["sample"]) for r in records] == [(g, i) for g in range(2) for i in range(8)]
    assert {r["step"] for r in records} == {2} and {r["benchmark"] for r in records} == {"step 2"}
    kept = [r for r in records if r["kept"]]
    assert sorted((round(r["advantage"], 9), r["minibatch"]) for r in kept) == trained[1]
    assert all(r["advantage"] is None and r["minibatch"] is None for r in records if not r["kept"])
    for g in range(2):  # groups of 4 of 8, rewards mixed: RoC keeps 4 of each, their advantages sum to 0
        group = [r for r in kept if r["problem_index"] == g]
        assert len(group) == 4 and abs(sum(r["advantage"] for r in group)) < 1e-6
        assert all((r["advantage"] > 0) == (r["reward"] == 1) for r in group)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[1])
    assert sum(r["reward"] for r in records) / 16 == pytest.approx(row["rollout/reward_mean"])
    page = report.write_rollouts_report(out / "rollouts" / "step_000002.jsonl")
    data = json.loads(page.read_text().split('id="data">')[1].split("</script>")[0])
    samples = [s for p in data["benchmarks"][0]["problems"] for s in p["samples"]]
    assert [s["roc"]["kept"] for s in samples] == [r["kept"] for r in records]
    assert all(("kept" in s["flags"]) == s["roc"]["kept"] for s in samples) and "kept by RoC" in page.read_text()
