"""Multi-process SFT computes what one process computes: on 1, 2 and 3 CPU processes (gloo), under DDP and under
FSDP2, a run with gradient accumulation over two epochs whose micro-batch count (7) divides by neither 2 nor 3 logs
the same loss and lr at every step and ends with the same weights; a run checkpointed on 2 processes continues on 1
or 3 to the same end; FSDP2 never holds a whole unsharded gradient between micro-batches.

What may legitimately differ: float rounding only. SFT samples nothing, and every process count trains the same
micro-batches with the same loss scale in every optimizer step; what changes is the order in which float32 gradients
are summed (over ranks by the collective, within a rank by accumulation), the gradient norm's sum over shards, and
with it the last bits of each AdamW update. The tolerances below are set from measured differences (see TOL_*).

Each configuration runs once (module-scoped) through tests/run_sft_recorded.py (sft.py's entry point, recording what
each micro-batch trained and, under FSDP2, what each backward left on the rank)."""
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plumbing.data import load_conversations
from protocol import TOOL_NAME, chat_format
from sft import IGNORE, build_examples
from tiny.model import build_tiny
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RUNNER = str(ROOT / "tests" / "run_sft_recorded.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
N_CONVERSATIONS, EPOCHS = 14, 2  # micro-batches of 2: 7 per epoch, windows of 6 and 1 (2 steps per epoch, 4 in all)
# Measured (torch 2.13, CPU, gloo): the largest weight difference from one process, over DDP and FSDP2 at 2 and 3
# ranks and the resumed runs, was 1.2e-7 (about one float32 ulp of the largest weights, ~1), after a run that moves
# weights by up to 7.5e-3; the largest sft/loss difference 1.6e-7 (on a loss of 4.6: one or two ulps, carried
# through the weights); the lr is equal. The bounds leave more than 10x margin and stay far below what one
# duplicated micro-batch does (8e-3, see the duplicate test).
TOL_WEIGHTS, TOL_LOSS = 2e-6, 1e-5


def conversations() -> list[dict]:
    """Tool conversations that differ in the number they compute, so each one's trained tokens identify it."""
    rows = []
    for a in range(12, 12 + N_CONVERSATIONS):
        call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": f"print({a}*34)"}}}
        rows.append({"messages": [{"role": "user", "content": f"Compute {a}*34."},
                                  {"role": "assistant", "content": "Use Python.</reason>\n", "tool_calls": [call]},
                                  {"role": "tool", "content": str(a * 34)},
                                  {"role": "assistant",
                                   "content": f"</reason>\n<answer>\\boxed{{{a * 34}}}</answer>"}]})
    return rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_invariance")
    base = build_tiny(root / "base", hidden=32, layers=2, heads=2, max_positions=512)
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations()))
    return root, base, data


def sft_args(tiny, out: Path) -> list[str]:
    # batch 12 = micro-batch 2 x 6: 6 micro-batches per rank at 1 process, 3 at 2, 2 at 3; warm-up over the whole run
    # (the lr changes every step, so a schedule stepped per process would show); save_every=1 keeps checkpoint-1
    # (inside epoch 0) and checkpoint-3 (inside epoch 1) for the resume test, and changes no number.
    _, base, data = tiny
    return [f"model_path={base}", f"data={data}", f"out_dir={out}", f"epochs={EPOCHS}", "lr=3e-3", "batch_size=12",
            "micro_batch_size=2", "warmup_ratio=1", "log_every=1", "save_every=1", "keep_checkpoints=3",
            "system_prompt=compact", "user_instruction=", "torch_threads=1"]


def launch(kind: str, world: int, args: list[str], mixed_precision: str = "no") -> subprocess.CompletedProcess:
    """sft.py through the recording runner on `world` CPU processes: one process, DDP (torchrun) or FSDP2."""
    port = str(free_port())
    if world == 1:
        cmd, env = [sys.executable], ENV
    elif kind == "ddp":
        cmd, env = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
                    port], ENV
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs/accelerate/fsdp_1node_8gpu.yaml"), "--num_processes", str(world),
               "--mixed_precision", mixed_precision, "--main_process_port", port, str(ROOT / "tests" / "cpu_fsdp.py")]
        env = {**ENV, "CPU_FSDP": "1"}
    done = subprocess.run(cmd + [RUNNER] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def runs(tiny):
    """run(kind, world, mixed_precision="no") -> the run's folder; each configuration runs once per module."""
    made = {}

    def run(kind: str, world: int, mixed_precision: str = "no") -> Path:
        key = (kind if world > 1 else "one", world, mixed_precision)
        if key not in made:
            out = tiny[0] / "-".join(map(str, key))
            extra = [] if mixed_precision == "no" else [f"mixed_precision={mixed_precision}"]
            made[key] = (out, launch(kind, world, sft_args(tiny, out) + extra, mixed_precision).stdout)
        return made[key][0]
    run.stdout = lambda *key: made[key][1]
    return run


def rows(out: Path) -> list[dict]:
    """metrics.jsonl without the timings (they differ run to run)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in lines]


def weights(out: Path) -> dict:
    return AutoModelForCausalLM.from_pretrained(out / "model").state_dict()


def max_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"record{r}.json").read_text()) for r in range(world)]


def assert_same_log(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert a["sft/lr"] == b["sft/lr"] and a["sft/epoch"] == b["sft/epoch"]
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], abs=TOL_LOSS)


@pytest.mark.parametrize("kind,world", [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("fsdp", 3)])
def test_invariance_of_loss_lr_and_weights_to_the_number_of_processes(tiny, runs, kind, world):
    one, many = runs("one", 1), runs(kind, world)
    assert f"batch 12 = 2 x {6 // world} accumulation x {world} ranks" in runs.stdout(kind, world, "no")
    assert len({r["sft/lr"] for r in rows(one)}) == 4  # warm-up: a new lr every step
    assert_same_log(rows(many), rows(one))
    start = AutoModelForCausalLM.from_pretrained(tiny[1]).state_dict()
    assert max_gap(weights(one), start) > 1e-3  # the run moved the weights ...
    assert max_gap(weights(many), weights(one)) <= TOL_WEIGHTS  # ... and every process count moved them alike
    if kind == "fsdp":  # FSDP2 really sharded the model on every rank
        assert all(r["backward"] and r["backward"][0]["sharded_grads"] > 0 for r in records(many, world))


def test_invariance_of_a_lora_sft_under_fsdp2(tiny):
    """sft.py with a LoRA adapter (plumbing/lora.py) under FSDP2 on 2 processes: the log and the merged model/ of
    one process."""
    outs = {}
    for kind, world in (("one", 1), ("fsdp", 2)):
        outs[kind] = tiny[0] / f"lora-{kind}{world}"
        launch(kind, world, sft_args(tiny, outs[kind]) + ["lora_rank=4"])
    assert_same_log(rows(outs["fsdp"]), rows(outs["one"]))
    start = AutoModelForCausalLM.from_pretrained(tiny[1]).state_dict()
    assert max_gap(weights(outs["one"]), start) > 1e-3
    assert max_gap(weights(outs["fsdp"]), weights(outs["one"])) <= TOL_WEIGHTS
    assert (outs["fsdp"] / "adapter" / "adapter_model.safetensors").is_file()


def trained_ids(tiny) -> list[list[int]]:
    """Each conversation's trained token ids, as the recording runner sees them in a micro-batch's labels."""
    _, base, data = tiny
    tok = AutoTokenizer.from_pretrained(base)
    examples, _ = build_examples(tok, load_conversations(data), chat_format("compact", ""), 10_000)
    return [[x for x in labels if x != IGNORE] for _, labels in examples]


@pytest.mark.parametrize("world", [2, 3])
def test_invariance_every_conversation_is_trained_once_per_epoch_on_every_rank_count(tiny, runs, world):
    """With 7 micro-batches an epoch, 2 or 3 ranks cannot read equal shares. Accelerate's prepared DataLoader
    (even_batches) evened them out by repeating the epoch's first micro-batches, which one process never trains: at
    2 ranks the weights then differed from one process's by 8e-3 (measured), as much as the whole run moves them.
    Now the ranks short of a micro-batch run fillers that train no token: every conversation is trained exactly once
    per epoch, over all ranks together, as on one process."""
    want = Counter(tuple(ids) for ids in trained_ids(tiny) for _ in range(EPOCHS))
    for kind, w in (("one", 1), ("ddp", world)):
        got = Counter(tuple(ids) for r in records(runs(kind, w), w) for ids in r["trained"])
        assert got == want, f"{kind} {w}: {sum((got - want).values())} extra, {sum((want - got).values())} missing"
    assert max_gap(weights(runs("ddp", world)), weights(runs("one", 1))) <= TOL_WEIGHTS


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_invariance_fsdp2_holds_no_whole_gradient_between_micro_batches(runs, mixed_precision):
    """After every micro-batch's backward on 2 FSDP2 ranks (3 micro-batches per rank per full step): no parameter
    holds a gradient of its whole unsharded size (FSDP2 keeps one, FSDPParam.unsharded_accumulated_grad in the reduce
    dtype under bf16 compute or the unsharded parameter's .grad in fp32, while gradient sync is off), and every
    parameter's .grad is a DTensor shard: each micro-batch's gradient was reduce-scattered as it came."""
    out = runs("fsdp", 2, mixed_precision)
    for r in records(out, 2):
        assert len(r["backward"]) == 2 * (3 + 1)  # two epochs of a 3-micro-batch window and a 1-micro-batch one
        for after in r["backward"]:
            assert after["fsdp_params"] == after["params"] > 0
            assert after["unsharded_grads"] == 0, after
            assert after["grads"] == after["sharded_grads"] == after["params"], after


@pytest.mark.parametrize("kind,world,start", [("ddp", 1, 1), ("ddp", 3, 3), ("fsdp", 3, 1)])
def test_invariance_a_run_checkpointed_on_two_processes_continues_on_another_number(tiny, runs, tmp_path, kind,
                                                                                   world, start):
    """The 2-process run's folder (DDP, or FSDP2 with its sharded checkpoints), as a kill after step 4's log line
    would leave it with `latest` at checkpoint-{start} (1: inside epoch 0; 3: inside epoch 1), continued with
    resume=auto on `world` processes: the same log (the stale lines cut and written again) and the same weights as
    the uninterrupted run."""
    straight = runs(kind, 2)
    out = tmp_path / "killed"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "model")
    for later in range(start + 1, 4):
        shutil.rmtree(out / f"checkpoint-{later}")
    (out / "latest").write_text(f"checkpoint-{start}\n")
    done = launch(kind, world, sft_args(tiny, out))
    assert f"resumed from {out / f'checkpoint-{start}'} at step {start} (epoch {start // 2}, 6 micro-batches in)" \
        in done.stdout
    assert_same_log(rows(out), rows(straight))
    assert rows(out)[:start] == rows(straight)[:start]  # the lines before the checkpoint are kept as written
    assert max_gap(weights(out), weights(straight)) <= TOL_WEIGHTS


def test_a_checkpoint_with_a_per_rank_data_position_is_refused_in_one_line(tiny, tmp_path):
    """A checkpoint whose data position counts one rank's micro-batches (`batches_in_epoch`, written before the
    position was made world-independent) cannot be placed in the global order: refused before any work."""
    from sft import SFTConfig, train
    _, base, data = tiny
    old = tmp_path / "run" / "checkpoint-2"
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text(json.dumps({"step": 2, "written": 1, "epoch": 0, "batches_in_epoch": 3}))
    (tmp_path / "run" / "latest").write_text("checkpoint-2\n")
    with pytest.raises(SystemExit, match=r"^resume error: .*checkpoint-2 records its data position as one rank's "
                                         r"micro-batches \(an earlier sft.py\), which this one cannot place; start "
                                         r"over in another out_dir$"):
        train(SFTConfig(model_path=str(base), data=str(data), out_dir=str(tmp_path / "run")))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-2", "latest"]  # nothing touched


def test_a_stalled_sft_rank_is_named_by_the_watchdog(tiny, tmp_path):
    """Two DDP ranks, peer_timeout_s=5: rank 1 stops (SIGSTOP) as it enters step 2's micro-batches; rank 0, blocked
    in the step's gradient all-reduce, names it in one line within 65 s and the launch ends non-zero."""
    import signal
    import time
    out = tmp_path / "stalled"
    launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), RUNNER] + sft_args(tiny, out) + ["peer_timeout_s=5"],
                              cwd=ROOT, env={**ENV, "FAULT": "1:2:train"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    line, said, tail = "sft: step 2, train: rank 1 made no progress for 5 s", None, []
    for text in launch.stderr:
        tail = (tail + [text])[-30:]
        if line in text:
            said = time.time()
            break
    mark = Path(f"{out}.fault")
    stopped_at = mark.stat().st_mtime if mark.exists() else time.time()
    if mark.exists():
        try:
            os.kill(int(mark.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    launch.stderr.read()
    assert launch.wait(timeout=120) != 0
    assert said is not None, "".join(tail)
    assert said - stopped_at <= 65, said - stopped_at
