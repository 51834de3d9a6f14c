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
from pathlib import Path

from plumbing import cpu_threads
from plumbing.checkpoint import atomic_write_text
from plumbing.config import format_config, parse_cli, save_config
from plumbing.data import check_model_path, load_problems, write_jsonl
from plumbing.eval_config import CONTINUE_FREE, EvalConfig, check_config, check_launch  # noqa: F401
from plumbing.eval_run import (barrier, eval_identity, finished_benchmarks, gather_to_main, keep_trajectories,
                               load_model, problem_share, rank_seed, start_ranks, unsolved_from)
from protocol import chat_format_of, parse_tool_call
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
    identity = eval_identity(cfg, [benchmark_file(b) for b in cfg.benchmarks])
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
