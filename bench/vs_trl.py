"""Head to head with TRL's GRPOTrainer on the same work: a tiny RL stage (30 steps of 16 level-1 prompts, make tiny's
stage 1 when it was written), every arm from one SFT model.

    make vs-trl                                      # builds .venv-trl (torch 2.13.0 CPU, trl 1.16.0), 3 rounds
    .venv-trl/bin/python bench/vs_trl.py --rounds 3 [--sft runs/tiny/sft/model --data runs/tiny/data]
    .venv-trl/bin/python bench/vs_trl.py --quick     # one step per arm on a few short rollouts (the test's run)
    ... --wrap "CMD"   start each arm-round's process as `CMD python ...` (a CPU lock, `taskset`, `nice`)

Arms, run one at a time, each in a process of its own, in alternating order over `--rounds` (1 2 3 4, 4 3 2 1, ...):
  trl      TRL's GRPOTrainer with `tools=` (the code tool as a Python function), loss_type "dapo", transformers
           `generate` on the CPU
  trl_cb   the same with `use_transformers_continuous_batching` (transformers' paged continuous-batching engine)
  all      `train.py roc_mode=off`: all 8 rollouts of a group trained, as TRL does
  roc      `train.py` with Resample-on-Correct 8 -> 4 (the report's method): half the rollouts trained

The workload (`Workload`, pinned here and not read from configs/tiny, so retuning the tiny recipe leaves it alone):
the SFT model and tokenizer of make tiny (built through tiny_pipeline's own steps when absent); the level-1
problems in the order `train.prompt_indices` gives (seed 0), 16 prompts x 8 rollouts per step, rendered token for
token alike (TRL through `CHAT_TEMPLATE`, a chat template of protocol.py's markup; tests/test_vs_trl.py checks the
ids); temperature 1, top-p 1, no top-k; a budget of 320 response tokens with tool text, up to 4 assistant turns;
the project's CodeTool (2 workers, 2 s, 1,000 characters) and reward (reward.py, on the model's own text); AdamW
(0.9, 0.999), weight decay 0.01 on every weight, lr 2e-4 after 3 linear warm-up steps (TRL gets the same optimizer
and schedule objects); gradient-norm clip 1.0; clip 0.2 / 0.28, no KL term; one optimizer step per RL step over
micro-batches of 8; fp32, one torch thread; 30 steps. Then the same held-out evaluation of each arm's final model,
by the same code for all (eval.evaluate on HFSampler): the test split's 100 level-1 problems, 4 samples, T = 0.6.

What is measured, per arm and step (each step is the time from one optimizer step's end to the next, all in):
rollout (prompts in, every turn and tool call, completions out), inside it the seconds spent generating (ours:
inside `HFSampler.step`; TRL: inside `_generate_single_turn`) and the rest (tool calls and waiting for them, parsing),
the update (TRL: the step less `_generate_and_score_completions`; ours: train.py's `perf/update_s`) and the rest
(reward, advantages, RoC, the weight hand-off check, logging); the tokens each side sampled (every token a
generation call returned, the stop token included: the policies differ, so tokens/s is the fair rate); tool calls
and their summed latency; the reward per step; the process's peak RSS after training; the held-out pass@1.
train.py is run in-process (`train.main`) with its sampler and code tool wrapped by meters; train.py is unchanged.

Differences between the two workloads that could bias the ratio (docs/benchmarks.md says the same):
 1. Generation: TRL calls `model.generate` once per turn on every conversation still going, left-padded to the
    longest, each turn re-reading the whole history without a cache and running until the batch's longest turn
    ends; ours is one continuous batch (a slot per rollout, an in-place KV cache, earlier turns' keys and values
    reused, a finished turn leaving at once). trl_cb uses transformers' continuous batching, but still one
    `generate_batch` per turn, with a paged cache sized for this job (CB_CONFIG).
 2. Tool calls: TRL runs them one after another (a sync tool function per call) after the whole turn's batch ends;
    ours sends each call the moment its turn ends, on 2 workers, while the others keep generating.
 3. Budget: TRL lets every turn sample up to 320 new tokens and then cuts the completion back to the budget (the
    cut tokens are counted as sampled: they were computed); ours asks each turn for the budget that is left.
 4. The update: TRL pads every micro-batch to the longest rollout of the step, and computes per-token entropy (for
    its log) in every forward; ours sorts by length so each micro-batch pads to its own longest. Gradient
    checkpointing is off in both (GRPOConfig's default is on, which would add a recomputed forward to TRL's update).
 5. What is trained: TRL keeps groups whose 8 rewards are equal (advantage 0: no gradient, but their tokens are in
    the forward and in the dapo normaliser); train.py drops them before the update, in both arms, so as the policy
    learns, more groups are all correct and ours trains on fewer rollouts. RoC trains 4 of 8 per group by design.
 6. The protocol: TRL ends a rollout at a tool call it cannot parse (ours answers it with the error and goes on),
    runs every call of a turn (ours the first), and answers a call with unknown arguments with its own error text.
    Advantages: TRL divides by std + 1e-4, ours by std + 1e-6 (both unbiased std).
 7. Counting: TRL's step holds its data loading and logging, ours its checkpoint at the last step only; each
    side's first step holds its warm-up (tool workers, first forward); the medians are over all steps.
"""
import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plumbing import cpu_threads  # noqa: E402,F401  (first: OpenMP's wait policy, read when torch loads, as train.py has it)
import torch  # noqa: E402

from protocol import COMPACT_SYSTEM_PROMPT, TOOL_NAME, chat_format  # noqa: E402
from reward import check_many, extract_answer  # noqa: E402

ARMS = {"trl": "TRL GRPOTrainer, tools", "trl_cb": "TRL, continuous batching",
        "all": "train.py roc_mode=off (8 of 8)", "roc": "train.py RoC 8 -> 4"}
FMT = chat_format("compact", "")  # the tiny model's prompts: the compact system prompt, no instruction


@dataclass(frozen=True)
class Workload:
    steps: int = 30
    prompts: int = 16               # B per step
    rollouts: int = 8               # 2G sampled per prompt
    budget: int = 320               # response tokens per rollout, tool text included
    turns: int = 4                  # assistant turns per rollout
    temperature: float = 1.0
    lr: float = 2e-4
    warmup: int = 3                 # lr_t = lr * min(1, (t + 1) / warmup)
    micro_batch: int = 8            # sequences per forward/backward; one optimizer step per RL step
    seed: int = 0
    tool_workers: int = 2
    tool_timeout: float = 2.0
    tool_chars: int = 1000
    eval_problems: int = 100        # the first of the test split: its 100 level-1 problems
    eval_samples: int = 4
    eval_temperature: float = 0.6


QUICK = Workload(steps=1, prompts=2, rollouts=4, budget=96, eval_problems=4, eval_samples=2)

# A chat template of protocol.py's markup, for TRL (which renders prompts and tool responses with the tokenizer's
# template). System, user and assistant turns as ChatFormat writes them; a tool result as a user turn holding
# <tool_response>, so that what TRL appends after a tool call is exactly rollout.py's `tool_response_turn(text)`;
# the generation prompt is protocol.GENERATION_PREFIX. The tool's schema is not rendered: the compact system prompt
# names the tool, as in the tiny configs.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "<|im_start|>assistant\n{% if not m.content.startswith('<reason>') %}<reason>{% endif %}{{ m.content }}"
    "{% for call in m.tool_calls or [] %}"
    "<tool_call>\n{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<reason>{% endif %}"
)
# transformers' continuous batching sized for this job. Left to itself it sizes its paged cache from free memory
# (TRL caps it at half): 12 GB on a 24 GB machine, and every forward's attention mask spans the whole cache, so it ran
# 4x slower; this holds 8K tokens (128 rollouts of ~64) and reads at most 512 tokens a forward: the fastest of four
# sizes tried on this machine. It is still slower than plain `generate` here (docs/benchmarks.md).
CB_CONFIG = {"num_blocks": 128, "page_size": 64, "max_batch_tokens": 512}
# How transformers' `parse_response` reads a turn of this markup: each <tool_call> body as JSON, the rest as content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def trl_tokenizer(path):
    """The SFT model's tokenizer with CHAT_TEMPLATE and RESPONSE_TEMPLATE: what TRL needs for tools."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template, tokenizer.response_template = CHAT_TEMPLATE, RESPONSE_TEMPLATE
    return tokenizer


def prompt_messages(problem: str) -> list[dict]:
    return [{"role": "system", "content": COMPACT_SYSTEM_PROMPT}, {"role": "user", "content": problem}]


def ordered_rows(problems: list[dict], w: Workload) -> list[dict]:
    """TRL's dataset: the prompts train.py draws, step by step, in its order (TRL then reads it unshuffled)."""
    from train import prompt_indices
    return [{"prompt": prompt_messages(problems[i]["problem"]), "answer": problems[i]["answer"]}
            for step in range(w.steps) for i in prompt_indices(step, w.prompts, len(problems), w.seed)]


def own_text(completion: list[dict]) -> str:
    """The model's own text of a TRL completion (its assistant messages; tool messages are not the model's)."""
    return "".join(m["content"] for m in completion if m["role"] == "assistant" and isinstance(m["content"], str))


class Meter:
    """Seconds and counts added up between step boundaries (`boundary` closes a step); thread-safe, since tool
    calls finish on the tool's threads."""

    def __init__(self):
        self.lock, self.steps, self.current, self.last = threading.Lock(), [], {}, time.perf_counter()

    def add(self, key: str, value: float) -> None:
        with self.lock:
            self.current[key] = self.current.get(key, 0.0) + value

    def boundary(self) -> None:
        now = time.perf_counter()
        with self.lock:
            self.steps.append({**self.current, "step_s": now - self.last})
            self.current, self.last = {}, now

    def restart(self) -> None:
        """Forget what was counted since the last boundary (set-up that is no step's work)."""
        with self.lock:
            self.current, self.last = {}, time.perf_counter()

    def timed(self, key: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - start)
        return wrapper


def metered_tool(tool, meter: Meter):
    """The code tool as TRL calls it: a Python function named after the tool, returning the text the model sees
    (ToolResult.render(), as rollout.py shows it)."""
    def execute_python_code_with_standard_io(code: str, input: str = "") -> str:
        """Run a Python program in a fresh interpreter and return what it prints.

        Args:
            code: The Python source to run.
            input: Text for standard input (may be empty).
        """
        start = time.perf_counter()
        try:
            return tool.run(code, input).render()
        finally:
            meter.add("tool_busy_s", time.perf_counter() - start)
            meter.add("tool_calls", 1)
    assert execute_python_code_with_standard_io.__name__ == TOOL_NAME
    return execute_python_code_with_standard_io


def reward_function(meter: Meter):
    """reward.py's 0/1 reward on the model's own text, as TRL calls a reward function (one list per batch)."""
    def correct_answer(prompts, completions, answer, **kwargs):
        verdicts = check_many([extract_answer(own_text(c)) for c in completions], answer)
        rewards = [float(v.correct) for v in verdicts]
        meter.add("reward_sum", sum(rewards))
        meter.add("rollouts", len(rewards))
        return rewards
    return correct_answer


# ============================================================================ the arms (each in a worker process)
def run_trl(w: Workload, sft: Path, data: Path, out: Path, continuous: bool) -> list[dict]:
    """TRL's GRPOTrainer on the workload; returns the per-step records. Saves the model to out/model."""
    import datasets
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from code_tool import CodeTool
    from plumbing.data import load_problems

    meter = Meter()

    class MeteredTrainer(GRPOTrainer):
        """GRPOTrainer with meters on its rollout (`_generate`), its generation calls and its scoring; and the
        prompt ids of its first step kept, for the token-identity check."""

        def _generate(self, prompts):
            return meter.timed("rollout_s", super()._generate)(prompts)

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            if not hasattr(self, "first_prompt_ids"):
                self.first_prompt_ids = [list(p) for p in prompt_ids]
            ids, logprobs = meter.timed("gen_s", super()._generate_single_turn)(prompt_ids, *args, **kwargs)
            meter.add("sampled", sum(len(x) for x in ids))
            return ids, logprobs

        def _generate_and_score_completions(self, inputs):
            return meter.timed("prepare_s", super()._generate_and_score_completions)(inputs)

    class Boundaries(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.boundary()

        def on_step_end(self, args, state, control, **kwargs):
            meter.boundary()

    problems = load_problems(data / "train_level1.jsonl")
    model = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32)
    optimizer, scheduler = adamw(model, w)
    config = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=w.steps, per_device_train_batch_size=w.micro_batch,
        gradient_accumulation_steps=w.prompts * w.rollouts // w.micro_batch, num_generations=w.rollouts,
        max_completion_length=w.budget, max_tool_calling_iterations=w.turns - 1, temperature=w.temperature,
        top_p=1.0, top_k=0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, num_iterations=1,
        max_grad_norm=1.0, gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=w.seed,
        shuffle_dataset=False, use_transformers_continuous_batching=continuous,
        transformers_continuous_batching_config=CB_CONFIG if continuous else None, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_pin_memory=False)
    with CodeTool(workers=w.tool_workers, timeout=w.tool_timeout, max_output_chars=w.tool_chars) as tool:
        trainer = MeteredTrainer(model=model, args=config, processing_class=trl_tokenizer(sft),
                                 reward_funcs=[reward_function(meter)], tools=[metered_tool(tool, meter)],
                                 train_dataset=datasets.Dataset.from_list(ordered_rows(problems, w)),
                                 optimizers=(optimizer, scheduler), callbacks=[Boundaries()])
        trainer.train()
    trainer.save_model(str(out / "model"))
    (out / "first_prompt_ids.json").write_text(json.dumps(trainer.first_prompt_ids))
    steps = meter.steps[1:]
    for s in steps:
        s["update_s"] = s["step_s"] - s.get("prepare_s", 0.0)
        s["other_s"] = s.get("prepare_s", 0.0) - s.get("rollout_s", 0.0)
        s["reward"] = s.get("reward_sum", 0.0) / max(s.get("rollouts", 0.0), 1.0)
    return steps


def adamw(model, w: Workload):
    """train.py's optimizer and schedule: AdamW on every weight, then lr * min(1, (t + 1) / warmup)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr, betas=(0.9, 0.999), weight_decay=0.01)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / max(w.warmup, 1)))


def train_argv(w: Workload, sft: Path, data: Path, out: Path, roc: bool) -> list[str]:
    """train.py's command line for the workload, every value that matters named."""
    return [f"model_path={sft}", f"data=[{data / 'train_level1.jsonl'}]", f"out_dir={out / 'run'}", "resume=never",
            f"steps={w.steps}", f"seed={w.seed}", f"prompts_per_step={w.prompts}",
            f"rollouts_per_prompt={w.rollouts}", f"group_size={w.rollouts // 2 if roc else w.rollouts}",
            f"roc_mode={'sample' if roc else 'off'}", "loss_agg=token", "clip_low=0.2", "clip_high=0.28",
            f"max_response_tokens={w.budget}", f"max_turns={w.turns}", "max_prompt_tokens=256",
            f"temperature={w.temperature}", "top_p=1.0", "system_prompt=compact", "user_instruction=",
            "sampler=hf", f"rollout_batch_size={w.prompts * w.rollouts}", f"tool_workers={w.tool_workers}",
            f"tool_timeout={w.tool_timeout}", f"tool_max_output_chars={w.tool_chars}", "tool_error_format=full",
            f"lr={w.lr}", f"warmup_steps={w.warmup}", "weight_decay=0.01", "adam_beta1=0.9", "adam_beta2=0.999",
            "grad_clip=1.0", "updates_per_step=1", "max_tokens_per_micro_batch=0", f"micro_batch_size={w.micro_batch}",
            "mixed_precision=no",
            "gradient_checkpointing=false", f"save_every={w.steps}", "keep_checkpoints=1", "torch_threads=1"]


class MeteredSampler:
    """A sampler with a meter: seconds inside `step` and the tokens its completions hold; `update_weights` (phase
    9, once per step, and once before the first) closes a step. Everything else is the sampler's own."""

    def __init__(self, sampler, meter: Meter):
        self.sampler, self.meter = sampler, meter

    def step(self):
        start = time.perf_counter()
        done = self.sampler.step()
        self.meter.add("gen_s", time.perf_counter() - start)
        self.meter.add("sampled", sum(len(c.token_ids) for _, c in done))
        return done

    def update_weights(self, model):
        self.meter.boundary()
        return self.sampler.update_weights(model)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def run_ours(w: Workload, sft: Path, data: Path, out: Path, roc: bool) -> list[dict]:
    """train.py on the workload, in this process, with a meter on its sampler and code tool."""
    import train
    from plumbing import rl_stage
    meter = Meter()
    make_sampler, tool_class = rl_stage.make_sampler, rl_stage.CodeTool

    class MeteredTool(tool_class):
        def __init__(self, *args, **kwargs):  # built after the first hand-off: its start-up is set-up, as for TRL
            super().__init__(*args, **kwargs)
            meter.restart()

        def submit(self, code, stdin=""):
            start, future = time.perf_counter(), super().submit(code, stdin)
            future.add_done_callback(lambda f: meter.add("tool_busy_s", time.perf_counter() - start))
            meter.add("tool_calls", 1)
            return future

    rl_stage.make_sampler = lambda cfg, model, tokenizer: MeteredSampler(make_sampler(cfg, model, tokenizer), meter)
    rl_stage.CodeTool = MeteredTool
    try:
        train.main(train_argv(w, sft, data, out, roc))
    finally:
        rl_stage.make_sampler, rl_stage.CodeTool = make_sampler, tool_class
    logged = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = meter.steps[1:]
    for s, m in zip(steps, logged, strict=True):
        s.update(rollout_s=m["perf/rollout_s"], update_s=m["perf/update_s"], reward=m["rollout/reward_mean"],
                 logged_tokens=m["perf/tokens_per_s"] * m["perf/rollout_s"])
        s["other_s"] = s["step_s"] - s["rollout_s"] - s["update_s"]
    os.replace(out / "run" / "model", out / "model")
    return steps


def held_out(model_dir: Path, sft: Path, data: Path, w: Workload) -> dict:
    """The same evaluation for every arm: eval.evaluate with HFSampler on the arm's final weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from code_tool import CodeTool
    from plumbing.data import load_problems
    from eval import evaluate
    from samplers.hf import HFSampler
    torch.manual_seed(w.seed)
    tokenizer = AutoTokenizer.from_pretrained(sft)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    problems = load_problems(data / "test.jsonl")[:w.eval_problems]
    with CodeTool(workers=w.tool_workers, timeout=w.tool_timeout, max_output_chars=w.tool_chars) as tool:
        metrics, trajs = evaluate(problems, HFSampler(model, tokenizer, batch_size=128), tool, tokenizer, FMT,
                                  w.eval_samples, w.budget, w.turns, temperature=w.eval_temperature)
    return {"pass@1": metrics["pass@1"], "rollouts": len(trajs), "tool_calls_mean": metrics["tool_calls_mean"]}


def worker(arm: str, w: Workload, sft: Path, data: Path, out: Path) -> None:
    """One arm-round: train, note the peak RSS, evaluate; result.json in `out`."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    if arm in ("trl", "trl_cb"):
        steps = run_trl(w, sft, data, out, continuous=arm == "trl_cb")
    else:
        steps = run_ours(w, sft, data, out, roc=arm == "roc")
    trained = time.perf_counter() - start
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"arm": arm, "workload": asdict(w), "steps": steps, "peak_rss_mb": rss_mb, "train_wall_s": trained,
              "eval": held_out(out / "model", sft, data, w)}
    (out / "result.json").write_text(json.dumps(result, indent=1))


# ============================================================================ the driver and the table
def ensure_sft(root: Path, quick: bool) -> Path:
    """make tiny's SFT model under root, built by tiny_pipeline's own steps (model, task, SFT) when absent."""
    from tiny import pipeline as tp
    if (root / "sft" / "model" / "config.json").is_file():
        return root / "sft" / "model"
    data = root / "data"
    base = tp.step(root / "base", ["-m", "tiny.model", str(root / "base")])
    task = tp.step(data, ["-m", "tiny.task", str(data), "--tool-backend", "auto"] + (tp.QUICK["task"] if quick else []))
    tp.step(root / "sft", ["sft.py", "configs/tiny/sft.yaml", f"model_path={root / 'base'}",
                           f"data={data / 'sft.jsonl'}", f"out_dir={root / 'sft'}"]
            + (tp.QUICK["sft"] if quick else []), after=[base, task])
    return root / "sft" / "model"


def run_arm(arm: str, args, out: Path) -> dict:
    """One arm-round in a process of its own (prefixed by --wrap); its result.json."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = shlex.split(args.wrap) + [sys.executable, str(Path(__file__).resolve()), "--worker", arm,
                                    "--out", str(out), "--sft", str(args.sft), "--data", str(args.data)]
    cmd += ["--quick"] if args.quick else ["--steps", str(args.steps)]
    with (out / "log.txt").open("w") as log:
        done = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    if done.returncode:
        tail = "".join((out / "log.txt").read_text().splitlines(keepends=True)[-25:])
        raise SystemExit(f"{tail}\nvs_trl: arm {arm} failed (exit {done.returncode}); its log: {out / 'log.txt'}")
    return json.loads((out / "result.json").read_text())


def _mid(values: list[float], digits: int = 1) -> str:
    """median (min-max) of the rounds' values."""
    med = statistics.median(values)
    text = f"{med:.{digits}f}"
    return text if len(values) == 1 else f"{text} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def round_figures(result: dict) -> dict:
    """One arm-round's figures: median s/step, and per-step means of each phase (they add up to the mean step)."""
    steps, n = result["steps"], len(result["steps"])
    total = {k: sum(s.get(k, 0.0) for s in steps) for k in ("step_s", "rollout_s", "gen_s", "update_s", "other_s",
                                                            "sampled", "tool_calls", "tool_busy_s")}
    rewards = [s["reward"] for s in steps]
    k = min(5, n)
    return {"s_per_step": statistics.median(s["step_s"] for s in steps), "mean_step_s": total["step_s"] / n,
            "tok_per_s": total["sampled"] / total["step_s"], "gen_tok_per_s": total["sampled"] / total["gen_s"],
            "rollout_s": total["rollout_s"] / n, "gen_s": total["gen_s"] / n,
            "tool_wait_s": (total["rollout_s"] - total["gen_s"]) / n, "update_s": total["update_s"] / n,
            "other_s": total["other_s"] / n, "sampled_per_step": total["sampled"] / n,
            "tool_calls_per_step": total["tool_calls"] / n, "tool_busy_s": total["tool_busy_s"] / n,
            "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
            "peak_rss_mb": result["peak_rss_mb"], "pass@1": result["eval"]["pass@1"]}


def reward_curves(rounds: list[dict[str, dict]], arms: list[str]) -> dict[str, list[float]]:
    return {a: [statistics.mean(r[a]["steps"][i]["reward"] for r in rounds) for i in range(len(rounds[0][a]["steps"]))]
            for a in arms}


def table(rounds: list[dict[str, dict]], arms: list[str]) -> str:
    """The printed tables: per arm, the median (range) over rounds."""
    figs = {a: [round_figures(r[a]) for r in rounds] for a in arms}

    def col(a, key, digits=1):
        return _mid([f[key] for f in figs[a]], digits)
    lines = [f"{'arm (' + str(len(rounds)) + ' rounds)':<32}{'s/step':>18}{'sampled tok/s':>22}{'peak RSS MB':>20}"
             f"{'pass@1 held out':>24}   reward, first 5 -> last 5 steps"]
    for a in arms:
        lines.append(f"{ARMS[a]:<32}{col(a, 's_per_step'):>18}{col(a, 'tok_per_s', 0):>22}{col(a, 'peak_rss_mb', 0):>20}"
                     f"{col(a, 'pass@1', 3):>24}   {col(a, 'reward_first', 2)} -> {col(a, 'reward_last', 2)}")
    lines += ["", "where a step's seconds go (means per step; rollout = generation + tool calls, waits and parsing)",
              f"{'arm':<32}{'step':>7}{'rollout':>9}{'gen':>7}{'tool+wait':>11}{'update':>8}{'other':>7}"
              f"{'sampled':>9}{'gen tok/s':>11}{'calls':>7}{'tool busy s':>13}"]
    for a in arms:
        m = {k: statistics.median(f[k] for f in figs[a]) for k in figs[a][0]}
        lines.append(f"{ARMS[a]:<32}{m['mean_step_s']:>7.2f}{m['rollout_s']:>9.2f}{m['gen_s']:>7.2f}"
                     f"{m['tool_wait_s']:>11.2f}{m['update_s']:>8.2f}{m['other_s']:>7.2f}{m['sampled_per_step']:>9.0f}"
                     f"{m['gen_tok_per_s']:>11.0f}{m['tool_calls_per_step']:>7.1f}{m['tool_busy_s']:>13.2f}")
    lines += ["", "reward per step (mean over rounds)"]
    for a, curve in reward_curves(rounds, arms).items():
        lines.append(f"{ARMS[a]:<32}" + " ".join(f"{r:.2f}" for r in curve))
    base = next((a for a in ("trl", "trl_cb") if a in arms), None)
    if base:
        lines += ["", f"speed-up over {ARMS[base]}, per round (median (range)): its s/step ÷ the arm's, "
                  "the arm's sampled tok/s ÷ its"]
        for a in arms:
            if a != base:
                s = [figs[base][i]["s_per_step"] / figs[a][i]["s_per_step"] for i in range(len(rounds))]
                t = [figs[a][i]["tok_per_s"] / figs[base][i]["tok_per_s"] for i in range(len(rounds))]
                lines.append(f"{ARMS[a]:<32}s/step {_mid(s, 2)}x   sampled tok/s {_mid(t, 2)}x")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1, help="rounds of all arms, in alternating order (default 1)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {','.join(ARMS)}")
    p.add_argument("--sft", type=Path, default=None, help="SFT model (default ROOT/sft/model, built if absent)")
    p.add_argument("--data", type=Path, default=None, help="task folder (default ROOT/data)")
    p.add_argument("--root", type=Path, default=Path("runs/tiny"), help="make tiny's run folder (default runs/tiny)")
    p.add_argument("--out", type=Path, default=Path("runs/vs_trl"), help="results (default runs/vs_trl)")
    p.add_argument("--steps", type=int, default=Workload.steps, help="RL steps per arm (default 30)")
    p.add_argument("--quick", action="store_true", help="one step per arm on a few short rollouts (the test)")
    p.add_argument("--wrap", default="", help="a command prefix for each arm-round's process")
    p.add_argument("--worker", choices=list(ARMS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.chdir(ROOT)
    w = QUICK if args.quick else replace(Workload(), steps=args.steps)
    if args.worker:
        return worker(args.worker, w, args.sft, args.data, args.out)
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise SystemExit(f"vs_trl: unknown arm(s) {unknown}; the arms are {','.join(ARMS)}")
    if any(a.startswith("trl") for a in arms):
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("vs_trl: trl is not installed in this Python; `make trl` builds .venv-trl "
                             "(then .venv-trl/bin/python bench/vs_trl.py)") from None
    args.sft = (args.sft or ensure_sft(args.root, args.quick)).resolve()
    args.data = (args.data or args.root / "data").resolve()
    for path in (args.sft / "config.json", args.data / "train_level1.jsonl", args.data / "test.jsonl"):
        if not path.is_file():
            raise SystemExit(f"vs_trl: {path} is missing (--sft: a model folder; --data: the tiny task's folder)")
    rounds = []
    for r in range(args.rounds):
        rounds.append({})
        for arm in arms if r % 2 == 0 else arms[::-1]:
            rounds[-1][arm] = result = run_arm(arm, args, args.out / f"round{r + 1}" / arm)
            f = round_figures(result)
            print(f"round {r + 1} {ARMS[arm]:<32} {f['s_per_step']:.2f} s/step, {f['tok_per_s']:.0f} sampled tok/s, "
                  f"pass@1 {f['pass@1']:.3f}", flush=True)
    text = table(rounds, arms)
    (args.out / "summary.json").write_text(json.dumps({"rounds": [{a: round_figures(r[a]) for a in arms}
                                                                   for r in rounds],
                                                       "reward_curves": reward_curves(rounds, arms), "table": text},
                                                      indent=1))
    print("\n" + text)


if __name__ == "__main__":
    main()
