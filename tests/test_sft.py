"""sft.py: the loss mask, the loss and schedule on hand-computed values, a short real run that learns, bad input."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plumbing.config import load_config
from protocol import IM_END, TOOL_NAME, chat_format, format_tool_call
from sft import (IGNORE, LengthGroupedBatches, SFTConfig, build_examples, build_labels, collate, lr_factor,
                 masked_lm_loss, pack, train)
from stops import Stop, save_dies_halfway
from tiny.model import build_model, build_tiny, build_tokenizer
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
CALL = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": "print(12*34)", "input": ""}}}
CONVERSATION = [
    {"role": "user", "content": "Compute 12*34."},
    {"role": "assistant", "content": "Use Python.</reason>\n", "tool_calls": [CALL]},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "</reason>\n<answer>\\boxed{408}</answer>"},
]


def _spans(ids, labels, trained: bool):
    """Contiguous runs of token ids whose label is (trained=True) or is not (False) IGNORE."""
    runs, current = [], []
    for i, lab in zip(ids, labels):
        if (lab != IGNORE) == trained:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_labels_train_exactly_the_assistant_turns():
    tok = build_tokenizer()
    chat = chat_format("compact", "")
    ids, labels = build_labels(tok, chat.render_messages(CONVERSATION))
    assert len(ids) == len(labels)
    assert all(lab == IGNORE or lab == i for i, lab in zip(ids, labels))
    # Trained: each assistant turn's text, its tool call and its <|im_end|>, and nothing else.
    trained = [tok.decode(run) for run in _spans(ids, labels, trained=True)]
    assert trained == ["Use Python.</reason>\n" + format_tool_call("print(12*34)") + IM_END,
                       "</reason>\n<answer>\\boxed{408}</answer>" + IM_END]
    # Untrained: the prompt up to the generation prefix, the tool turn with the re-opened header, the final newline.
    untrained = [tok.decode(run) for run in _spans(ids, labels, trained=False)]
    assert untrained[0] == chat.prompt("Compute 12*34.")
    assert untrained[1] == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" \
                           "<|im_start|>assistant\n<reason>"
    assert untrained[2] == "\n"
    # Each trained turn starts right after the <reason> opener that the environment wrote.
    reason = tok.convert_tokens_to_ids("<reason>")
    starts = [k for k in range(1, len(ids)) if labels[k] != IGNORE and labels[k - 1] == IGNORE]
    assert len(starts) == 2 and all(ids[k - 1] == reason for k in starts)


def test_build_examples_skips_and_counts_long_conversations():
    tok, chat = build_tokenizer(), chat_format("compact", "")
    n_tokens = len(build_labels(tok, chat.render_messages(CONVERSATION))[0])
    long = [CONVERSATION[0] | {"content": "Compute " + "9" * 400 + "."}] + CONVERSATION[1:]
    examples, skipped = build_examples(tok, [CONVERSATION, long, CONVERSATION], chat, max_seq_len=n_tokens)
    assert skipped == 1 and len(examples) == 2 and len(examples[0][0]) == n_tokens


def test_collate_pads_right_and_never_trains_padding():
    batch = collate([([5, 6, 7], [IGNORE, 6, 7]), ([8], [8])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def _random_batch(lengths, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch = []
    for n in lengths:
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        batch.append((ids, [x if keep else IGNORE for x, keep in zip(ids, torch.rand(n, generator=g) < 0.6)]))
    return batch


def test_packing_fills_rows_and_gives_the_padded_loss_and_logits():
    tok = build_tokenizer()
    model = build_model(tok, hidden=64, layers=2, heads=2, seed=1).eval()
    batch = _random_batch([30, 7, 19, 25, 3, 12, 30, 1], len(tok))
    padded, packed = collate(batch, pad_id=0), pack(batch, pad_id=0)
    assert packed["input_ids"].shape == (5, 30) and int(packed["num_tokens"]) == 127  # 8 rows of 30 padded
    # the rows, cut where a position restarts at 0: every conversation once and whole, then padding (pad id 0)
    blocks = []
    for r in range(len(packed["input_ids"])):
        starts = torch.nonzero(packed["position_ids"][r] == 0).flatten().tolist() + [30]
        blocks += [(r, a, packed["input_ids"][r, a:b].tolist()) for a, b in zip(starts, starts[1:])]
    convs = [b for b in blocks if any(b[2])]
    assert sorted(ids for _, _, ids in convs) == sorted(ids for ids, _ in batch)
    assert all(not any(ids) and (packed["labels"][r, a:a + len(ids)] == IGNORE).all() for r, a, ids in blocks
               if not any(ids))
    assert (packed["labels"] != IGNORE).sum() == (padded["labels"][:, 1:] != IGNORE).sum()
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
        want = masked_lm_loss(model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits,
                              padded["labels"])
        assert masked_lm_loss(logits, packed["labels"]).item() == pytest.approx(want.item(), abs=1e-6)
        # right padding under a causal mask: no real token attends to a pad, so the padding mask changes no loss
        unmasked = masked_lm_loss(model(input_ids=padded["input_ids"], use_cache=False).logits, padded["labels"])
        assert unmasked.item() == pytest.approx(want.item(), abs=1e-6)
        # each conversation's logits are those it gets alone: none attends to another in its row
        for r, a, ids in convs:
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            assert torch.allclose(logits[r, a:a + len(ids)], alone, atol=1e-5)


def test_length_grouped_batches_cover_every_example_once_with_less_padding():
    lengths = [(i * 7919) % 600 + 1 for i in range(203)]
    sampler = LengthGroupedBatches(lengths, batch_size=8, seed=0, window=5)
    epochs = [list(sampler) for _ in range(2)]
    for batches in epochs:
        assert len(batches) == len(sampler) == 26
        assert sorted(i for b in batches for i in b) == list(range(203))
    assert epochs[0] != epochs[1]  # a new order each epoch ...
    assert list(LengthGroupedBatches(lengths, 8, seed=0, window=5)) == epochs[0]  # ... and seeded

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)
    plain = [list(range(k, min(k + 8, 203))) for k in range(0, 203, 8)]  # lengths here are in pseudo-random order
    assert padded(epochs[0]) < 0.8 * padded(plain)


def test_masked_lm_loss_shifts_and_averages_over_trained_tokens():
    logits = torch.zeros(1, 3, 4)          # (B, T, V)
    logits[0, 0] = torch.tensor([0.0, 0.0, 2.0, 0.0])
    labels = torch.tensor([[IGNORE, 2, 1]])
    # token 1 (label 2) is predicted from position 0; token 2 (label 1) from position 1 (uniform): mean of the two
    expected = (-math.log(math.exp(2) / (3 + math.exp(2))) + math.log(4)) / 2
    assert masked_lm_loss(logits, labels).item() == pytest.approx(expected, rel=1e-6)
    assert masked_lm_loss(logits, torch.tensor([[IGNORE, 2, IGNORE]])).item() == pytest.approx(
        -math.log(math.exp(2) / (3 + math.exp(2))), rel=1e-6)


def test_lr_factor_warms_up_linearly_then_decays_by_cosine():
    values = [lr_factor(s, warmup_steps=2, total_steps=10) for s in range(11)]
    assert values[0] == pytest.approx(0.5) and values[1] == pytest.approx(1.0) and values[2] == pytest.approx(1.0)
    assert values[6] == pytest.approx(0.5) and values[10] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(values[1:], values[2:]))
    held = [lr_factor(s, warmup_steps=2, total_steps=10, decay_ratio=0.5) for s in range(11)]
    assert held[:7] == [0.5] + [1.0] * 6  # the peak is held until the last half of the steps after warm-up
    assert held[8] == pytest.approx(0.5) and held[10] == pytest.approx(0.0)


# ----------------------------------------------------------------------------------- end to end and bad input
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small model and a handful of tool conversations on disk."""
    root = tmp_path_factory.mktemp("sft")
    base = build_tiny(root / "base", hidden=32, layers=2, heads=2, max_positions=512)
    rows = []
    for a in range(12, 28):
        convo = [dict(m) for m in CONVERSATION]
        convo[0]["content"] = f"Compute {a}*34."
        convo[1] = {**CONVERSATION[1], "tool_calls": [{"function": {"name": TOOL_NAME,
                                                                    "arguments": {"code": f"print({a}*34)"}}}]}
        convo[2] = {"role": "tool", "content": str(a * 34)}
        convo[3] = {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{a * 34}}}</answer>"}
        rows.append(json.dumps({"messages": convo}))
    data = root / "sft.jsonl"
    data.write_text("\n".join(rows) + "\n")
    return root, base, data


def _data_loss(model_dir, data):
    """Mean masked loss of a saved model over the conversations in `data` (one batch)."""
    from plumbing.data import load_conversations
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    chat = chat_format("compact", "")
    examples, _ = build_examples(tok, load_conversations(data), chat, 10_000)
    batch = collate(examples, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return masked_lm_loss(logits, batch["labels"]).item(), model


def test_short_sft_run_changes_weights_and_lowers_the_training_loss(tiny):
    root, base, data = tiny
    out = root / "run"
    cmd = [sys.executable, "sft.py", f"model_path={base}", f"data={data}", f"out_dir={out}", "epochs=20",
           "max_steps=12", "lr=3e-3", "batch_size=8", "micro_batch_size=4", "log_every=3", "system_prompt=compact",
           "user_instruction="]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "16 conversations, 0 skipped" in result.stdout
    before, base_model = _data_loss(base, data)
    after, sft_model = _data_loss(out / "model", data)
    assert after < before - 0.5
    base_params, sft_params = dict(base_model.named_parameters()), dict(sft_model.named_parameters())
    assert all(not torch.equal(base_params[n], p) for n, p in sft_params.items() if "norm" not in n)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6, 9, 12]
    assert set(rows[0]) == {"step", "sft/loss", "sft/lr", "sft/epoch", "perf/tokens_per_s", "perf/seconds"}
    assert rows[-1]["sft/loss"] < rows[0]["sft/loss"] and rows[1]["sft/epoch"] == pytest.approx(3.0)
    assert load_config(SFTConfig, [out / "config.yaml"]).lr == 3e-3


def test_bad_input_stops_before_any_work(tiny, tmp_path):
    root, base, data = tiny
    ok = {"model_path": str(base), "data": str(data), "out_dir": str(tmp_path / "out")}
    with pytest.raises(SystemExit, match="data file not found"):
        train(SFTConfig(**{**ok, "data": str(tmp_path / "missing.jsonl")}))
    with pytest.raises(SystemExit, match="not a model folder"):
        train(SFTConfig(**{**ok, "model_path": str(tmp_path)}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text().splitlines()[0] + "\n" + '{"messages": [{"role": "user"}]}\n')
    with pytest.raises(SystemExit, match=f"{bad}:2: message 0: 'content' must be a string"):
        train(SFTConfig(**{**ok, "data": str(bad)}))
    assert not (tmp_path / "out").exists()


def test_unknown_key_and_indivisible_batch_are_errors(tiny, tmp_path):
    root, base, data = tiny
    result = subprocess.run([sys.executable, "sft.py", "configs/tiny/sft.yaml", "learning_rate=1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "unknown config key 'learning_rate'" in result.stderr
    cfg = SFTConfig(model_path=str(base), data=str(data), out_dir=str(tmp_path / "o"), batch_size=6,
                    micro_batch_size=4)
    with pytest.raises(SystemExit, match="batch_size=6 is not a multiple"):
        train(cfg)


# ----------------------------------------------------------------------------------- checkpoints and resume
# Runs sft.py's entry point and SIGKILLs the process right after it has logged step KILL_AT: no clean-up, and the
# log holds a line newer than the last checkpoint, which the resumed run must drop and write again.
KILLER = """
import os, signal, sys
import sft
kill_at, log_step = int(sys.argv[1]), sft.log_step
def log_then_die(acc, path, row, bar):
    log_step(acc, path, row, bar)
    if row["step"] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
sft.log_step = log_then_die
sft.train(sft.parse_cli(sft.SFTConfig, sys.argv[2:]))
"""


def _sft_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # timings differ run to run


def test_sigkill_then_resume_matches_the_uninterrupted_run(tiny, tmp_path):
    root, base, data = tiny
    # 16 conversations in micro-batches of 2: 8 per epoch, 3 per optimizer step -> steps end after micro-batches
    # 3, 6 and 8 (a partial one at the epoch's end). The first kill leaves checkpoint 3, at the end of epoch 0;
    # the second leaves checkpoint 4, inside epoch 1.
    args = [f"model_path={base}", f"data={data}", "epochs=2", "lr=3e-3", "batch_size=6", "micro_batch_size=2",
            "log_every=1", "save_every=1", "system_prompt=compact", "user_instruction="]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run([sys.executable, "sft.py", f"out_dir={straight}"] + args, cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=120)
    for kill_at, resumed_at in ((4, 3), (5, 4)):
        dead = subprocess.run([sys.executable, "-c", KILLER, str(kill_at), f"out_dir={killed}"] + args, cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
        assert dead.returncode == -9, dead.stderr[-2000:]
        assert [r["step"] for r in _sft_rows(killed)][-1] == kill_at and not (killed / "model").exists()
        assert (killed / "latest").read_text().strip() == f"checkpoint-{resumed_at}"
    assert "at step 3 (epoch 1, 0 micro-batches in)" in dead.stdout  # the second run resumed at the epoch boundary
    done = subprocess.run([sys.executable, "sft.py", f"out_dir={killed}"] + args, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stdout and "at step 4 (epoch 1, 3 micro-batches in)" in done.stdout
    assert [r["step"] for r in _sft_rows(killed)] == [1, 2, 3, 4, 5, 6]
    assert _sft_rows(killed) == _sft_rows(straight)
    a, b = (AutoModelForCausalLM.from_pretrained(p / "model").state_dict() for p in (straight, killed))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_folder_that_holds_a_run_is_never_silently_started_over(tiny, tmp_path):
    root, base, data = tiny
    out = tmp_path / "run"
    args = [sys.executable, "sft.py", f"model_path={base}", f"data={data}", f"out_dir={out}", "max_steps=2",
            "batch_size=8", "micro_batch_size=8", "log_every=1", "system_prompt=compact", "user_instruction="]
    assert subprocess.run(args, cwd=ROOT, capture_output=True, timeout=120).returncode == 0
    log = (out / "metrics.jsonl").read_text()
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)  # no checkpoint to resume
    assert again.returncode != 0 and "holds a finished run (model/) and no checkpoint" in again.stderr
    never = subprocess.run(args + ["resume=never"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert never.returncode != 0 and "already holds a run" in never.stderr
    assert (out / "metrics.jsonl").read_text() == log  # the first run's log is untouched
    bad = subprocess.run(args + ["save_every=3", "log_every=2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "save_every=3 must be a multiple of log_every=2" in bad.stderr


# ----------------------------------------------------------------------------------- runs never lose data
def _cfg(tiny, out, **kw):
    root, base, data = tiny
    return SFTConfig(**{"model_path": str(base), "data": str(data), "out_dir": str(out), "epochs": 2, "lr": 3e-3,
                        "batch_size": 8, "micro_batch_size": 8, "log_every": 1, "system_prompt": "compact",
                        "user_instruction": "", **kw})


def test_a_nan_loss_stops_before_the_weights_change_and_keeps_the_last_checkpoint(tiny, tmp_path, monkeypatch,
                                                                                  one_torch_thread):
    import sft
    real, calls = sft.masked_lm_loss, []

    def nan_from_step_3(logits, labels):  # one micro-batch per optimizer step here
        calls.append(1)
        return real(logits, labels) * (float("nan") if len(calls) >= 3 else 1.0)
    monkeypatch.setattr(sft, "masked_lm_loss", nan_from_step_3)
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="not finite at step 3; stopped before updating the weights. The last good "
                                         "checkpoint: .*checkpoint-2"):
        train(_cfg(tiny, out, save_every=1))
    assert [r["step"] for r in _sft_rows(out)] == [1, 2] and not (out / "model").exists()
    assert (out / "latest").read_text().strip() == "checkpoint-2"


def test_a_run_stopped_before_its_first_checkpoint_starts_over_with_its_log_kept(tiny, tmp_path, one_torch_thread):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "sft/loss": 9.0}\n')  # killed before step 250's checkpoint
    (out / "config.yaml").write_text("lr: 1.0\n")
    train(_cfg(tiny, out, max_steps=2))
    assert [r["step"] for r in _sft_rows(out)] == [1, 2] and (out / "model" / "config.json").is_file()
    assert (out / "stopped-1" / "metrics.jsonl").read_text() == '{"step": 1, "sft/loss": 9.0}\n'
    assert (out / "stopped-1" / "config.yaml").read_text() == "lr: 1.0\n"


def test_the_saved_model_folder_is_whole_or_absent(tiny, tmp_path, monkeypatch, one_torch_thread):
    from transformers import PreTrainedModel

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_dies_halfway)
    with pytest.raises(Stop):
        train(_cfg(tiny, tmp_path / "run", max_steps=1))
    assert not (tmp_path / "run" / "model").exists()


def test_a_packed_run_learns_what_the_padded_run_learns(tiny, tmp_path, one_torch_thread):
    root, base, _ = tiny
    rows = []
    for k, a in enumerate([3, 45, 678, 9012, 34567, 8, 90, 123, 4567, 89012, 5, 67, 890, 1234, 56789, 7]):
        convo = [dict(m) for m in CONVERSATION]  # lengths differ, so rows hold several conversations
        convo[0]["content"] = f"Compute {a}*34." + " Think." * (12 * (k % 4))
        convo[2] = {"role": "tool", "content": str(a * 34)}
        convo[3] = {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{a * 34}}}</answer>"}
        rows.append(json.dumps({"messages": convo}))
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(rows) + "\n")
    runs = {}
    for packing in (False, True):
        out = tmp_path / f"packing-{packing}"
        train(_cfg(tiny, out, data=str(data), epochs=3, packing=packing, group_by_length=False))
        runs[packing] = ([r["sft/loss"] for r in _sft_rows(out)],
                         AutoModelForCausalLM.from_pretrained(out / "model").state_dict())
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    assert len(packed) == 6 and packed[-1] < packed[0] - 0.3
    assert packed == pytest.approx(padded, rel=1e-4)  # the same loss at every step, to float rounding
    assert all(torch.allclose(w_packed[k], w_padded[k], atol=1e-4) for k in w_padded)
    assert pack([([5] * 20, [5] * 20), ([6] * 10, [6] * 10), ([7] * 9, [7] * 9)], 0)["input_ids"].shape == (2, 20)


# ----------------------------------------------------------------------------------- a bf16 checkpoint
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
MASTERS = [sys.executable, str(ROOT / "tests" / "run_sft_masters.py")]
LAUNCH = {
    "one process": lambda: [sys.executable],
    "ddp": lambda: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(free_port())],
    "fsdp2": lambda: [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                      str(ROOT / "configs/accelerate/fsdp_1node_8gpu.yaml"), "--num_processes", "2",
                      "--mixed_precision", "no", "--main_process_port", str(free_port())],
}


@pytest.fixture(scope="module")
def bf16_pair(tiny):
    """The tiny model saved in bf16 (as hub checkpoints are), the same values saved in fp32, and what one SFT step in
    one process does to the fp32 copy (the reference): (bf16 folder, start state dict, trained fp32 state dict)."""
    root, base, data = tiny
    model = AutoModelForCausalLM.from_pretrained(base).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    AutoTokenizer.from_pretrained(base).save_pretrained(root / "bf16")
    model.float().save_pretrained(root / "fp32")
    AutoTokenizer.from_pretrained(base).save_pretrained(root / "fp32")
    reference = _one_step("one process", root / "fp32", data, root / "fp32-run")
    assert {t.dtype for t in safetensors.torch.load_file(root / "fp32-run" / "model" / "model.safetensors")
            .values()} == {torch.float32}  # an fp32 input stays fp32
    return root / "bf16", model.float().state_dict(), reference


def _one_step(launch: str, model: Path, data: Path, out: Path) -> dict:
    """One SFT optimizer step at the report's lr: the trained weights (masters.pt) and model/'s state dict."""
    args = [f"model_path={model}", f"data={data}", f"out_dir={out}", "max_steps=1", "lr=5e-6", "warmup_ratio=0",
            "batch_size=8", "micro_batch_size=4", "log_every=1", "system_prompt=compact", "user_instruction="]
    env = {**ENV, "CPU_FSDP": "1"} if launch == "fsdp2" else ENV
    done = subprocess.run(LAUNCH[launch]() + MASTERS[1:] + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out / "masters.pt")


@pytest.mark.parametrize("launch", ["one process", "ddp", "fsdp2"])
def test_one_step_on_a_bf16_checkpoint_changes_the_weights_an_fp32_run_changes(tiny, bf16_pair, tmp_path, launch):
    """AdamW's first step moves every weight with a gradient by about lr = 5e-6: bf16 rounds that away for most
    weights (the defect: 7.8% of a bf16 model's weights moved), fp32 masters keep it. model/ comes back in bf16."""
    bf16, start, reference = bf16_pair
    trained = _one_step(launch, bf16, tiny[2], tmp_path / "bf16")
    moved_ref = sum(int((reference[k] != start[k]).sum()) for k in start)
    moved_both = sum(int(((reference[k] != start[k]) & (trained[k].float() != start[k])).sum()) for k in start)
    assert moved_ref > 0.9 * sum(t.numel() for t in start.values())
    assert moved_both > 0.99 * moved_ref, f"{moved_both / moved_ref:.1%} of the weights an fp32 run moves"
    assert all(trained[k].dtype == torch.float32 for k in trained)
    saved = safetensors.torch.load_file(tmp_path / "bf16" / "model" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}  # model/ in the dtype the run started from
    assert json.loads((tmp_path / "bf16" / "model" / "config.json").read_text())["dtype"] == "bfloat16"


def test_gradient_checkpointing_recomputes_each_layer_and_changes_no_number(tiny, tmp_path, monkeypatch,
                                                                             one_torch_thread):
    """gradient_checkpointing=true: each decoder layer runs twice per micro-batch (forward, then again in the
    backward; counted at its MLP), and the run ends with the same weights as one without it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
    calls, real = [], Qwen3MLP.forward
    monkeypatch.setattr(Qwen3MLP, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    outs = {}
    for checkpointing in (False, True):
        calls.clear()
        out = train(_cfg(tiny, tmp_path / str(checkpointing), max_steps=1, micro_batch_size=8,
                         gradient_checkpointing=checkpointing))
        outs[checkpointing] = (len(calls), AutoModelForCausalLM.from_pretrained(out).state_dict())
    assert outs[False][0] == 2 and outs[True][0] == 4  # 2 layers x 1 micro-batch, then x 2 with recomputation
    assert all(torch.equal(outs[False][1][k], outs[True][1][k]) for k in outs[False][1])


def test_the_tensorboard_tracker_of_the_qwen3_configs_takes_the_config(tiny, tmp_path, one_torch_thread):
    """report_to=tensorboard (configs/qwen3-*/sft.yaml): the config's None and list values reach TensorBoard's
    hparams as text (before: "ValueError: value should be one of int, float, str, bool" before the first step)."""
    out = train(_cfg(tiny, tmp_path / "run", max_steps=1, report_to="tensorboard"))
    assert out.is_dir() and list((tmp_path / "run").rglob("events.out.tfevents.*"))
