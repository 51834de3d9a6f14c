"""What one RL stage (train.py) needs around its steps, which a first read can skip: the set-up (accelerator, data,
model with the optimizer and schedule train.py builds, resume, sampler, code tool), the held-out evaluation during
training, the ranks' rollout times, a step's rollouts written for reading, and the step's log line.

`setup` runs in the order that stops on bad input before any expensive work, and returns the step to start from
and `run`, a `Stage`: what a step needs, one field a line (not a framework).
"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from code_tool import CodeTool, SandboxError, announce, choose_sandbox
from grpo_roc import penalty_total
from plumbing import accel, attention, cpu_threads, handoff, lora
from plumbing.checkpoint import (atomic_write_text, begin_run, input_dtype, load_checkpoint, load_optimizer,
                                 optimizer_file, resume_point, run_identity)
from plumbing.config import format_config, save_config, tracker_config
from plumbing.data import check_model_path, load_pretrained, load_problems
from plumbing.train_config import RESUME_FREE, TrainConfig, check_inputs, validate
from protocol import ChatFormat, chat_format_of, encode
from reward import default_pool, score_trajectories
from rollout import rollout, rollout_sums, trajectory_record
from samplers.hf import HFSampler
from samplers.vllm_engine import VLLMSampler
from schedule import check_kv_room, wait_fraction


@dataclass
class Stage:
    """What a step of the RL stage needs, built once by `setup`."""
    accelerator: Any                    # accelerate.Accelerator: the ranks, the device, the trackers
    model: torch.nn.Module              # the policy, fp32 master weights, prepared (DDP or FSDP2; LoRA: PEFT)
    optimizer: torch.optim.Optimizer    # train.optimizer_and_schedule's AdamW, prepared
    scheduler: Any                      # its warm-up LambdaLR (stepped once per optimizer step)
    sampler: Any                        # samplers/: HFSampler or VLLMSampler, fed the policy's weights (phase 9)
    tool: CodeTool                      # the Python tool the rollouts call
    tokenizer: Any                      # the model folder's tokenizer
    fmt: ChatFormat                     # the prompt and tool-response markup (protocol.py)
    problems: list[dict]                # the training problems ({"problem", "answer", ...})
    eval_problems: list[dict]           # the held-out problems ([] without eval_data)
    probe: list[int]                    # token ids whose log-probs check each hand-off (plumbing/handoff.py)
    pad_id: int                         # the tokenizer's pad id (0 when it has none)
    out: Path                           # out_dir
    identity: dict                      # what a resume must match (plumbing/checkpoint.run_identity)
    handoff_check: tuple                # the last hand-off's check, which the next one compares with
    one_row: bool                       # packed micro-batches are one row (flash attention's varlen kernels)
    peers: accel.Peers                  # the ranks' heartbeat and the watchdog's phase names


def save_rollouts(acc, path: Path, step: int, problems: list[dict], slots: list[int], trajs: list, per_group: int,
                  kept: dict) -> None:
    """Every rollout of the step, from every rank, as trajectory records (`rollout.trajectory_record`, eval.py's
    format; problem-major) with what the update made of it: the step, its penalty counts' total, whether RoC kept
    it, its advantage and mini-batch.
    Rank 0 gathers them (no other rank holds a copy) and writes the file whole (a resumed step writes it again)."""
    mine = [{**trajectory_record(f"step {step}", problem, slot // per_group, slot % per_group, t), "step": step,
             "penalty": penalty_total(t.num_tool_calls, t.num_failed_tool_calls, t.num_answer_blocks, t.num_turns),
             "kept": slot in kept, "advantage": kept[slot][0] if slot in kept else None,
             "minibatch": kept[slot][1] if slot in kept else None}
            for problem, slot, t in zip(problems, slots, trajs)]
    every = accel.gather_to_main(acc, mine)
    if every is not None:
        records = sorted((r for rank in every for r in rank), key=lambda r: (r["problem_index"], r["sample"]))
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def held_out_eval(cfg: TrainConfig, run: Stage, step: int) -> dict:
    """Accuracy and diagnostics on the held-out split (mean reward over eval_samples samples per problem)."""
    acc = run.accelerator
    problems = run.eval_problems[acc.process_index::acc.num_processes]
    run.peers.start(f"held-out evaluation after step {step}")
    run.peers.phase("rollouts")
    trajs = rollout([p["problem"] for p in problems for _ in range(cfg.eval_samples)], run.sampler, run.tool,
                    run.tokenizer, run.fmt, max_response_tokens=cfg.max_response_tokens, max_turns=cfg.max_turns,
                    temperature=cfg.eval_temperature, top_p=1.0, sync_turns=cfg.sync_turns, more=run.peers.beating)
    run.peers.wait("rollouts")
    score_trajectories(trajs, [problems[i // cfg.eval_samples]["answer"] for i in range(len(trajs))])
    stats = accel.reduce_sums(acc, rollout_sums(trajs, [t.reward for t in trajs]))
    return {"eval/accuracy": stats["reward_mean"], "eval/tool_error_rate_in_correct":
            stats["tool_error_rate_in_correct"], "eval/response_tokens_mean": stats["response_tokens_mean"],
            "eval/tool_calls_mean": stats["tool_calls_mean"], "eval/truncated_frac": stats["truncated_frac"]}


def load_data(paths: list[str]) -> list[dict]:
    try:
        return [p for path in paths for p in load_problems(path)]
    except (OSError, ValueError) as e:
        raise SystemExit(f"input error: {e}") from None


def setup(cfg: TrainConfig, optimizer_and_schedule: Callable) -> tuple[int, Stage]:
    """Everything before step 0, in the order that stops on bad input before any expensive work: (the step to
    start from, the Stage). optimizer_and_schedule(cfg, parameters) -> (optimizer, lr scheduler): train.py's."""
    from accelerate.utils import DistributedType, set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    accel.cuda_allocator_conf()  # expandable segments unless the user set the allocator: before CUDA starts
    acc = accel.make_accelerator(mixed_precision=cfg.mixed_precision, report_to=cfg.report_to, out_dir=cfg.out_dir,
                                 timeout_s=cfg.process_group_timeout_s,  # trackers, timeouts, FSDP2 policy
                                 init_timeout_s=cfg.init_timeout_s)
    threads = cpu_threads.set_torch_threads(cfg.torch_threads)  # after Accelerate, which may set its own count
    validate(cfg, acc.num_processes)
    try:  # where and how model code runs (code_tool.py's sandbox modes)
        sandbox = choose_sandbox(cfg.tool_backend, cfg.tool_require_isolation)
    except SandboxError as e:
        raise SystemExit(f"config error: {e}") from None
    out = Path(cfg.out_dir)
    problems = load_data(cfg.data)
    eval_problems = load_data([cfg.eval_data]) if cfg.eval_data else []
    if cfg.eval_limit:
        eval_problems = eval_problems[:cfg.eval_limit]
    try:
        check_model_path(cfg.model_path)
        tokenizer = load_pretrained(AutoTokenizer, cfg.model_path)
    except ValueError as e:
        raise SystemExit(f"input error: {e}") from None
    fmt = chat_format_of(cfg)
    check_inputs(cfg, tokenizer, fmt, problems + eval_problems)
    identity = run_identity(cfg, cfg.data + ([cfg.eval_data] if cfg.eval_data else []))
    start = resume_point(cfg, out, identity, RESUME_FREE)
    if cfg.optimizer_from:
        optimizer_file(cfg.optimizer_from)
    acc.wait_for_everyone()  # every rank has read the folder before the main process changes it
    if acc.is_main_process:
        begin_run(out, start)
        print(format_config(cfg))
        print(f"{threads} torch thread(s)")
        save_config(cfg, out / "config.yaml")
        (out / "sandbox.txt").write_text(announce(sandbox) + "\n")
        if cfg.report_to:
            acc.init_trackers("rstar2", config=tracker_config(cfg))
    set_seed(cfg.seed + acc.process_index)  # rollouts differ per rank; everything else is seeded explicitly
    # fp32 master weights whatever the checkpoint's dtype: AdamW's steps at lr 1e-6 are far below bf16's
    # resolution (they would round away); mixed_precision=bf16 computes in bf16. Under LoRA the model's own
    # weights stay frozen in the checkpoint's dtype and only the adapter trains (plumbing/lora.py).
    try:
        model = load_pretrained(AutoModelForCausalLM, cfg.model_path,
                                torch_dtype=lora.weights_dtype(cfg, input_dtype(cfg.model_path)),
                                **attention.load_kwargs(cfg.attn_implementation))
    except ValueError as e:
        raise SystemExit(f"input error: {e}") from None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model = lora.attach(model, cfg)
    optimizer, scheduler = optimizer_and_schedule(cfg, [p for p in model.parameters() if p.requires_grad])
    # The scheduler is not given to acc.prepare: Accelerate would step it once per process at every optimizer step
    # (a warm-up num_processes times too fast); registered, so checkpoints keep it all the same.
    acc.register_for_checkpointing(scheduler)
    if acc.distributed_type == DistributedType.FSDP and not acc.is_fsdp2:
        raise SystemExit("config error: train.py shards with FSDP2: set fsdp_version: 2 in the Accelerate config "
                         "(configs/accelerate/*.yaml)")
    model, optimizer = acc.prepare(model, optimizer)
    lora.checkpoint_adapter_only(acc, model)  # under LoRA checkpoints keep the adapter, not the frozen weights
    if cfg.optimizer_from and start is None:  # after prepare: under FSDP the state is sharded like the model
        load_optimizer(acc, model, optimizer, optimizer_file(cfg.optimizer_from))
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"], group["initial_lr"] = lr, cfg.lr  # this stage's schedule, not the saved one
    step = 0
    if start is not None:
        step = load_checkpoint(acc, start)["step"]
        acc.print(f"resumed from {start} at step {step}")
    sampler = make_sampler(cfg, handoff.sampler_policy(cfg, acc, model), tokenizer)
    try:  # an error from here on ends the engine as one in the loop does (run_stage's `finally`)
        check_sampler(cfg, sampler)
        # The sampler starts from the trainer's weights (a resumed checkpoint's too), checked before any rollout.
        probe = encode(tokenizer, fmt.prompt(problems[0]["problem"]))[:handoff.HANDOFF_PROBE_TOKENS]
        check = handoff.sync(acc, model, sampler, probe, "at the start")
        peers = accel.peers(cfg.peer_timeout_s, "train")
        tool = CodeTool(workers=cfg.tool_workers, timeout=cfg.tool_timeout, memory_mb=cfg.tool_memory_mb,
                        max_output_chars=cfg.tool_max_output_chars, backend=cfg.tool_backend,
                        require_isolation=cfg.tool_require_isolation, error_format=cfg.tool_error_format)
        run = Stage(accelerator=acc, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                    tool=tool, tokenizer=tokenizer, fmt=fmt, problems=problems, eval_problems=eval_problems,
                    probe=probe, pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
                    out=out, identity=identity, handoff_check=check,
                    one_row=one_row_attention(acc.unwrap_model(model)), peers=peers)
        default_pool().start()  # the answer checkers import sympy while the first rollout runs, not after it
    except BaseException:
        accel.end_sampler(sampler)  # on an error path: abandoned, no shutdown at exit on the ended groups
        raise
    return step, run


def one_row_attention(model) -> bool:
    """Whether the model's attention keeps packed sequences apart at the cost of their own lengths only (flash
    attention's varlen kernels, which read the sequences from position_ids in a batch of one row): then a packed
    micro-batch is one row (update_plan.layout_for; plumbing/attention.py)."""
    return attention.one_row(str(getattr(model.config, "_attn_implementation", "")))


def check_sampler(cfg: TrainConfig, sampler) -> None:
    """At start-up, one line when the sampler cannot do what the config asks of it: report its free KV cache under
    claim_rule=free_kv (schedule.check_kv_room), rather than a rule that quietly claims by another one."""
    if cfg.claim_rule == "free_kv":
        check_kv_room(sampler)


def make_sampler(cfg: TrainConfig, model, tokenizer):
    if cfg.sampler == "vllm":
        from accelerate import PartialState
        state = PartialState()
        # One engine per rank: under torchrun / accelerate launch, vLLM's external launcher gives each rank's
        # engine its own device (LOCAL_RANK); sampling seeds differ per rank.
        launcher = {"distributed_executor_backend": "external_launcher"} if state.num_processes > 1 else {}
        # vLLM's dummy weights, no checkpoint read: the hand-off "at the start" sends every weight into an engine
        # that has none of the policy's (plumbing/handoff.py, LoRA too), and its check verifies they all arrived.
        return VLLMSampler(cfg.model_path, tokenizer, seed=cfg.seed + state.process_index, dtype=cfg.vllm_dtype,
                           gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                           tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                           enforce_eager=cfg.vllm_enforce_eager, load_format="dummy",
                           enable_sleep_mode=cfg.vllm_enable_sleep_mode,
                           sleep_mode_offload_cudagraph=cfg.vllm_sleep_mode_offload_cudagraph,
                           group_timeout_s=cfg.process_group_timeout_s, **launcher)
    return HFSampler(model, tokenizer, batch_size=cfg.rollout_batch_size, kv_dtype=autocast_kv_dtype(cfg, model))


def autocast_kv_dtype(cfg: TrainConfig, model) -> torch.dtype | None:
    """bf16 for the HF sampler's KV cache where its model is the trainer's own under bf16 mixed precision: there
    every forward runs under autocast, whose attention reads keys and values in bf16 whatever they are stored in, so
    storing them in bf16 halves the cache (gigabytes for 128 rollouts of SmolLM2-135M) and samples the same tokens
    and log-probs. Accelerate marks a forward it wrapped in autocast by keeping the original (`_original_forward`,
    which its unwrap_model restores); a model without it (a copy for FSDP or LoRA) keeps its own dtype."""
    wrapped = getattr(model, "_original_forward", None) is not None
    return torch.bfloat16 if cfg.mixed_precision == "bf16" and wrapped else None


# Shown on the step line above a threshold: the sampler-trainer gap (an fp32 engine's is ~1e-6, rounding in another
# summation order; a bf16 engine's ~1e-2: bench/sampler_gap.py), and the ranks' rollout time spent waiting for the
# slowest rank (schedule.py).
SHOWN_ABOVE = {"mismatch/logp_abs_diff_mean": ("gap", 1e-3), "perf/rollout_wait_frac": ("wait", 0.2)}


def log_line(step: int, m: dict) -> str:
    keys = [("reward", "rollout/reward_mean"), ("acc", "eval/accuracy"), ("err+", "rollout/tool_error_rate_in_correct"),
            ("calls", "rollout/tool_calls_mean"), ("len", "rollout/response_tokens_mean"),
            ("trunc", "rollout/truncated_frac"), ("equal", "roc/equal_group_frac"), ("tok/s", "perf/tokens_per_s")]
    keys += [(name, k) for k, (name, above) in SHOWN_ABOVE.items() if m.get(k, 0.0) > above]
    return f"step {step:4d} " + " ".join(f"{name} {m[k]:.3g}" for name, k in keys if k in m)


def rollout_wait(accelerator, seconds: float) -> dict:
    """The ranks' rollout times: the slowest, and the share of rollout time spent waiting for it (schedule.py)."""
    times = [float(t) for part in accel.all_gather_rows(accelerator, torch.tensor([[seconds]], dtype=torch.float64))
             for t in part.flatten()]
    return accel.shared_sums(len(times), {"perf/rollout_wait_frac": (wait_fraction(times), 1.0),
                                    "perf/rollout_max_s": (max(times), 1.0)})


def roc_stats(scores: list, groups: list[int], kept: dict, per_group: int) -> dict:
    """The step's RoC statistics from the gathered scores, as {name: (sum, count)}."""
    n_groups = len(scores) // per_group
    pos = [scores[s] for s in kept if scores[s].reward > 0]
    return {"roc/equal_group_frac": (n_groups - len(groups), n_groups),
            "roc/pos_kept_mean": (len(pos), len(groups)), "roc/neg_kept_mean": (len(kept) - len(pos), len(groups)),
            "roc/tool_error_rate_in_correct": (sum(s.failed_calls for s in pos), sum(s.tool_calls for s in pos))}


def step_metrics(acc, trajs: list, verdicts: list, scores: list, groups: list[int], kept: dict, per_group: int,
                 plan: dict, lr: float, **seconds: float) -> dict:
    """The step's numbers for the log, as {name: (sum, count)} to be reduced over ranks: this rank's rollouts
    (rewards, tool use, lengths), the step's RoC statistics and the update plan's (every rank computed them alike:
    counted once), the ranks' rollout wait, the timings (seconds: rollout, update, step) and the lr."""
    world = acc.num_processes
    sums = {f"rollout/{k}": v for k, v in rollout_sums(trajs, [t.reward for t in trajs]).items()}
    sums.update(accel.shared_sums(world, {**roc_stats(scores, groups, kept, per_group), **plan}))
    sums.update(rollout_wait(acc, seconds["rollout"]))
    sums.update({"perf/tokens_per_s": (sum(sum(t.loss_mask) for t in trajs), seconds["rollout"]),
                 **{f"perf/{name}_s": (s, 1.0) for name, s in seconds.items()}, "loss/lr": (lr, 1.0),
                 "reward/timeouts": (sum(v.timed_out for v in verdicts), 1.0 / world)})
    return sums
