"""train.py: the step's plumbing (data order, masks, exact normaliser), the entry point end to end with a scripted
policy on the real tiny model, input errors, the dry-run plan, and the run-folder rules."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from data import write_jsonl
from protocol import chat_format
from rollout import rollout
from sampler import model_checksum
from scripted_policy import ScriptedSampler, say_problems
from tiny_model import build_tiny


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
    batch = train.pad_batch([T()], pad_id=0)
    targets = batch["input_ids"][0, 1:]
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 1]
    assert targets[batch["loss_mask"][0].bool()].tolist() == [8, 9, 11]


def test_select_rollouts_off_keeps_everything_of_signal_groups():
    groups, kept = train.select_rollouts([[1, 0, 1, 0], [1, 1, 1, 1]], [[0.0] * 4] * 2, 4, "off", [None, None])
    assert groups == [0] and kept == [[0, 1, 2, 3]]


def kept_batch(tiny):
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
    trajs = rollout(problems, ScriptedSampler(model, tok), NoTool(), tok, chat_format("compact", ""), 96, 3)
    adv = [1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.0, 0.25]
    return tok, list(zip(trajs, adv))


def updated_weights(tiny, kept, micro_batch_size):
    from accelerate import Accelerator
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(model, opt, sched)
    cfg = train.TrainConfig(micro_batch_size=micro_batch_size, grad_clip=1e9)
    sums = train.update_policy(acc, model, opt, sched, kept, kept[0][0], cfg, pad_id=0)
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


def test_train_entry_point_learns_on_scripted_rollouts(tiny, tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(train, "make_sampler", lambda cfg, model, tok: made.append(ScriptedSampler(model, tok))
                        or made[-1])
    out = tmp_path / "run"
    train.main(args(tiny, out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ["rollout/reward_mean", "rollout/tool_error_rate_in_correct", "rollout/response_tokens_mean",
                "rollout/truncated_frac", "roc/equal_group_frac", "rollout/tool_calls_mean", "loss/clip_frac_low",
                "loss/clip_frac_high", "perf/tokens_per_s", "loss/policy", "loss/grad_norm"]:
        assert key in rows[0], key
    assert 0.0 < rows[0]["rollout/reward_mean"] < 1.0  # the reward was computed, mixed within groups
    assert rows[0]["roc/equal_group_frac"] == 0.0 and rows[0]["rollout/tool_calls_mean"] > 0
    assert made[0].updates == 2  # the sampler got the weights after every update (and the checksum matched)
    before = AutoModelForCausalLM.from_pretrained(tiny / "base")
    after = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model_checksum(after) != model_checksum(before)
    assert (out / "latest").read_text().strip() == "checkpoint-2"
    assert (out / "config.yaml").is_file() and (out / "curves.png").stat().st_size > 1000


def test_run_folder_is_resumed_or_refused_never_restarted(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "make_sampler", lambda cfg, model, tok: ScriptedSampler(model, tok))
    out = tmp_path / "run"
    train.main(args(tiny, out, "steps=1"))
    with pytest.raises(SystemExit, match="already holds a run"):
        train.main(args(tiny, out, "steps=2", "resume=never"))
    train.main(args(tiny, out, "steps=2"))  # resume=auto continues at step 1
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
    (["group_sise=4"], "unknown config key 'group_sise'"),
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
