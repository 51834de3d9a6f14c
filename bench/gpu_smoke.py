"""GPU smoke check: a few real train.py steps at a real model's shape on one GPU, with nothing downloaded.

    python bench/gpu_smoke.py            # one GPU: Qwen3-0.6B's shape, bf16; at most ~8 minutes
    python bench/gpu_smoke.py --tiny     # CPU (CI): a tiny shape, fp32, under a minute; the same code path

What runs: a randomly initialised Qwen3 model built from Qwen3-0.6B's public config (memory_plan.PUBLIC_CONFIGS)
and a character tokenizer padded to its 151,936-token vocabulary (tiny_model.build_tokenizer), saved to a
temporary folder; then `train.py configs/qwen3-0.6b/stage1.yaml` with small sizes, launched with `accelerate launch
--config_file configs/accelerate/fsdp_1gpu.yaml` (FSDP2 on one process: fp32 master weights, bf16 compute),
gradient checkpointing, HFSampler rollouts with the code tool's workers running, the weight hand-off and its check
after every step, checkpoints and the final save. On the CPU, Accelerate runs no FSDP, so --tiny launches through
tests/cpu_fsdp.py, which switches it on: the same code path, on gloo.

A random model never answers right, and every group of equal rewards would be dropped, leaving the update nothing
to train on: the check scores each group's rollouts by a fixed pattern (every other one correct), so the update
sees the sizes a real step does (its loss is then ~0: at ratio 1 the advantages of equal-length rollouts cancel;
the gradient is not 0). It never calls the tool either; one direct call checks the tool's sandbox.

Prints per step: sampled tokens/s of the rollout, trained tokens/s of the update (prompt + response tokens of the
kept rollouts / update seconds), step time and, on a GPU, peak memory of each phase next to memory_plan.py's
estimate. Exits non-zero on a failed run (the hand-off check stops train.py), a non-finite loss or gradient norm,
an update with nothing to train on, or a run over the time limit.
"""
import argparse
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

from memory_plan import PUBLIC_CONFIGS, Shape, memory_per_gpu  # noqa: E402

TIME_LIMIT_S = 450  # the lent GPU machine's budget for this check is 8 minutes, start-up included
TINY_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512, "tie_word_embeddings": True,
               "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}
# Sizes of the smoke run (GPU, --tiny): small enough for the time limit, large enough to be a real step.
SIZES = {
    "gpu": {"steps": 3, "prompts_per_step": 4, "rollouts_per_prompt": 8, "group_size": 4,
            "max_response_tokens": 1024, "micro_batch_size": 4, "rollout_batch_size": 32, "mixed_precision": "bf16"},
    "tiny": {"steps": 2, "prompts_per_step": 2, "rollouts_per_prompt": 4, "group_size": 2,
             "max_response_tokens": 24, "micro_batch_size": 4, "rollout_batch_size": 8, "mixed_precision": "no"},
}


def build(folder: Path, config: dict, device: str, dtype: torch.dtype) -> Path:
    """A random Qwen3 model of `config`'s shape and a tokenizer with its vocabulary, saved to `folder`."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from tiny_model import build_tokenizer
    tokenizer = build_tokenizer(vocab_size=config["vocab_size"])
    cfg = Qwen3Config(**config, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(cfg, torch_dtype=dtype)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def train_args(work: Path, sizes: dict, tiny: bool) -> list[str]:
    args = ["configs/qwen3-0.6b/stage1.yaml", f"model_path={work / 'model'}", f"data=[{work / 'problems.jsonl'}]",
            f"out_dir={work / 'run'}", "sampler=hf", "eval_data=null", "report_to=null", "save_every=1000",
            "max_turns=2", "tool_workers=2", "warmup_steps=1", "gradient_checkpointing=true"]
    args += [f"{k}={v}" for k, v in sizes.items()]
    return args + (["torch_threads=1"] if tiny else [])


# ------------------------------------------------------------------------------ the launched process
def worker(argv: list[str]) -> None:
    """train.main(argv) with the fixed-pattern reward and per-phase timers; writes smoke.json next to the run."""
    import train
    from reward import Verdict
    cuda = torch.cuda.is_available()
    steps: list[dict] = []

    def pattern(preds, golds):  # every other rollout "correct": each group has both rewards
        return [Verdict(i % 2 == 0, "smoke") for i in range(len(preds))]

    def timed(name, fn, sizes):
        """fn, timed, with its peak GPU memory and `sizes(args, result)` recorded in this step's entry."""
        def wrapped(*args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            if name == "rollout":
                steps.append({})
            steps[-1].update({f"{name}_s": time.perf_counter() - t0, **sizes(args, result),
                              f"{name}_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None})
            return result
        return wrapped

    def trained(args, result):  # the kept (trajectory, advantage) pairs are update_policy's fifth argument
        lengths = [len(t.prompt_ids) + len(t.response_ids) for t, _ in args[4]]
        return {"update_tokens": sum(lengths), "longest": max(lengths, default=0)}

    train.check_many = pattern
    train.rollout = timed("rollout", train.rollout,
                          lambda args, result: {"rollout_tokens": sum(sum(t.loss_mask) for t in result)})
    train.update_policy = timed("update", train.update_policy, trained)
    train.main(argv)
    out = Path(next(a for a in argv if a.startswith("out_dir=")).split("=", 1)[1])
    (out / "smoke.json").write_text(json.dumps({"steps": steps, "gpu": torch.cuda.get_device_name() if cuda
                                                else "cpu"}))


# ------------------------------------------------------------------------------ the command
def tool_check() -> str:
    """One direct call of the code tool (a random model never calls it)."""
    from code_tool import CodeTool
    tool = CodeTool(workers=1, timeout=10.0)
    try:
        t0 = time.perf_counter()
        result = tool.run("print(sum(range(10)))")
        ms = (time.perf_counter() - t0) * 1e3
    finally:
        tool.close()
    if result.stdout.strip() != "45":
        raise SystemExit(f"gpu smoke: FAIL: the code tool answered {result.render()!r} to print(sum(range(10)))")
    return f"print(sum(range(10))) -> 45 in {ms:.0f} ms"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shape (what CI runs)")
    parser.add_argument("--keep", help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    gpu = torch.cuda.is_available() and not args.tiny
    if not gpu and not args.tiny:
        raise SystemExit("gpu smoke: no GPU here; run with --tiny for the CPU version")
    config = PUBLIC_CONFIGS["qwen3-0.6b"] if gpu else TINY_CONFIG
    sizes = SIZES["gpu" if gpu else "tiny"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        build(work / "model", config, "cuda" if gpu else "cpu", torch.bfloat16 if gpu else torch.float32)
        from data import write_jsonl
        write_jsonl(work / "problems.jsonl", [{"problem": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)}
                                              for i in range(16)])
        tool = tool_check()
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "configs/accelerate/fsdp_1gpu.yaml"), "--main_process_port", str(free_port())]
        if not gpu:  # Accelerate runs FSDP only on accelerators; tests/cpu_fsdp.py switches it on for CPUs
            launch += ["--mixed_precision", "no", str(ROOT / "tests/cpu_fsdp.py")]
        command = launch + [str(Path(__file__).resolve()), "--worker"] + train_args(work, sizes, args.tiny)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        budget = TIME_LIMIT_S - (time.perf_counter() - t_start)
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"gpu smoke: FAIL: over the time limit of {TIME_LIMIT_S} s") from None
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-6000:], sep="\n")
            raise SystemExit(f"gpu smoke: FAIL: train.py exited with {done.returncode} (output above)")
        report(work, config, sizes, gpu, tool, time.perf_counter() - t_start)


def report(work: Path, config: dict, sizes: dict, gpu: bool, tool: str, wall: float) -> None:
    """Print the figures; exit non-zero when a check fails."""
    smoke = json.loads((work / "run" / "smoke.json").read_text())
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    shape = Shape.from_config(config)
    print(f"gpu smoke on {smoke['gpu']}: {shape.params / 1e9:.2f}B parameters ({'Qwen3-0.6B' if gpu else 'tiny'} "
          f"shape, random), {'bf16' if gpu else 'fp32'}, gradient checkpointing, FSDP2 through Accelerate on one "
          f"process, HFSampler; {len(rows)} train.py steps of {sizes['prompts_per_step']} x "
          f"{sizes['rollouts_per_prompt']} rollouts, {sizes['max_response_tokens']} response tokens")
    print("step  rollout tok/s  update tok/s  step s  loss       grad norm  peak GB: rollout  update")
    problems = []
    for row, s in zip(rows, smoke["steps"]):
        peaks = (f"{s['rollout_peak_gb']:16.1f}  {s['update_peak_gb']:6.1f}" if gpu else f"{'n/a':>16}  {'n/a':>6}")
        rollout, update = s["rollout_tokens"] / s["rollout_s"], s["update_tokens"] / s["update_s"]
        print(f"{row['step']:4d}  {rollout:13,.0f}  {update:12,.0f}  {row['perf/step_s']:6.1f}  "
              f"{row['loss/policy']:9.2e}  {row['loss/grad_norm']:9.3g}  {peaks}")
        if not (math.isfinite(row["loss/policy"]) and math.isfinite(row["loss/grad_norm"])):
            problems.append(f"step {row['step']}: non-finite loss or gradient norm")
        if s["update_tokens"] == 0:
            problems.append(f"step {row['step']}: the update had nothing to train on")
    if gpu:
        seq = max(s["longest"] for s in smoke["steps"])  # prompt + response of the longest kept rollout
        m = memory_per_gpu(shape, shard=1, fsdp=True, micro_batch=sizes["micro_batch_size"], seq_tokens=seq,
                           gradient_checkpointing=True, sampler="hf", gpu_gb=141.0,
                           hf_slots=sizes["rollout_batch_size"])
        last = smoke["steps"][-1]
        print(f"memory (GB)      measured  memory_plan.py estimate (micro-batch {sizes['micro_batch_size']} x "
              f"{seq:,} tokens)")
        print(f"  rollout peak   {last['rollout_peak_gb']:8.1f}  {m['rollout_peak']:8.1f}")
        print(f"  update peak    {last['update_peak_gb']:8.1f}  {m['update_peak']:8.1f}  (logits {m['logits']:.1f}, "
              f"activations {m['activations']:.1f}, weights+grads+AdamW {m['weights'] + m['grads'] + m['adamw']:.1f})")
    print(f"hand-off check   passed at the start and after each of the {len(rows)} steps (train.py stops otherwise)")
    print(f"code tool        {tool}")
    print(f"wall time        {wall:.0f} s (limit {TIME_LIMIT_S} s)")
    if problems:
        raise SystemExit("gpu smoke: FAIL: " + "; ".join(problems))
    print("gpu smoke: PASS")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        main()
