"""World-size invariance of RL training: train.py on 1, 2 and 3 CPU processes (gloo), under DDP and under FSDP2,
computes what one process computes.

The setting is chosen so that a difference has somewhere to show: a warm-up longer than the run (an lr schedule
stepped at another pace shows in every step's `loss/lr`), three optimizer steps per RL step over packed micro-batches
of at most 256 tokens (two or three rollouts; mini-batches that a rank cuts from its own share would hold other
rollouts than one process's), 6 prompts a step from 9 problems (steps cross a data epoch), held-out evaluation during training on 5 problems (not a multiple of 2
or 3), and a stage 2 that carries stage 1's AdamW state (`optimizer_from`), whole or sharded (a stage 2 that lost
that state ends 3e-3 away from one that kept it, a thousand times the weights' tolerance).

The scripted policy (tests/scripted_policy.py) answers a problem the same way whichever rank rolls it out, so
nothing may differ but float rounding: the problems each step rolls out, the kept rollouts with their advantages and
mini-batches (RoC's choices), the lr, the rewards and RoC statistics must be equal; the losses, gradient norms and
final weights equal to float32 rounding (all-reduce and reduce-scatter sum in another order; Adam divides by
sqrt(v), which enlarges that rounding where a gradient is near 0). With a sampling policy each rank draws its own
rollouts from its own RNG stream, so rollouts (and everything computed from them) differ with the world size as
they differ between two seeds: that is the only legitimate difference, and the scripted policy removes it.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plumbing.data import write_jsonl
from scripted_policy import say_problems
from tiny.model import build_tiny
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "run_scripted_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RECORD": "1"}
FSDP_CONFIG = ROOT / "configs/accelerate/fsdp_1node_8gpu.yaml"
# Measured largest differences from one process: weights 2.4e-7 after 5 AdamW steps at lr <= 1e-3 (about a
# quarter of a float32 ulp of the larger weights); losses 3e-8. The bounds leave 10x room.
WEIGHT_TOL, LOSS_TOL = 3e-6, 1e-6


def launcher(kind: str, world: int) -> tuple[list[str], dict]:
    """The command prefix and extra environment of a launch: one plain process, torchrun (DDP) or accelerate
    launch with the real FSDP2 config (tests/cpu_fsdp.py lets it shard on CPU processes)."""
    if world == 1:
        return [sys.executable], {}
    if kind == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
                str(free_port())], {}
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG), "--num_processes",
            str(world), "--mixed_precision", "no", "--main_process_port", str(free_port())], {"CPU_FSDP": "1"}


def train(kind: str, world: int, args: list[str]) -> None:
    prefix, extra = launcher(kind, world)
    done = subprocess.run(prefix + [str(SCRIPT)] + args, env={**ENV, **extra}, cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "train.jsonl", say_problems(9))
    write_jsonl(root / "held_out.jsonl", say_problems(5, start=20))
    return root


def stage_args(data: Path, out: Path, model: Path, steps: int, extra=()) -> list[str]:
    return ["configs/tiny/stage1.yaml", f"model_path={model}", f"data=[{data / 'train.jsonl'}]", f"out_dir={out}",
            "prompts_per_step=6", "rollouts_per_prompt=8", "group_size=4", "max_tokens_per_micro_batch=256",
            "rollout_batch_size=8",  # a group's 8 rollouts at a time: under schedule=balanced every rank claims often
            "updates_per_step=3", f"steps={steps}", "lr=1e-3", "warmup_steps=10", "max_response_tokens=96",
            f"eval_data={data / 'held_out.jsonl'}", "eval_every=1", "eval_samples=2", "eval_limit=0",
            "save_every=1", "torch_threads=1", "tool_workers=1", *extra]


def two_stages(data: Path, kind: str, world: int) -> Path:
    """Stage 1 (3 steps) and stage 2 (2 steps, from stage 1's model and AdamW state) at one launch setting."""
    root = data / f"{kind}{world}"
    train(kind, world, stage_args(data, root / "stage1", data / "base", 3))
    train(kind, world, stage_args(data, root / "stage2", root / "stage1" / "model", 2,
                                  ["stage=2", f"optimizer_from={root / 'stage1'}"]))
    return root


@pytest.fixture(scope="module")
def one(data):
    return two_stages(data, "ddp", 1)


@pytest.fixture(scope="module")
def runs(data):
    """two_stages at a launch setting, run once for the module whichever test asks first."""
    done = {}

    def at(kind: str, world: int) -> Path:
        if (kind, world) not in done:
            done[kind, world] = two_stages(data, kind, world)
        return done[kind, world]
    return at


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]  # timings differ run to run


def per_call(out: Path, name: str, world: int) -> list:
    """Every rank's records of one kind merged call by call (ranks make the same calls in the same order)."""
    ranks = [[json.loads(line) for line in (out / f"{name}{r}.jsonl").read_text().splitlines()] for r in range(world)]
    assert len({len(r) for r in ranks}) == 1, [len(r) for r in ranks]
    if name == "rollouts":
        return [(calls[0]["temperature"], sorted(p for c in calls for p in c["problems"])) for calls in zip(*ranks)]
    return [sorted(x for c in calls for x in c) for calls in zip(*ranks)]


def weights(out: Path) -> dict:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(out / "model").state_dict()


def assert_same_run(reference: Path, other: Path, world: int, reference_world: int = 1) -> None:
    # the data each step rolled out (training and held-out calls), and what each optimizer step trained on
    assert per_call(other, "rollouts", world) == per_call(reference, "rollouts", reference_world)
    assert per_call(other, "kept", world) == per_call(reference, "kept", reference_world)
    assert_same_metrics_and_weights(reference, other)


def assert_same_metrics_and_weights(reference: Path, other: Path) -> None:
    """Counts and their ratios equal; losses and weights within the float tolerances of another reduction order."""
    m1, m2 = metrics(reference), metrics(other)
    assert [r["step"] for r in m2] == [r["step"] for r in m1]
    assert [r["loss/lr"] for r in m2] == pytest.approx([r["loss/lr"] for r in m1], rel=1e-12)
    for a, b in zip(m1, m2):
        assert a.keys() == b.keys()
        for key in a:
            if key.startswith("loss/") and key != "loss/lr":
                assert b[key] == pytest.approx(a[key], abs=LOSS_TOL), (a["step"], key)
            else:  # lr, rewards, RoC and held-out statistics: counts and their ratios, equal
                assert b[key] == pytest.approx(a[key], rel=1e-12, abs=1e-12), (a["step"], key)
    w1, w2 = weights(reference), weights(other)
    gap = max((w2[name] - w1[name]).abs().max().item() for name in w1)
    assert gap <= WEIGHT_TOL, gap


@pytest.mark.parametrize("kind,world", [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("fsdp", 3)])
def test_invariance_of_rl_training_to_the_number_of_processes(data, one, runs, kind, world):
    other = runs(kind, world)
    lrs = [r["loss/lr"] for r in metrics(one / "stage1")]
    # warm-up in optimizer steps, three per RL step: the lr of each step's first one is 1e-3 * (3 s + 1) / 10
    assert lrs == pytest.approx([1e-4, 4e-4, 7e-4])
    for stage in ("stage1", "stage2"):
        assert_same_run(one / stage, other / stage, world)


LORA = ["lora_rank=4", "lr=1e-2"]


@pytest.fixture(scope="module")
def one_lora(data):
    out = data / "lora1"
    train("ddp", 1, stage_args(data, out, data / "base", 3, LORA))
    return out


@pytest.mark.parametrize("kind,world", [("ddp", 2), ("fsdp", 2)])
def test_invariance_of_a_lora_stage_to_the_number_of_processes(data, one_lora, kind, world):
    """A LoRA stage (plumbing/lora.py) under DDP and FSDP2: the rollouts, kept rollouts, metrics, merged model/ and
    adapter of one process; the hand-off of merged layers checked every step on every rank."""
    other = data / f"lora_{kind}{world}"
    train(kind, world, stage_args(data, other, data / "base", 3, LORA))
    assert_same_run(one_lora, other, world)
    from safetensors.torch import load_file
    a, b = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (one_lora, other))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= WEIGHT_TOL


@pytest.mark.parametrize("world", [2, 3])
def test_a_balanced_update_equals_the_unbalanced_one(data, runs, world):
    """schedule=balanced (rollouts claimed one at a time as engines free up, a prompt's rollouts on whichever ranks
    claim them, the update's rollouts spread by tokens; the invariance test's DDP run) against
    schedule=static (fixed shares, each rank trains on what it kept): the same rollouts, kept rollouts, metrics and
    weights up to float rounding, with rollouts moved between ranks in the balanced run and its update's lockstep
    slots better used. rollout_batch_size=8 (a group's 8 rollouts at a time) makes every rank claim as it finishes
    rollouts."""
    static = data / f"static{world}" / "stage1"
    train("ddp", world, stage_args(data, static, data / "base", 3, ["schedule=static"]))
    paths = {"static": static, "balanced": runs("ddp", world) / "stage1"}
    assert_same_run(paths["static"], paths["balanced"], world, world)
    claimed = [sum(len(json.loads(line)["problems"]) for line in (paths["balanced"] / f"rollouts{r}.jsonl")
                   .read_text().splitlines()) for r in range(world)]
    assert min(claimed) > 0, claimed  # every rank rolled out prompts
    rows = {s: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            for s, out in paths.items()}
    assert all(r["perf/update_moved_frac"] == 0 for r in rows["static"])
    assert max(r["perf/update_moved_frac"] for r in rows["balanced"]) > 0
    eff = {s: sum(r["perf/update_lockstep_eff"] for r in rs) for s, rs in rows.items()}
    assert eff["balanced"] > eff["static"], eff


@pytest.fixture(scope="module")
def written(data):
    """Stage 1's first 2 steps on 2 processes, once per launch kind: what the resume tests continue, each a copy."""
    done = {}

    def by(kind: str) -> Path:
        if kind not in done:
            done[kind] = data / f"written-{kind}2" / "stage1"
            train(kind, 2, stage_args(data, done[kind], data / "base", 2))
        return done[kind]
    return by


def resumed(data: Path, written: Path, kind: str, resumed_on: int, name: str) -> Path:
    """A copy of `written` (stage 1's first 2 steps on 2 processes) continued with its third step on `resumed_on`
    (as a run that lost nodes continues on fewer, or on more)."""
    out = data / name / "stage1"
    shutil.copytree(written, out)
    train(kind, resumed_on, stage_args(data, out, data / "base", 3, ["resume_allow_changes=[steps]"]))
    return out


def assert_continues(reference: Path, run: Path) -> None:
    m1, m2 = metrics(reference), metrics(run)
    assert [r["step"] for r in m2] == [1, 2, 3]
    for a, b in zip(m1, m2):
        for key in a:
            tol = LOSS_TOL if key.startswith("loss/") and key != "loss/lr" else 1e-12
            assert b[key] == pytest.approx(a[key], rel=1e-12, abs=tol), (a["step"], key)
    w1, w2 = weights(reference), weights(run)
    assert max((w2[name] - w1[name]).abs().max().item() for name in w1) <= WEIGHT_TOL


@pytest.mark.parametrize("kind,resumed_on", [("ddp", 1), ("ddp", 3), ("fsdp", 3)])
def test_invariance_of_a_resume_on_another_number_of_processes(data, one, written, kind, resumed_on):
    run = resumed(data, written(kind), kind, resumed_on, f"resume-{kind}2-{resumed_on}")
    assert_continues(one / "stage1", run)


def test_a_sharded_checkpoint_resumed_without_fsdp_is_refused_in_one_line(data, written):
    out = data / "fsdp-to-plain" / "stage1"
    shutil.copytree(written("fsdp"), out)
    done = subprocess.run([sys.executable, str(SCRIPT)] + stage_args(data, out, data / "base", 3,
                                                                     ["resume_allow_changes=[steps]"]),
                          env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("resume error: ") and "FSDP" in last and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_no_fsdp_rank_holds_a_whole_gradient_between_micro_batches(data):
    """Under FSDP2 each micro-batch's gradient is reduce-scattered into the shards as it comes (train.update_policy):
    after every backward no rank holds any parameter's whole gradient, which would cost 4 bytes per parameter of
    the model on every GPU (fp32 reduce dtype) until the mini-batch ends."""
    out = data / "grads" / "stage1"
    prefix, extra = launcher("fsdp", 2)
    done = subprocess.run(prefix + [str(SCRIPT)] + stage_args(data, out, data / "base", 1, ["updates_per_step=1"]),
                          env={**ENV, **extra, "WATCH_GRADS": "1"}, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        rows = [json.loads(line) for line in (out / f"grads{rank}.jsonl").read_text().splitlines()]
        assert len(rows) >= 3  # several micro-batches in the one mini-batch
        assert [r["held"] for r in rows] == [0] * len(rows), rows


HSDP_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: "no"
num_machines: 1
num_processes: 4
machine_rank: 0
rdzv_backend: static
same_network: true
use_cpu: false
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Qwen3DecoderLayer
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: true
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
"""


def test_hsdp_all_reduces_across_replicas_once_per_optimizer_step(data):
    """HSDP on a 2 x 2 mesh of 4 CPU processes (configs/accelerate/fsdp_8node_64gpu.yaml's layout, scaled down):
    each micro-batch's gradient is reduce-scattered within a shard group as it comes, and the all-reduce across the
    replicas runs once per FSDP2 parameter group at each mini-batch's last micro-batch, not after every one. The
    deferred sums are the same gradients: the run matches one process's."""
    config = data / "hsdp.yaml"
    config.write_text(HSDP_CONFIG)
    out, reference = data / "hsdp4" / "stage1", data / "hsdp1" / "stage1"
    eight = ["prompts_per_step=8", "eval_data=null"]  # a step that divides over 4 ranks
    train("ddp", 1, stage_args(data, reference, data / "base", 3, eight))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), str(SCRIPT)] + stage_args(data, out, data / "base", 3, eight)
    done = subprocess.run(command, env={**ENV, "CPU_FSDP": "1", "COUNT_ALL_REDUCE": "1"}, cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(4):
        rows = [json.loads(line) for line in (out / f"allreduce{rank}.jsonl").read_text().splitlines()]
        minibatches, current = [], []
        for row in rows:
            if "step" in row:
                minibatches.append(current)
                current = []
            else:
                current.append(row["all_reduces"])
        assert len(minibatches) == 9  # 3 steps x 3 updates
        assert max(len(m) for m in minibatches) > 1  # several micro-batches in a mini-batch
        groups = minibatches[0][-1]
        assert groups > 0  # the replicas' all-reduce is in play
        assert all(m == [0] * (len(m) - 1) + [groups] for m in minibatches), minibatches
    assert_same_run(reference, out, 4)


@pytest.mark.parametrize("world", [2, 3])
def test_free_kv_claims_on_several_processes_give_the_count_rule_run_on_one(data, one, world):
    """claim_rule=free_kv (a rank claims while its scripted sampler reports a free slot, as the hf sampler does; 3
    slots, so it fills and stops):
    the rollouts, kept rollouts, counts and losses of the count rule's run on one process, and every rank claimed."""
    out = data / f"free_kv{world}"
    train("ddp", world, stage_args(data, out, data / "base", 3, ["claim_rule=free_kv", "rollout_batch_size=3"]))
    assert_same_run(one / "stage1", out, world)
    claimed = [sum(len(json.loads(line)["problems"]) for line in (out / f"rollouts{r}.jsonl").read_text().splitlines())
               for r in range(world)]
    assert min(claimed) > 0, claimed
