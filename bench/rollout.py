"""Throughput of multi-turn agentic rollouts (with real tool calls) against plain generation, side by side.

    .venv/bin/python bench/rollout.py [--n 32 --threads 1 --sft-steps 150 --model-dir DIR --rounds 3]
    .venv-vllm/bin/python bench/rollout.py --vllm  # the same workload on vLLM too (its CPU build: fp32)
    .venv-vllm/bin/python bench/rollout.py --vllm --bf16 --model runs/smol/sft/model \
        --problems runs/smol/data/train.jsonl --config configs/smollm2-135m/rl.yaml --n 64 --max-response-tokens 256
                                                  # a real LM: make smol's SFT model of SmolLM2-135M, its prompts

What is compared, on the same tiny model and the same N prompts, in each round:
- agentic: `rollout.rollout` with HFSampler (continuous batching) and the real CodeTool: several turns per rollout,
           each tool call dispatched as its turn ends, the conversation rejoining the batch when the result is back
           (only the tool response is read; earlier turns' keys and values are reused). Run once continuous and once
           with sync_turns=True (every turn waits for all tool calls of the batch).
- its plain twins, the same prompts and per sequence exactly as many sampled tokens as its rollout sampled in all
  its turns, one turn, no tools, no stop token:
    * HFSampler, no tools: the same decode loop (the strict comparison: only the agentic work differs);
    * model.generate: transformers' own batched `generate` with the KV cache.
  ratio = agentic sampled tokens/s / twin tokens/s, for each twin.
- with --vllm, the same rollouts (both modes) on VLLMSampler (vLLM's continuous batching and prefix caching; the
  real engine, its CPU build in fp32 eager mode here, built and warmed once, run in this process) and its plain
  twin, one vLLM `generate` sampling exactly as many tokens per sequence with no stop; each starts with vLLM's
  prefix cache emptied. vLLM samples other tokens than HFSampler (another engine, another random stream), so the
  two are compared by tokens/s: vLLM agentic tok/s / HFSampler agentic tok/s, per mode.
Throughput = tokens the policy sampled / seconds (tool text is read, not sampled, so it only costs). The ratios are
given by wall clock and by this process's CPU seconds (the tool's processes excluded), median and range over
`--rounds` rounds: on a shared machine the CPU ratio is the steadier one. "gen s" is the time inside
`sampler.step`; the rest of "wall s" is waiting for tools and bookkeeping. "ctx" (mean context under a sampled
token) and "read" (tool-response tokens) show the work the twins do not have, and the last table says where the
sampler's seconds go: prefill (reading prompts and tool responses) and decode forwards, the token rows each
computes (rows x new tokens, padding included) and the attention cells (token rows x attended columns), for
HFSampler only.

How the random tiny model is made to call the tool, honestly: it is first fine-tuned for a few steps (`--sft-steps`)
on scripted conversations (problem "Compute a*b.", a call `print(a*b)`, the real tool output, a check call, the
answer) with loss on the assistant tokens only. Rollouts then SAMPLE from that model at temperature 1.0: nothing
is forced, so some calls are malformed or wrong, as in real RL. The numbers it copies are usually wrong; that does
not matter for throughput.

With --model, the model is that checkpoint instead (no fine-tuning here), the problems the first N of --problems
(a task's JSONL), and the prompt and tool markup --config's (its system prompt, user instruction and tool name).
--bf16 runs as train.py does under mixed_precision bf16: HFSampler and `generate` under bf16 autocast (HFSampler's
KV cache in bf16), vLLM in bf16.

torch threads: `--threads 1` (default) leaves the second core to the tool's workers (plumbing/cpu_threads.py).
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,  # noqa: E402
                          StoppingCriteria, StoppingCriteriaList)

from code_tool import CodeTool  # noqa: E402
from protocol import TOOL_NAME, chat_format  # noqa: E402
from rollout import means, rollout, rollout_sums  # noqa: E402
from samplers.hf import HFSampler  # noqa: E402
from samplers.interface import generate_all  # noqa: E402
from sft import build_labels, collate, masked_lm_loss  # noqa: E402
from tiny.model import build_tiny  # noqa: E402


def conversation(rng: random.Random) -> tuple[str, list[dict]]:
    """A scripted three-turn tool conversation: compute, check, answer (tool outputs as CodeTool renders them)."""
    a, b = rng.randint(100, 999), rng.randint(10, 99)

    def call(code):
        return [{"function": {"name": TOOL_NAME, "arguments": {"code": code, "input": ""}}}]
    problem = f"Compute {a}*{b}."
    return problem, [
        {"role": "user", "content": problem},
        {"role": "assistant", "content": "Use Python.</reason>\n", "tool_calls": call(f"print({a}*{b})")},
        {"role": "tool", "content": f"ok\n{a * b}\n"},
        {"role": "assistant", "content": "Check it.</reason>\n", "tool_calls": call(f"print({a * b}//{b})")},
        {"role": "tool", "content": f"ok\n{a}\n"},
        {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{a * b}}}</answer>"},
    ]


def sft(model, tokenizer, fmt, steps: int, batch: int = 8, lr: float = 3e-3, seed: int = 0) -> float:
    """A few steps of plain SFT on scripted conversations; returns the last loss."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        examples = [build_labels(tokenizer, fmt.render_messages(conversation(rng)[1])) for _ in range(batch)]
        b = collate(examples, tokenizer.pad_token_id)
        loss = masked_lm_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                              b["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


class Timed:
    """Wraps a sampler and adds up the seconds inside `step` (the rest of a rollout's wall time is tool waits and
    bookkeeping)."""

    def __init__(self, sampler):
        self.sampler, self.seconds = sampler, 0.0
        self.add, self.has_work = sampler.add, sampler.has_work

    def step(self):
        start = time.perf_counter()
        out = self.sampler.step()
        self.seconds += time.perf_counter() - start
        return out


class Probe(Timed):
    """Wraps an HFSampler: seconds inside `step`, split into prefill (`_admit`: reading prompts and tool responses)
    and decode (`_decode`: one token for every live row), the forwards of each and the token rows they compute
    (rows x new tokens), and the attention cells (token rows x attended columns). The rest of a rollout's wall time
    is tool waits and bookkeeping."""

    def __init__(self, sampler):
        super().__init__(sampler)
        self.parts = {part: {"s": 0.0, "forwards": 0, "token_rows": 0, "cells": 0} for part in ("prefill", "decode")}
        self.current = None
        for part, method in (("prefill", "_admit"), ("decode", "_decode")):
            setattr(sampler, method, self._timed(part, getattr(sampler, method)))
        forward = sampler._forward

        def counted(ids, pos, seen, cache):
            row = self.parts[self.current]
            row["forwards"] += 1
            row["token_rows"] += ids.numel()
            row["cells"] += ids.numel() * (cache.length + ids.shape[1] - cache.first)
            return forward(ids, pos, seen, cache)
        sampler._forward = counted

    def _timed(self, part, method):
        def timed():
            self.current, start = part, time.perf_counter()
            try:
                return method()
            finally:
                self.parts[part]["s"] += time.perf_counter() - start
        return timed


class _Budgets(StoppingCriteria):
    """Each row of a plain `generate` stops after its own number of new tokens (finished rows are still computed
    until the last one ends: that is how `generate` batches)."""

    def __init__(self, width: int, budgets: list[int]):
        self.width, self.budgets = width, torch.tensor(budgets)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] - self.width >= self.budgets


def plain_generate(model, tokenizer, prompts: list[list[int]], lengths: list[int]) -> float:
    """Seconds for one batched transformers `generate` (its own KV cache, left padding) in which row r samples
    exactly lengths[r] tokens, no stop token, no tools."""
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=max(lengths),
                              min_new_tokens=max(lengths), pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, return_dict_in_generate=True, output_logits=True)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                       stopping_criteria=StoppingCriteriaList([_Budgets(width, lengths)]))
    return time.perf_counter() - start


MODES = ("continuous", "turn by turn")
# each agentic rollout and its plain twins (the same prompts and tokens per sequence, one turn, no tools)
TWINS = {"hf agentic": ("HFSampler, no tools", "model.generate"), "vllm agentic": ("vLLM, no tools",)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=32, help="rollouts per batch (N)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--max-response-tokens", type=int, default=512)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--workers", type=int, default=None, help="code tool workers (default: CodeTool's)")
    p.add_argument("--model-dir", default=None, help="reuse/keep the fine-tuned tiny model here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="repeat the whole comparison; medians are reported")
    p.add_argument("--vllm", action="store_true", help="also vLLM (its CPU build here: fp32, eager)")
    p.add_argument("--model", default=None, help="a checkpoint to roll out instead of the tiny tool model")
    p.add_argument("--problems", default=None, help="with --model: a JSONL of {problem, answer}, the first N used")
    p.add_argument("--config", default=None, help="with --model: a train.py config whose prompt and tool markup apply")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (HFSampler, generate) and a bf16 vLLM")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    if a.model:
        fmt, model_dir = config_format(a.config), Path(a.model)
        problems = [json.loads(line)["problem"] for line in Path(a.problems).read_text().splitlines()[:a.n]]
    else:
        fmt = chat_format("compact")
        model_dir = tiny_tool_model(a, fmt)
        rng = random.Random(a.seed + 1)
        problems = [conversation(rng)[0] for _ in range(a.n)]
    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    if a.bf16:  # as Accelerate runs the trainer's forward under mixed_precision bf16
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    prompts = [tokenizer.encode(fmt.prompt(q), add_special_tokens=False) for q in problems]
    engine = None
    if a.vllm:
        from samplers.vllm_engine import VLLMSampler
        engine = VLLMSampler(str(model_dir), tokenizer, dtype="bfloat16" if a.bf16 else "float32",
                             enforce_eager=True, seed=a.seed, kv_cache_memory_bytes=(1 << 30) if a.model else 256 << 20)
        generate_all(engine, prompts, [16] * a.n)  # warm the engine: its first steps are slow
    rounds = []  # per round: {mode: {name: row}}
    with CodeTool(workers=a.workers) as tool:
        tool.run_batch([("print(1)", "")] * tool.workers)  # warm the workers
        for _ in range(a.rounds):
            rounds.append({mode: measure(model, tokenizer, engine, fmt, tool, problems, prompts, a,
                                         sync_turns=mode == "turn by turn") for mode in MODES})
        workers, sandbox = tool.workers, tool.sandbox
    if engine is not None:
        engine.close()
    print(f"\nmodel {model_dir if a.model else 'tiny'} ({'bf16 autocast' if a.bf16 else 'fp32'}), "
          f"N={a.n}, torch threads={a.threads}, tool workers={workers}, sandbox={sandbox}, "
          f"budget={a.max_response_tokens}, max_turns={a.max_turns}; round 1 of {a.rounds}:")
    print_round(rounds[0])
    print_medians(rounds)
    print_breakdown(rounds[0]["continuous"])


def config_format(path: str):
    """The ChatFormat of a train.py config file (its prompt and tool-markup fields)."""
    from plumbing.config import load_config
    from plumbing.train_config import TrainConfig
    from protocol import chat_format_of
    return chat_format_of(load_config(TrainConfig, [path], ["data=[unused.jsonl]"]))


def tiny_tool_model(a, fmt) -> Path:
    """The directory of the tiny model fine-tuned to call the tool (made, or reused when made for this prompt and
    this many SFT steps)."""
    model_dir = Path(a.model_dir or tempfile.mkdtemp(prefix="bench_rollout_"))
    stamp = model_dir / "sft_prompt.txt"  # the fine-tuned model is only valid for the prompt it was trained on
    if not stamp.exists() or stamp.read_text() != fmt.prompt("") + f"|{a.sft_steps}":
        build_tiny(model_dir, seed=a.seed)
        tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
        start = time.perf_counter()
        loss = sft(model, tokenizer, fmt, a.sft_steps, seed=a.seed)
        print(f"SFT: {a.sft_steps} steps in {time.perf_counter() - start:.0f} s, last loss {loss:.3f}")
        model.save_pretrained(model_dir)
        stamp.write_text(fmt.prompt("") + f"|{a.sft_steps}")
    return model_dir


def measure(model, tokenizer, engine, fmt, tool, problems, prompts, a, sync_turns: bool) -> dict:
    """One agentic rollout on HFSampler and its two plain twins, and with a vLLM engine one on VLLMSampler and its
    vLLM twin: {name: row}, a row being sampled, read, ctx, wall, cpu (this process), gen, and more."""
    kv = torch.bfloat16 if a.bf16 else None  # under autocast, as train.py's sampler (plumbing/rl_stage.py)
    probe = Probe(HFSampler(model, tokenizer, batch_size=a.n, kv_dtype=kv))
    out = {"hf agentic": agentic_row(probe, tool, tokenizer, fmt, problems, a, sync_turns)}
    out["hf agentic"]["parts"] = probe.parts
    lengths = out["hf agentic"]["lengths"]
    twin = Probe(HFSampler(model, tokenizer, batch_size=a.n, stop_ids=[], kv_dtype=kv))  # each budget run out
    wall, cpu, _ = clocked(generate_all, twin, prompts, lengths, temperature=1.0)
    out["HFSampler, no tools"] = twin_row(prompts, lengths, wall, cpu, twin.seconds, parts=twin.parts)
    _, cpu, seconds = clocked(plain_generate, model, tokenizer, prompts, lengths)
    out["model.generate"] = twin_row(prompts, lengths, seconds, cpu, seconds)
    if engine is not None:
        engine.llm.reset_prefix_cache()  # a fresh rollout, as after a weight update
        out["vllm agentic"] = agentic_row(Timed(engine), tool, tokenizer, fmt, problems, a, sync_turns)
        lengths = out["vllm agentic"]["lengths"]
        _, cpu, seconds = clocked(vllm_plain, engine, prompts, lengths)
        out["vLLM, no tools"] = twin_row(prompts, lengths, seconds, cpu, seconds)
    return out


def clocked(run, *args, **kwargs) -> tuple[float, float, object]:
    """(wall seconds, this process's CPU seconds, result) of run(*args, **kwargs)."""
    start, cpu = time.perf_counter(), time.process_time()
    out = run(*args, **kwargs)
    return time.perf_counter() - start, time.process_time() - cpu, out


def agentic_row(sampler: Timed, tool, tokenizer, fmt, problems, a, sync_turns: bool) -> dict:
    """One agentic rollout through `sampler`; its row, with the tokens sampled per sequence ("lengths")."""
    torch.manual_seed(a.seed)
    wall, cpu, trajs = clocked(rollout, problems, sampler, tool, tokenizer, fmt, a.max_response_tokens,
                               a.max_turns, temperature=1.0, sync_turns=sync_turns)
    lengths = [sum(t.loss_mask) for t in trajs]
    # mean context length under each sampled token (attention cost per token grows with it)
    context = sum(len(t.prompt_ids) + i for t in trajs for i, m in enumerate(t.loss_mask) if m) / sum(lengths)
    return {"sampled": sum(lengths), "read": sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs),
            "ctx": context, "wall": wall, "cpu": cpu, "gen": sampler.seconds, "lengths": lengths,
            "stats": means(rollout_sums(trajs, [0.0] * len(trajs)))}


def twin_row(prompts, lengths, wall: float, cpu: float, gen: float, **more) -> dict:
    """The row of a plain twin that sampled lengths[r] tokens after prompts[r], reading nothing else."""
    context = sum(len(p) + i for p, n in zip(prompts, lengths) for i in range(n)) / sum(lengths)
    return {"sampled": sum(lengths), "read": 0, "ctx": context, "wall": wall, "cpu": cpu, "gen": gen, **more}


def ratio(row: dict, other: dict, clock: str = "wall") -> float:
    """Sampled tokens per second of `row` over `other`'s (for a twin, the same tokens: a time ratio)."""
    return row["sampled"] / row[clock] / (other["sampled"] / other[clock])


def print_round(rows_by_mode: dict) -> None:
    """The table of one round: each agentic rollout, then its twins."""
    print("ratio = agentic tok/s / the tok/s of each twin under it (hf: HFSampler no tools | transformers "
          "generate; vllm: vLLM no tools)")
    print("ctx = mean context length under a sampled token; read = tool-response tokens read (prefill only)")
    print(f"{'mode':<30}{'sampled':>8}{'read':>6}{'ctx':>5}{'wall s':>8}{'gen s':>7}{'tok/s':>7}{'ratio':>12}"
          f"{'turns':>7}{'calls':>7}{'fail %':>7}{'trunc %':>8}")
    for mode, rows in rows_by_mode.items():
        for agentic, twins in TWINS.items():
            if agentic not in rows:
                continue
            row, stats = rows[agentic], rows[agentic]["stats"]
            ratios = " | ".join(f"{ratio(row, rows[twin]):.2f}" for twin in twins)
            print(f"{row_start(f'{agentic}, {mode}', row)}{ratios:>12}{stats['turns_mean']:>7.2f}"
                  f"{stats['tool_calls_mean']:>7.2f}{100 * stats['tool_error_rate']:>7.1f}"
                  f"{100 * stats['truncated_frac']:>8.1f}")
            for twin in twins:
                print(row_start(f"  twin: {twin}", rows[twin]))


def row_start(label: str, row: dict) -> str:
    return (f"{label:<30}{row['sampled']:>8}{row['read']:>6}{row['ctx']:>5.0f}{row['wall']:>8.2f}"
            f"{row['gen']:>7.2f}{row['sampled'] / row['wall']:>7.0f}")


def print_medians(rounds: list[dict]) -> None:
    """Median and range over rounds of each agentic rollout's tok/s over its twins', and vLLM's over HFSampler's."""
    print(f"\nmedian over {len(rounds)} rounds (range) of tok/s ratios, by wall clock and by the CPU seconds of "
          "this process")
    for mode in MODES:
        pairs = [(agentic, twin) for agentic, twins in TWINS.items() if agentic in rounds[0][mode] for twin in twins]
        if "vllm agentic" in rounds[0][mode]:
            pairs.append(("vllm agentic", "hf agentic"))
        for name, other in pairs:
            for clock in ("wall", "cpu"):
                values = [ratio(rd[mode][name], rd[mode][other], clock) for rd in rounds]
                print(f"  {mode:<13} {name:<13}/ {other:<20} {clock:<4} {statistics.median(values):.2f} "
                      f"({min(values):.2f}-{max(values):.2f})")


def print_breakdown(rows: dict) -> None:
    """Where HFSampler's seconds go in the continuous agentic rollout and in its HFSampler twin."""
    print("\nwhere the seconds go, continuous agentic rollout against its HFSampler twin (round 1):")
    print(f"{'':<12}{'part':<10}{'s':>7}{'forwards':>10}{'token rows':>12}{'attn cells':>12}")
    for name in ("hf agentic", "HFSampler, no tools"):
        row = rows[name]
        for part, p in row["parts"].items():
            print(f"{name[:11]:<12}{part:<10}{p['s']:>7.2f}{p['forwards']:>10}{p['token_rows']:>12,}{p['cells']:>12,}")
        print(f"{name[:11]:<12}{'outside':<10}{row['wall'] - row['gen']:>7.2f}   (tool waits, bookkeeping)")


def vllm_plain(sampler, prompts: list[list[int]], lengths: list[int]) -> float:
    """Seconds for one vLLM `generate` in which row r samples exactly lengths[r] tokens (no stop), no tools."""
    from vllm import SamplingParams
    params = [SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0,
                             detokenize=False) for n in lengths]
    sampler.llm.reset_prefix_cache()  # the agentic run left these prompts cached: the twin reads them too
    start = time.perf_counter()
    sampler.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
