"""Evaluate a checkpoint the way the rStar2-Agent report does (its evaluation protocol: pass@1 over k samples).

    python eval.py configs/tiny/eval.yaml                              # tiny pipeline's held-out split
    python eval.py model_path=PATH benchmarks=[aime24,aime25] sampler=vllm   # report settings (the defaults)
    python eval.py show runs/tiny/eval/trajectories.jsonl 3            # print trajectory 3 (0-based) readably

Same protocol (protocol.py), rollout (rollout.py) and reward (reward.py) as training: k samples per problem at
temperature 0.6, a 30K-token response budget and 30 assistant turns (the report's values, the config defaults).
The released rStar2-Agent checkpoints speak the public code's prompt and tool format: add
configs/formats/rstar2_public.yaml after the other config files to evaluate them in it.
Per benchmark it reports, printed as a table and written to `out_dir/results.json`:
- pass@1: the mean reward over all samples of all problems. pass@1_se: the standard error of that mean taken over
  problems: the sample std (n - 1) of the P per-problem accuracies, divided by sqrt(P) (None when P < 2). It counts
  both sampling noise and problem-to-problem spread, and treats the benchmark as a sample of problems.
- pass@k (k = samples): the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code"), 1 - C(n-c, k) / C(n, k) per problem, averaged; with k = n it is the fraction of problems solved at least once.
- maj@k: accuracy of the majority answer (`majority_vote`: equivalent answers form one group; ties go to the group
  whose first member came first in sample order; samples without an answer do not vote).
- response_tokens_mean (everything after the prompt: sampled turns and tool text, the budget's measure),
  tool_calls_mean, tool_error_rate (failed calls / calls; None without calls), tool_error_rate_in_correct (the same
  over rollouts with reward 1: the report's diagnostic that RoC drives down), truncated_frac (end_reason != answer).
Every rollout goes to `out_dir/trajectories.jsonl` (one line per (problem, sample), problem-major): the model's turns,
each tool call's code, stdin, status and the response the model saw, the extracted answer and the reward. Token ids
and log-probs are left out (30K ids x 16 samples x 500 problems would dominate the file); counts are kept.

The output folder is never lost to a crash or a typo: inputs are checked before it is touched; each benchmark's
trajectories are appended and fsynced before results.json (replaced atomically) names it, so a rerun with the same
config keeps the finished benchmarks, drops any partial lines, and evaluates only the rest (a finished evaluation is
read back, not redone). results.json records the config, the benchmark files' sha256 and the model files' sizes and
times; an evaluation of another config or model in out_dir is refused unless `overwrite=true`.

Benchmarks: a JSONL path ({"problem", "answer", ...} per line; a bad line stops with file:line), or a name from
BENCHMARKS (aime24, aime25, hmmt25, math500), which reads the copy shipped in data/ (no network; sources, licences
and the checks made on them: data/SOURCES.md).

`unsolved_out`: the problems solved fewer than k of k times, written with their input fields: report §4's
stage-3 data ("the problems the stage-2 policy did not solve 8 of 8 times"), e.g.
    python eval.py configs/tiny/eval.yaml model_path=runs/tiny/stage2/model \\
        benchmarks=[runs/tiny/data/train_level2.jsonl] samples=8 unsolved_out=runs/tiny/data/stage3.jsonl

(with several benchmarks, their unsolved problems are concatenated in benchmark order).

Samplers (`sampler: hf | vllm | reference`, samplers/): hf for the tiny model and small checks; vllm for
real checkpoints at the report's budgets (HFSampler holds each slot's whole row of keys and values, unpaged, in one
process). The seed is set again before each benchmark, so a benchmark's samples do not depend on which ran before
it (hf; vLLM seeds its engine once); with `sync_turns=true` they do not depend on tool timing either.

Under a launcher it runs data-parallel, one sampler per process (GPU):
    torchrun --nproc_per_node 8 eval.py model_path=PATH sampler=vllm
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml eval.py configs/tiny/eval.yaml
Every rank checks the inputs and reads what out_dir already holds; then each plays whole problems of every
benchmark (rank r: problems r, r + W, r + 2W, ...; none when there are more ranks than problems), the main process
gathers the rollouts and alone writes out_dir and prints, the lines and numbers one process would write (same
order). Rank r samples with seed + r, so rank 0 of a launch samples as a single process does. Invariant to the
number of ranks: everything, for a policy whose answers do not depend on chance or batch (the tests' scripted
one); with a real sampler, the samples themselves differ (each rank draws its own, and a rollout's batch
neighbours change its numerics), so metrics agree within sampling noise. vLLM under a launcher: one engine per
rank (vllm_tensor_parallel_size=1; for tensor parallelism launch one process).

In-process API (trainer, pipeline): `evaluate(problems, sampler, tool, ...) -> (metrics, trajectories)`; pure
helpers `pass_at_k`, `majority_vote`, `standard_error`, `summarize`, `unsolved`.
Our choices where the report is silent: the standard error, the majority-vote grouping and tie rule, and counting
tool text in the response length. Left out: GPQA-Diamond (multiple choice, not this reward), and any per-benchmark
prompt or answer format.
"""
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from plumbing import cpu_threads
from plumbing.checkpoint import atomic_write_text, config_changes, filter_jsonl, read_jsonl_rows, run_identity
from plumbing.config import check_ranges, format_config, parse_cli, save_config
from plumbing.data import check_model_path, load_pretrained, load_problems, write_jsonl
from protocol import DEFAULT_USER_INSTRUCTION, IM_END, TOOL_NAME, chat_format_of, parse_tool_call
from tools.report import write_report
from reward import default_pool, extract_answer, is_equivalent, score_trajectories
from rollout import rollout, trajectory_record

# Benchmark names -> the copies shipped in data/ (sources, licences and checks: data/SOURCES.md).
DATA_DIR = Path(__file__).resolve().parent / "data"
BENCHMARKS = {name: DATA_DIR / f"{name}.jsonl" for name in ("aime24", "aime25", "hmmt25", "math500")}

USAGE = """Evaluate a checkpoint: pass@1 over k samples, pass@k, maj@k, tool and length statistics.
  python eval.py [CONFIG.yaml ...] [key=value ...]
  python eval.py configs/tiny/eval.yaml model_path=runs/tiny/sft/model
  python eval.py model_path=PATH benchmarks=[aime24,math500] samples=16 sampler=vllm
  python eval.py show TRAJECTORIES.jsonl INDEX                      # one trajectory, readably"""


@dataclass
class EvalConfig:
    model_path: str = ""                  # a checkpoint folder (or hub id) loadable with from_pretrained
    benchmarks: list[str] = field(default_factory=lambda: ["aime24", "aime25", "hmmt25", "math500"])  # paths/names
    out_dir: str = "runs/eval"            # config.yaml, results.json, trajectories.jsonl
    samples: int = 16                     # k samples per problem (report: 16)
    temperature: float = 0.6              # report: 0.6 at evaluation (1.0 in training)
    top_p: float = 1.0                    # report: 1.0
    max_response_tokens: int = 30000      # response budget, tool text included (report: 30K at evaluation)
    max_turns: int = 30                   # assistant turns (report: 30 at evaluation)
    system_prompt: str = "default"        # a preset (default, compact, rstar2_public) or the text itself (protocol.py)
    user_instruction: str = DEFAULT_USER_INSTRUCTION  # fills user_template's {instruction} slot ("" for none)
    user_template: str = "default"        # the user turn: a preset (default, rstar2_public) or text with {problem}
    tool_name: str = TOOL_NAME            # the name a call must give (public format: python_code_with_standard_io)
    tool_required: list[str] = field(default_factory=lambda: ["code"])  # the arguments its schema marks required
    tool_result_format: str = "default"   # how a result reads: default ("ok\n4\n") | rstar2_public ("Tool call ...")
    newline_after_turn: bool = True       # "\n" after an assistant turn's <|im_end|> (the public agent loop: none)
    sampler: str = "hf"                   # hf (our decode loop, CPU/GPU) | vllm (GPU; CPU too) | reference (slow)
    attn_implementation: str = "auto"     # auto | sdpa | eager | flash_attention_2 | ... (plumbing/attention.py)
                                          # hf and reference only (hf decodes with sdpa under flash); vllm: its own
    batch_size: int = 64                  # rollouts per rollout() call; hf: also decoding slots (vllm: raise it)
    sync_turns: bool = False              # turns wait for all the batch's tool calls (batches independent of timing)
    limit: int = 0                        # first N problems of each benchmark (0: all), for quick runs
    seed: int = 0
    torch_threads: int = 0                # torch CPU threads; 0: as many as the free cores (cpu_threads.py)
    peer_timeout_s: float = 600.0         # a rank silent this long while others wait for its share stops them all
    unsolved_out: str | None = None       # write problems solved < k of k times here (stage-3 data, report §4)
    overwrite: bool = False               # replace an evaluation of another config or model found in out_dir
    # --- code tool (report §3; public code: 4 s, 1,000 chars)
    tool_workers: int = 4
    tool_timeout: float = 4.0
    tool_memory_mb: int = 512
    tool_max_output_chars: int = 1000
    tool_backend: str = "auto"            # auto | servers (Linux) | subprocess (portable, slower)
    tool_require_isolation: bool = False  # refuse to start without namespaces, Landlock and seccomp
    tool_error_format: str = "full"       # a failed call's text: full (compact traceback) | last_line (exception only)
    # --- vLLM (sampler=vllm only)
    vllm_tensor_parallel_size: int = 1
    vllm_gpu_memory_utilization: float = 0.9
    vllm_dtype: str = "bfloat16"
    vllm_enforce_eager: bool = False      # no CUDA graphs / torch.compile (faster start; the CPU build's tests)


# Allowed values of the numeric fields (config.check_ranges), checked by `check_config` before any work.
RANGES = {
    "samples": ">= 1", "temperature": ">= 0", "top_p": "> 0 and <= 1", "max_response_tokens": ">= 1",
    "max_turns": ">= 1", "batch_size": ">= 1", "limit": ">= 0", "seed": ">= 0 and <= 4294967295",
    "tool_workers": ">= 0", "tool_timeout": "> 0", "tool_memory_mb": ">= 1", "tool_max_output_chars": ">= 1",
    "vllm_tensor_parallel_size": ">= 1", "vllm_gpu_memory_utilization": "> 0 and <= 1", "torch_threads": ">= 0",
    "peer_timeout_s": "> 0",
}


SAMPLERS = ("hf", "vllm", "reference")  # config field `sampler`: samplers/hf.py, vllm_engine.py, reference.py


def check_config(cfg: EvalConfig) -> None:
    """Config errors that need no files (values out of range, unknown sampler, no model), before any work."""
    problems = check_ranges(cfg, RANGES)
    if cfg.sampler not in SAMPLERS:
        problems.append(f"sampler must be hf, vllm or reference, got {cfg.sampler!r}")
    if not cfg.model_path:
        problems.append("model_path is required")
    from plumbing import attention
    if cfg.sampler != "vllm" and (attention_problem := attention.check(cfg.attn_implementation)):
        problems.append(attention_problem)
    from code_tool import ERROR_FORMATS
    if cfg.tool_error_format not in ERROR_FORMATS:
        problems.append(f"tool_error_format must be one of {ERROR_FORMATS}, got {cfg.tool_error_format!r}")
    try:  # the chat format's fields (protocol.chat_format)
        chat_format_of(cfg)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise SystemExit("config error: " + "; ".join(problems))


# Keys that may differ from the evaluation already in out_dir when continuing or re-reading it: they change no sample.
CONTINUE_FREE = {"out_dir", "overwrite", "unsolved_out", "torch_threads", "tool_workers", "tool_backend",
                 "tool_require_isolation", "vllm_gpu_memory_utilization", "peer_timeout_s"}


# ============================================================================ metrics (pure)
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples with c correct (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got {n=} {c=} {k=}")
    # pass@k = 1 - C(n - c, k) / C(n, k): one minus the chance that k draws without replacement are all wrong
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers: list[str | None], rewards: list[float], equivalent=None) -> float:
    """Reward of the majority answer among one problem's samples (0.0 when no sample gave an answer).

    Each answer joins the first group whose first member it equals (string) or is `equivalent` to; None does not
    vote. The largest group wins; ties go to the group whose first member came first. The winner scores its first
    member's reward (all members are equivalent to it)."""
    groups: list[list[int]] = []  # sample indices; groups[g][0] is the representative
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        for group in groups:
            rep = answers[group[0]]
            if answer == rep or (equivalent is not None and equivalent(answer, rep)):
                group.append(i)
                break
        else:
            groups.append([i])
    if not groups:
        return 0.0
    winner = max(groups, key=len)  # max keeps the first of equal lengths: the earliest group
    return float(rewards[winner[0]])


def standard_error(values: list[float]) -> float | None:
    """Standard error of the mean: sample std (n - 1) / sqrt(n); None for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    # se = sqrt(sum (x - mean)^2 / (n - 1)) / sqrt(n)
    return math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(groups: list[list], equivalent=None) -> dict:
    """Benchmark metrics from trajectories grouped by problem: P lists of k rollout.Trajectory (or objects with
    the same attributes: reward (set, 0 or 1), text, response_ids, num_tool_calls, num_failed_tool_calls,
    truncated). `equivalent(a, b)` groups answers for the majority vote (None: identical strings only)."""
    flat = [t for g in groups for t in g]
    if not groups or any(len(g) != len(groups[0]) for g in groups) or not groups[0]:
        raise ValueError("summarize needs P >= 1 groups of the same size k >= 1")
    k = len(groups[0])
    accuracy = [sum(t.reward for t in g) / k for g in groups]  # a_p = mean reward of problem p's k samples
    # pass@1 = mean_p a_p (= mean over all P * k samples); pass@1_se = std(a_p, n - 1) / sqrt(P)
    correct = [t for t in flat if t.reward == 1]
    return {
        "problems": len(groups),
        "samples": k,
        "pass@1": sum(accuracy) / len(groups),
        "pass@1_se": standard_error(accuracy),
        "pass@k": sum(pass_at_k(k, sum(t.reward == 1 for t in g), k) for g in groups) / len(groups),
        "maj@k": sum(majority_vote([extract_answer(t.text) for t in g], [t.reward for t in g], equivalent)
                     for g in groups) / len(groups),
        "response_tokens_mean": sum(len(t.response_ids) for t in flat) / len(flat),
        "tool_calls_mean": sum(t.num_tool_calls for t in flat) / len(flat),
        "tool_error_rate": _ratio(sum(t.num_failed_tool_calls for t in flat), sum(t.num_tool_calls for t in flat)),
        "tool_error_rate_in_correct": _ratio(sum(t.num_failed_tool_calls for t in correct),
                                             sum(t.num_tool_calls for t in correct)),
        "truncated_frac": sum(t.truncated for t in flat) / len(flat),
    }


def unsolved(problems: list[dict], groups: list[list]) -> list[dict]:
    """The problems with fewer than k correct samples (k = the group size), in input order."""
    return [p for p, g in zip(problems, groups) if sum(t.reward == 1 for t in g) < len(g)]


# ============================================================================ evaluation (in process)
def evaluate(problems: list[dict], sampler, tool, tokenizer, fmt, samples: int, max_response_tokens: int,
             max_turns: int, temperature: float = 0.6, top_p: float = 1.0, batch_size: int = 0,
             sync_turns: bool = False, progress: bool = False) -> tuple[dict, list]:
    """Roll out `samples` rollouts per problem, score each with the training reward, and summarize.

    problems: dicts with "problem" and "answer". Returns (metrics from `summarize`, trajectories with `reward` set,
    problem-major: trajectory i * samples + j is sample j of problem i). batch_size: rollouts per rollout() call
    (0: all at once); sync_turns: see rollout."""
    trajs, timeouts = roll_and_score(problems, sampler, tool, tokenizer, fmt, samples, max_response_tokens,
                                     max_turns, temperature, top_p, batch_size, sync_turns, progress)
    groups = [trajs[i:i + samples] for i in range(0, len(trajs), samples)]
    metrics = summarize(groups, equivalent=is_equivalent)
    metrics["reward_timeouts"] = timeouts  # checks that ran out of time (scored 0)
    return metrics, trajs


def roll_and_score(problems: list[dict], sampler, tool, tokenizer, fmt, samples: int, max_response_tokens: int,
                   max_turns: int, temperature: float = 0.6, top_p: float = 1.0, batch_size: int = 0,
                   sync_turns: bool = False, progress: bool = False, more=None) -> tuple[list, int]:
    """`evaluate` without the summary: (the problem-major trajectories with `reward` set, the number of answer
    checks that ran out of time). The command line's ranks each call it on their share of a benchmark; `more`
    goes to rollout() (the ranks' heartbeat)."""
    texts = [p["problem"] for p in problems for _ in range(samples)]
    step = batch_size or len(texts)
    trajs = []
    for s in _bar(range(0, len(texts), step), progress and len(texts) > step, "batches"):
        trajs += rollout(texts[s:s + step], sampler, tool, tokenizer, fmt, max_response_tokens, max_turns,
                         temperature=temperature, top_p=top_p, sync_turns=sync_turns,
                         progress=progress and step == len(texts), more=more)
    # r = 1 if the last boxed answer of the model's own text is equivalent to the gold answer (reward.py, sec. 3)
    verdicts = score_trajectories(trajs, [problems[i // samples]["answer"] for i in range(len(trajs))])
    return trajs, sum(v.timed_out for v in verdicts)


def _bar(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc)


# ============================================================================ benchmarks
def benchmark_file(spec: str) -> Path:
    """The JSONL file of a benchmark path or BENCHMARKS name; ValueError for an unknown name."""
    path = Path(spec)
    if path.suffix == ".jsonl" or path.is_file() or "/" in spec:
        return path
    if spec not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {spec!r}: give a JSONL path or one of {', '.join(BENCHMARKS)}")
    return BENCHMARKS[spec]


def load_benchmark(spec: str) -> tuple[str, list[dict]]:
    """(name, problems) for a JSONL path or a BENCHMARKS name; raises ValueError naming what is wrong."""
    path = benchmark_file(spec)
    return (path.stem if path != BENCHMARKS.get(spec) else spec), load_problems(path)


# ============================================================================ the output folder
def eval_identity(cfg: EvalConfig) -> dict:
    """What results.json records of the evaluation: config, benchmark files' sha256, and the size and mtime of each
    model file (a model retrained in place is another model; hashing 30 GB of weights would take minutes)."""
    identity = run_identity(cfg, [benchmark_file(b) for b in cfg.benchmarks])
    folder = Path(cfg.model_path)
    identity["model_files"] = {str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns]
                               for p in sorted(folder.rglob("*")) if p.is_file()} if folder.is_dir() else None
    return identity


def finished_benchmarks(out: Path, cfg: EvalConfig, identity: dict) -> dict:
    """The metrics of the benchmarks an earlier run finished in out_dir with this config and model (kept, not
    redone); {} for a new folder or with overwrite=true. Any other evaluation there is refused."""
    path = out / "results.json"
    if not path.is_file() or cfg.overwrite:
        return {}
    saved = json.loads(path.read_text())
    if "identity" not in saved:
        changes = {"config": "not recorded"}
    else:
        changes = config_changes(saved["identity"], identity, CONTINUE_FREE)
        if saved["identity"].get("model_files") != identity["model_files"]:
            changes["model files"] = f"{cfg.model_path} changed since"
    if changes:
        raise SystemExit(f"eval: {out} holds another evaluation ({'; '.join(f'{k}: {v}' for k, v in changes.items())})"
                         f"; use another out_dir, or overwrite=true to replace it")
    return saved["benchmarks"]


def keep_trajectories(path: Path, benchmarks) -> None:
    """Cut trajectories.jsonl back to the lines of the finished `benchmarks` (a kill may have left part of the next
    one, or a damaged last line), replacing the file atomically when anything goes."""
    filter_jsonl(path, lambda row: row.get("benchmark") in benchmarks)


def unsolved_from(path: Path, benches: list[tuple[str, list[dict]]], k: int) -> list[dict]:
    """`unsolved` over every benchmark, read back from trajectories.jsonl (finished earlier or in this run)."""
    correct = {}
    for _, r in read_jsonl_rows(path):
        key = (r["benchmark"], r["problem_index"])
        correct[key] = correct.get(key, 0) + (r["reward"] == 1)
    return [p for name, problems in benches for i, p in enumerate(problems) if correct.get((name, i), 0) < k]


# ============================================================================ ranks (torchrun / accelerate launch)
def check_launch(cfg: EvalConfig) -> None:
    """Config errors that depend on the launch: vLLM's external launcher makes the ranks of one tensor-parallel
    group share an engine, which must then get the same prompts; here every rank plays its own problems."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and cfg.sampler == "vllm" and cfg.vllm_tensor_parallel_size > 1:
        raise SystemExit(f"config error: vllm_tensor_parallel_size={cfg.vllm_tensor_parallel_size} under a launcher "
                         f"with {world} processes; launch one process (its engine spans the GPUs) or use "
                         "vllm_tensor_parallel_size=1 (one engine per rank)")


def start_ranks() -> tuple[int, int]:
    """(rank, world size): (0, 1) for a plain `python eval.py`; under torchrun / accelerate launch with several
    processes, the process group is set up here (Accelerate's PartialState: gloo on CPU, NCCL on GPU, each rank
    on its LOCAL_RANK's GPU). A rank that is done waits in the next gather for the slowest one, so the group's
    timeout is the trainer's (plumbing/accel.py), not torch's 10 minutes."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return 0, 1
    from datetime import timedelta
    import torch
    from accelerate import PartialState
    from plumbing.accel import PROCESS_GROUP_TIMEOUT_S, start_process_group
    start_process_group(PROCESS_GROUP_TIMEOUT_S)
    # cpu=True without a GPU: the only way PartialState sets up gloo across CPU processes
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    if state.num_processes != world:  # every rank would evaluate everything and append to the same file
        raise SystemExit(f"eval: WORLD_SIZE={world} but the process group has {state.num_processes} process(es)")
    return state.process_index, state.num_processes


def rank_of_process() -> tuple[int, int]:
    """(rank, world size) of the process group `start_ranks` set up; (0, 1) without one."""
    import torch.distributed as dist
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def problem_share(count: int, rank: int, world: int) -> list[int]:
    """The indices of the problems `rank` plays: rank, rank + world, ... (every problem on exactly one rank; none
    when there are more ranks than problems). Whole problems, so a problem's k samples are summarized together."""
    return list(range(rank, count, world))


def rank_seed(seed: int, rank: int) -> int:
    """The sampling seed of `rank`: seed + rank, kept within the 32 bits numpy's seeding takes."""
    return (seed + rank) % 2**32


def barrier(world: int) -> None:
    """Wait for every rank (nothing to wait for on one process)."""
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


def gather_to_main(obj, rank: int, world: int) -> list | None:
    """Every rank's `obj`, in rank order, on the main process (rank 0); None on the others."""
    if world == 1:
        return [obj]
    import torch.distributed as dist
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def record_scores(record: dict):
    """What `summarize` reads of a rollout, back from its trajectories.jsonl record: the ranks send records (no
    token ids) to the main process, which summarizes the whole benchmark. response_ids is a range of the right
    length: summarize only counts it."""
    from types import SimpleNamespace
    return SimpleNamespace(reward=record["reward"], text="".join(record["turns"]),
                           response_ids=range(record["response_tokens"]), num_tool_calls=record["num_tool_calls"],
                           num_failed_tool_calls=record["num_failed_tool_calls"], truncated=record["truncated"])


def merge_shares(shares: list[tuple[list[dict], int]], k: int) -> tuple[list[dict], dict]:
    """The ranks' (records, answer-check timeouts) -> (every record in problem-major order, the benchmark's metrics):
    the lines and numbers one process playing every problem writes."""
    records = sorted((r for share, _ in shares for r in share), key=lambda r: (r["problem_index"], r["sample"]))
    groups = [[record_scores(r) for r in records[i:i + k]] for i in range(0, len(records), k)]
    metrics = summarize(groups, equivalent=is_equivalent)
    metrics["reward_timeouts"] = sum(timeouts for _, timeouts in shares)  # checks that ran out of time (scored 0)
    return records, metrics


# ============================================================================ command line
def format_table(results: dict) -> str:
    """The results as a fixed-width text table, one row per benchmark."""
    cols = ["pass@1", "pass@1_se", "pass@k", "maj@k", "response_tokens_mean", "tool_calls_mean",
            "tool_error_rate", "tool_error_rate_in_correct", "truncated_frac"]
    heads = ["pass@1", "+-se", "pass@k", "maj@k", "resp_tok", "calls", "tool_err", "err_in_ok", "trunc"]
    lines = [f"{'benchmark':<16}{'P x k':>9} " + " ".join(f"{h:>9}" for h in heads)]
    for name, m in results.items():
        cells = ["-" if m[c] is None else f"{m[c]:.1f}" if c == "response_tokens_mean" else f"{m[c]:.3f}"
                 for c in cols]
        lines.append(f"{name:<16}{m['problems']:>5} x {m['samples']:<2} " + " ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def show(path, index: int) -> str:
    """One trajectory of a trajectories.jsonl as readable text: the problem, each turn, each call and its output."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not 0 <= index < len(lines):
        raise SystemExit(f"{path} holds trajectories 0..{len(lines) - 1}; got {index}")
    r = json.loads(lines[index])
    ident = f" (id {r['id']})" if r["id"] is not None else ""
    out = [f"=== trajectory {index} | {r['benchmark']} problem {r['problem_index']}{ident} sample "
           f"{r['sample']} | reward {r['reward']} | answer {r['answer']!r} predicted {r['pred']!r}",
           f"=== end {r['end_reason']}, {r['response_tokens']} tokens, {r['num_turns']} turns, "
           f"{r['num_tool_calls']} calls ({r['num_failed_tool_calls']} failed)", "--- problem", r["problem"]]
    calls = iter(r["tool_calls"])
    for t, turn in enumerate(r["turns"], start=1):
        out += [f"--- assistant turn {t}", "<reason>" + turn]
        call = next(calls, None) if parse_tool_call(turn) is not None else None
        if call is not None:
            out += [f"--- tool call {call['status']}: code", call["code"]]
            if call["stdin"]:
                out += ["--- stdin", call["stdin"]]
            out += ["--- tool response", call["response"]]
    return "\n".join(out)


def load_model(cfg: EvalConfig):
    """(sampler, tokenizer) for the config: transformers on the GPU if there is one (else CPU), or vLLM; under a
    launcher, on the rank's GPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from samplers.hf import HFSampler
    from samplers.reference import ReferenceSampler
    from samplers.vllm_engine import VLLMSampler
    from plumbing import attention
    try:
        tokenizer = load_pretrained(AutoTokenizer, cfg.model_path)
        model = None if cfg.sampler == "vllm" else load_pretrained(
            AutoModelForCausalLM, cfg.model_path, torch_dtype="auto", **attention.load_kwargs(cfg.attn_implementation))
    except ValueError as e:
        raise SystemExit(f"input error: {e}") from None
    rank, world = rank_of_process()
    if cfg.sampler == "vllm":
        # Under a launcher, one engine per rank on the rank's own GPU (vLLM's external launcher), seeded seed + rank.
        launcher = {"distributed_executor_backend": "external_launcher"} if world > 1 else {}
        return VLLMSampler(cfg.model_path, im_end_id=tokenizer.convert_tokens_to_ids(IM_END),
                           seed=rank_seed(cfg.seed, rank), tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                           dtype=cfg.vllm_dtype, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                           enforce_eager=cfg.vllm_enforce_eager, enable_sleep_mode=False,  # nothing trains here
                           **launcher), tokenizer
    model.to("cuda" if torch.cuda.is_available() else "cpu")  # "cuda": the rank's GPU (PartialState set it)
    if cfg.sampler == "reference":
        return ReferenceSampler(model, tokenizer), tokenizer
    return HFSampler(model, tokenizer, batch_size=cfg.batch_size), tokenizer


def run(cfg: EvalConfig) -> dict | None:
    """The command-line evaluation: every benchmark, results.json, trajectories.jsonl, unsolved_out.
    Inputs are checked before out_dir is touched. A benchmark is finished when results.json names it (written after
    its trajectories are on disk); a rerun with the same config keeps finished benchmarks and does the rest.
    Under a launcher each rank plays its share of every benchmark and the main process writes everything; it
    returns the results, the other ranks None."""
    from plumbing import accel
    with accel.process_group_ends():  # the group start_ranks sets up, on every way out (plumbing/accel.py, point 4)
        return evaluate_benchmarks(cfg)


def evaluate_benchmarks(cfg: EvalConfig) -> dict | None:
    """`run`'s work, within the process group's lifetime."""
    check_config(cfg)
    check_launch(cfg)
    from code_tool import SandboxError, announce, choose_sandbox
    from plumbing import accel
    try:  # where and how model code runs (code_tool.py's sandbox modes)
        sandbox = choose_sandbox(cfg.tool_backend, cfg.tool_require_isolation)
    except SandboxError as e:
        raise SystemExit(f"config error: {e}") from None
    out = Path(cfg.out_dir)
    try:  # every input error before the model loads and before out_dir is touched
        check_model_path(cfg.model_path)
        benches = [load_benchmark(b) for b in cfg.benchmarks]
    except ValueError as e:
        raise SystemExit(f"input error: {e}") from None
    names = [n for n, _ in benches]
    benches = [(n if names.count(n) == 1 else spec, probs[:cfg.limit] if cfg.limit else probs)
               for (n, probs), spec in zip(benches, cfg.benchmarks)]  # two files named test.jsonl: use the paths
    identity = eval_identity(cfg)
    results = finished_benchmarks(out, cfg, identity)
    rank, world = start_ranks()
    barrier(world)  # every rank knows what is finished before the main process rewrites out_dir
    main = rank == 0
    say = print if main else (lambda *args: None)
    say(format_config(cfg))
    traj_file = out / "trajectories.jsonl"
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if not results:
            (out / "results.json").unlink(missing_ok=True)
        save_config(cfg, out / "config.yaml")
        (out / "sandbox.txt").write_text(announce(sandbox) + "\n")
        keep_trajectories(traj_file, results)
    k = cfg.samples
    todo = [(name, problems) for name, problems in benches if name not in results]
    if len(todo) < len(benches):
        say(f"kept from the earlier run in {out}: {', '.join(results)} (overwrite=true evaluates them again)")
    sampler = None
    try:
        if todo:
            threads = cpu_threads.set_torch_threads(cfg.torch_threads)  # on every rank
            say(f"{threads} torch thread(s)" + (f" on each of {world} ranks" if world > 1 else ""))
            sampler, tokenizer = load_model(cfg)
            evaluate_todo(cfg, todo, results, identity, sampler, tokenizer, rank, world, traj_file)
        barrier(world)  # every rank is done; `run` then ends the process group
    finally:
        accel.end_sampler(sampler)  # vLLM closed on a clean way out only, before the group ends under it
    if not main:
        return None
    results = {name: results[name] for name, _ in benches}
    print(format_table(results))
    print(f"wrote {out / 'results.json'} and {traj_file}")
    print(f"wrote {write_report(out)}")  # the page to browse them (tools/report.py)
    if cfg.unsolved_out is not None:
        missed = unsolved_from(traj_file, benches, k)
        write_jsonl(cfg.unsolved_out, missed)
        print(f"wrote {cfg.unsolved_out}: {len(missed)} problems solved fewer than {k} of {k} times")
    return results


def evaluate_todo(cfg: EvalConfig, todo: list, results: dict, identity: dict, sampler, tokenizer, rank: int,
                  world: int, traj_file: Path) -> None:
    """The benchmarks not finished yet, each rank its share; the main process writes their trajectories and adds
    each to results (and results.json) as it ends."""
    from transformers import set_seed
    from plumbing.accel import peers as make_peers
    from code_tool import CodeTool
    main, k, out = rank == 0, cfg.samples, traj_file.parent
    peers = make_peers(cfg.peer_timeout_s, "eval")  # waiting for the slowest rank's share (plumbing/accel.py, point 5)
    say = print if main else (lambda *args: None)
    fmt = chat_format_of(cfg)
    tool = CodeTool(workers=cfg.tool_workers, timeout=cfg.tool_timeout, memory_mb=cfg.tool_memory_mb,
                    max_output_chars=cfg.tool_max_output_chars, backend=cfg.tool_backend,
                    require_isolation=cfg.tool_require_isolation, error_format=cfg.tool_error_format)
    default_pool().start()  # the answer checkers import sympy while the first rollouts run, not after them
    with tool, (traj_file.open("a", encoding="utf-8") if main else contextlib.nullcontext()) as f:
        for name, problems in todo:
            say(f"{name}: {len(problems)} problems x {k} samples" + (f" on {world} ranks" if world > 1 else ""))
            # Each benchmark's samples do not depend on which benchmarks ran before it; each rank samples its
            # own rollouts (seed + rank: one process has rank 0, so its samples are those of before).
            set_seed(rank_seed(cfg.seed, rank))
            start = time.perf_counter()
            mine = problem_share(len(problems), rank, world)
            peers.start(name)
            peers.phase("rollouts")
            trajs, timeouts = roll_and_score(
                [problems[i] for i in mine], sampler, tool, tokenizer, fmt, k, cfg.max_response_tokens,
                cfg.max_turns, cfg.temperature, cfg.top_p, cfg.batch_size, cfg.sync_turns,
                progress=main, more=peers.beating) if mine else ([], 0)
            peers.wait("rollouts")
            records = [trajectory_record(name, problems[mine[t // k]], mine[t // k], t % k, traj)
                       for t, traj in enumerate(trajs)]
            peers.phase("gather")
            shares = gather_to_main((records, timeouts), rank, world)
            if not main:
                continue
            records, metrics = merge_shares(shares, k)
            metrics["seconds"] = time.perf_counter() - start  # rollouts and scoring on every rank (wall clock)
            for record in records:  # on disk before results.json names the benchmark
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            results[name] = metrics
            atomic_write_text(out / "results.json", json.dumps(
                {"model_path": cfg.model_path, "benchmarks": results, "identity": identity}, indent=1))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["show"]:
        if len(argv) != 3 or not argv[2].lstrip("-").isdigit():
            raise SystemExit("usage: python eval.py show TRAJECTORIES.jsonl INDEX")
        print(show(argv[1], int(argv[2])))
        return
    run(parse_cli(EvalConfig, argv, usage=USAGE))


if __name__ == "__main__":
    from plumbing import accel
    accel.run_and_exit(main)  # no abort at exit (plumbing/accel.py, point 4)
