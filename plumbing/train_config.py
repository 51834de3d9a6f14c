"""The configuration of one RL stage (train.py): every field with its report symbol and default, the allowed values
of the numeric ones, the keys a resume may change freely, the config checks made before any work (`validate`,
against the algorithm's tables of options), the input check that needs the tokenizer, and the dry run's plan."""
import math
import os
import sys
from dataclasses import dataclass, field

from code_tool import ERROR_FORMATS
from grpo_roc import LOSSES, ROC_SELECTORS
from mismatch import CORRECTIONS
from plumbing import accel, attention, lora
from plumbing.config import check_ranges
from plumbing.lora import DEFAULT_TARGETS
from plumbing.update_plan import layout_for
from protocol import DEFAULT_USER_INSTRUCTION, TOOL_NAME, chat_format_of, encode
from schedule import CLAIM_RULES, SCHEDULES
from tools.memory_plan import engine_lines, memory_lines

USAGE = """One RL stage with GRPO-RoC.
  python train.py [CONFIG.yaml ...] [key=value ...]
  python train.py configs/tiny/stage1.yaml steps=20 roc_mode=lowest
  python train.py configs/qwen3-14b/stage1.yaml dry_run=true world_size=64      # the plan, no model loaded
  accelerate launch --config_file configs/accelerate/fsdp_1node_8gpu.yaml train.py configs/qwen3-14b/stage1.yaml"""


@dataclass
class TrainConfig:
    # --- run
    model_path: str = ""                  # policy to start from: the SFT model or the previous stage's model/
    data: list[str] = field(default_factory=list)  # JSONL files with `problem` and an integer `answer`
    out_dir: str = "runs/stage1"          # config.yaml, metrics.jsonl, checkpoints, model/, curves.png
    stage: int = 1                        # label only (report: stages 1, 2, 3)
    steps: int = 300                      # report: 300 / 85 / 125 steps for stages 1 / 2 / 3
    seed: int = 0                         # the one seed; every random choice derives from it
    resume: str = "auto"                  # auto: continue from out_dir's latest checkpoint; never: refuse one; or a path
    resume_allow_changes: list[str] = field(default_factory=list)  # config keys that may differ from the checkpoint's
    dry_run: bool = False                 # print the resolved plan and exit without loading a model
    world_size: int = 0                   # for dry_run only: plan for this many processes (0: the launcher's)
    gpus_per_node: int = 8                # for dry_run only: GPUs per node (the launch configs shard within one)
    gpu_memory_gb: float = 150.7          # for dry_run only: one GPU's memory as its driver reports it (H200: 150.7)
    model_shape: str = ""                 # for dry_run only, before model_path exists: qwen3-0.6b | 1.7b | 8b | 14b
    fsdp: bool = True                     # for dry_run only: the launch shards with FSDP2 (false: python train.py
                                          # on one GPU, or a DDP launch)
    # --- GRPO-RoC (report §2)
    prompts_per_step: int = 512           # B (over all ranks)
    rollouts_per_prompt: int = 32         # 2G sampled per prompt
    group_size: int = 16                  # G kept per prompt after RoC
    roc_mode: str = "sample"              # a key of grpo_roc.ROC_SELECTORS: sample (report) | lowest (public code) | off | uniform (ablations)
                                          # | off (plain GRPO: keep all 2G)
    loss_agg: str = "token"               # token (report, DAPO-style) | sequence (original GRPO), for ablations
    clip_low: float = 0.2                 # epsilon_low; binds only when updates_per_step > 1: with one
                                          # optimizer step the old log-probs are the update's own, detached, so
                                          # the ratio is 1 at every token and no clip acts (the shipped configs)
    clip_high: float = 0.28               # epsilon_high (clip-higher); as clip_low, only when updates_per_step > 1
    dual_clip: float | None = None        # verl's 3.0 for A < 0; not in the report; as clip_low, only when
                                          # updates_per_step > 1
    # --- engine-trainer mismatch (beyond the report; docs/method.md §9): always measured, corrected when asked
    mismatch_correction: str = "off"      # off (report) | tis (token-level truncated IS) | seq_mask (geometric band)
    mismatch_tis_cap: float = 2.0         # tis: C in min(pi_old / pi_sampler, C) (verl's default 2; TRL's 3)
    mismatch_seq_low: float = 0.999       # seq_mask: a rollout whose geometric-mean ratio pi_old / pi_sampler is
                                          # below this is dropped (verl's geometric preset)
    mismatch_seq_high: float = 1.001      # seq_mask: a rollout whose geometric-mean ratio is above this is dropped
    # --- rollout (report §2 and §4)
    max_response_tokens: int = 8192       # total response budget: 8K / 12K / 12K in stages 1 / 2 / 3
    max_turns: int = 10                   # assistant turns: 10 / 10 / 15 in stages 1 / 2 / 3
    max_prompt_tokens: int = 2048         # a longer rendered prompt is an input error
    temperature: float = 1.0              # report: 1.0 for training rollouts
    top_p: float = 1.0
    system_prompt: str = "default"        # a preset (default, compact, rstar2_public) or the text itself (protocol.py)
    user_instruction: str = DEFAULT_USER_INSTRUCTION  # fills user_template's {instruction} slot ("" for none)
    user_template: str = "default"        # the user turn: a preset (default, rstar2_public) or text with {problem}
    tool_name: str = TOOL_NAME            # the name a call must give (public format: python_code_with_standard_io)
    tool_required: list[str] = field(default_factory=lambda: ["code"])  # the arguments its schema marks required
    tool_result_format: str = "default"   # how a result reads: default ("ok\n4\n") | rstar2_public ("Tool call ...")
    newline_after_turn: bool = True       # "\n" after an assistant turn's <|im_end|> (the public agent loop: none)
    sampler: str = "hf"                   # hf (our decode loop on transformers, CPU/GPU) | vllm (GPU; CPU build too)
    rollout_batch_size: int = 64          # rollouts a rank runs at once: hf sampler slots; claims stop there
    schedule: str = "balanced"            # balanced (claim rollouts as engines free up, balance the update) | static
    claim_size: int = 1                   # rollouts one claim takes under balanced: 1 = the report's per-request
                                          # dispatch, rollouts_per_prompt = whole prompts (bench/rollout_schedule.py)
    claim_rule: str = "count"             # when a rank claims under balanced: free_kv (its engine has room for one
                                          # more, report §3.2) | count (< rollout_batch_size unfinished); schedule.py
    sync_turns: bool = False              # turns wait for all the batch's tool calls (batches independent of timing)
    vllm_gpu_memory_utilization: float = 0.5  # vLLM's share of the reported GPU memory (tools/memory_plan.py)
    vllm_tensor_parallel_size: int = 1    # only 1: one single-device engine per rank
    vllm_dtype: str = "bfloat16"          # the engine's weights and activations (float32 for the tiny CPU runs)
    vllm_enforce_eager: bool = False      # no CUDA graphs / torch.compile (faster start; the CPU build's tests)
    vllm_enable_sleep_mode: bool = True   # sleep (level 2) through each update, freeing the engine's GPU memory;
                                          # false: no sleep calls, the engine stays resident (tools/memory_plan.py)
    vllm_sleep_mode_offload_cudagraph: bool = True  # asleep, the CUDA graphs go to CPU RAM (false: stay on the GPU)
    # --- code tool (report §3)
    tool_workers: int = 4
    tool_timeout: float = 4.0             # seconds per call (public code: 4 s)
    tool_memory_mb: int = 512
    tool_max_output_chars: int = 1000     # public code: 1,000 characters
    tool_backend: str = "auto"            # auto | servers (Linux) | subprocess (portable, slower)
    tool_require_isolation: bool = False  # refuse to start without namespaces, Landlock and seccomp
    tool_error_format: str = "full"       # a failed call's text: full (compact traceback) | last_line (exception only)
    # --- optimizer (report §4)
    lr: float = 1e-6                      # constant after warm-up
    warmup_steps: int = 20                # in optimizer steps (RL steps when updates_per_step is 1)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    updates_per_step: int = 1             # optimizer steps (mini-batches) per RL step; 1: on policy, the ratio is
                                          # 1 and the clips never bind; > 1: mini-batches after the first see a
                                          # moved policy against the step's old log-probs, and the clips act
    max_tokens_per_micro_batch: int = 0   # tokens per forward/backward, rollouts packed (update_plan.py); 0: micro-
                                          # batches of micro_batch_size rollouts, padded
    micro_batch_size: int = 4             # rollouts per forward/backward when max_tokens_per_micro_batch is 0
    optimizer_from: str | None = None     # a run or checkpoint folder whose AdamW state to start from; None: fresh
    mixed_precision: str = "no"           # no | bf16
    gradient_checkpointing: bool = False
    attn_implementation: str = "auto"     # auto | sdpa | eager | flash_attention_2 | ... (plumbing/attention.py)
                                          # auto: flash_attention_2 on a GPU with flash_attn, else sdpa
    lora_rank: int = 0                    # LoRA's r (lora.py); 0: no LoRA, every weight trains as fp32 masters
    lora_alpha: float = 32.0              # the adapter's change is scaled by lora_alpha / lora_rank
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))  # modules adapted: all linear
    lora_dropout: float = 0.0             # dropout on the adapter's input (>0 makes the update's ratios noisy)
    lora_from: str | None = None          # an adapter/ folder to continue; model_path is then the base it was on
    # --- logging, evaluation during training, checkpoints
    log_every: int = 1
    eval_data: str | None = None          # held-out JSONL for accuracy curves during training
    eval_every: int = 0                   # steps between held-out evaluations (0: only at the end if eval_data)
    eval_samples: int = 2
    eval_temperature: float = 0.6
    eval_limit: int = 0                   # first N held-out problems (0: all)
    save_every: int = 50
    save_rollouts_every: int = 0          # steps between written rollouts (out_dir/rollouts/step_N.jsonl); 0: none
    keep_checkpoints: int = 2
    report_to: str | None = None          # tensorboard | wandb (Accelerate trackers); stops if it cannot start
    process_group_timeout_s: float = accel.PROCESS_GROUP_TIMEOUT_S  # a collective's wait; sized in accel.py
    peer_timeout_s: float = accel.PEER_TIMEOUT_S  # a rank silent this long while others wait for it stops the run
    init_timeout_s: float = accel.INIT_TIMEOUT_S  # every rank of a (re)started group joins within this
    torch_threads: int = 0                # torch CPU threads; 0: as many as the free cores (cpu_threads.py)


# Allowed values of the numeric fields (config.check_ranges), checked by `validate` before any work.
RANGES = {
    "steps": ">= 1", "seed": ">= 0 and <= 4294967295", "world_size": ">= 0", "gpus_per_node": ">= 1",
    "gpu_memory_gb": "> 0",
    "prompts_per_step": ">= 1", "rollouts_per_prompt": ">= 2", "group_size": ">= 2",
    "clip_low": ">= 0 and < 1", "clip_high": ">= 0", "dual_clip": "> 1",
    "mismatch_tis_cap": "> 0", "mismatch_seq_low": "> 0 and <= 1", "mismatch_seq_high": ">= 1",
    "max_response_tokens": ">= 16", "max_turns": ">= 1", "max_prompt_tokens": ">= 1",
    "temperature": "> 0",  # the update divides the logits by it (0 is greedy for a sampler, undefined here)
    "top_p": "> 0 and <= 1", "rollout_batch_size": ">= 1", "claim_size": ">= 1",
    "vllm_gpu_memory_utilization": "> 0 and <= 1", "vllm_tensor_parallel_size": ">= 1",
    "tool_workers": ">= 0", "tool_timeout": "> 0", "tool_memory_mb": ">= 1", "tool_max_output_chars": ">= 1",
    "lr": "> 0", "warmup_steps": ">= 0", "weight_decay": ">= 0", "adam_beta1": ">= 0 and < 1",
    "adam_beta2": ">= 0 and < 1", "grad_clip": "> 0", "updates_per_step": ">= 1", "micro_batch_size": ">= 1",
    "max_tokens_per_micro_batch": ">= 0",
    "log_every": ">= 1", "eval_every": ">= 0", "eval_samples": ">= 1", "eval_temperature": ">= 0",
    "eval_limit": ">= 0", "save_every": ">= 1", "save_rollouts_every": ">= 0", "keep_checkpoints": ">= 1", "torch_threads": ">= 0",
    "process_group_timeout_s": "> 0", "peer_timeout_s": "> 0", "init_timeout_s": "> 0",
    "lora_rank": ">= 0", "lora_alpha": "> 0", "lora_dropout": ">= 0 and < 1",
}


# Keys that may differ from the checkpoint's config on resume without `resume_allow_changes`: they change no number
# the run computes (printing, trackers, checkpoint cadence, threads and tool workers, vLLM's memory share and sleep
# mode). Any other change (steps, batch shapes, data, lr, seeds, budgets) is refused unless named in
# resume_allow_changes.
RESUME_FREE = {"resume", "resume_allow_changes", "out_dir", "dry_run", "world_size", "gpus_per_node",
               "gpu_memory_gb", "model_shape", "fsdp", "log_every", "report_to", "save_every", "save_rollouts_every",
               "keep_checkpoints",
               "torch_threads", "tool_workers", "tool_backend", "tool_require_isolation",
               "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_sleep_mode_offload_cudagraph",
               "process_group_timeout_s", "peer_timeout_s", "init_timeout_s"}


def check_inputs(cfg: TrainConfig, tokenizer, fmt, problems: list[dict]) -> None:
    """Input errors that need the tokenizer: a prompt longer than max_prompt_tokens names its file and line."""
    for p in problems:
        n = len(encode(tokenizer, fmt.prompt(p["problem"])))
        if n > cfg.max_prompt_tokens:
            raise SystemExit(f"input error: {p.where}: prompt is {n} tokens, over max_prompt_tokens="
                             f"{cfg.max_prompt_tokens}")


def plan_lines(cfg: TrainConfig, world: int) -> list[str]:
    """The resolved plan of a stage at `world` processes, without loading a model (train.py's dry_run=true: check a
    64-GPU config on a laptop): the batch shapes per rank here, then the engines and the memory per GPU
    (tools/memory_plan.py)."""
    per_rank = cfg.prompts_per_step // world
    kept = per_rank * cfg.group_size
    lines = [
        f"world size             {world}",
        f"prompts per step       {cfg.prompts_per_step} (B) = {per_rank} per rank" + (
            f" on average (claimed {cfg.claim_size} rollout(s) at a time as engines free up, "
            + ("while the engine has room for one more)" if cfg.claim_rule == "free_kv" else
               f"< {cfg.rollout_batch_size} rollouts unfinished per rank)")
            if cfg.schedule == "balanced" and world > 1 else ""),
        f"rollouts per step      {cfg.prompts_per_step * cfg.rollouts_per_prompt} (2G = {cfg.rollouts_per_prompt}"
        f" per prompt), {per_rank * cfg.rollouts_per_prompt} per rank",
        f"kept for the update    at most {kept} per rank (G = {cfg.group_size}, RoC mode {cfg.roc_mode})",
        (f"micro-batches          packed, up to {cfg.max_tokens_per_micro_batch:,} tokens each (a longer rollout alone), "
         f"the same slots on every rank, {cfg.updates_per_step} optimizer step(s) per RL step"
         if cfg.max_tokens_per_micro_batch else
         f"micro-batches          up to {math.ceil(kept / cfg.micro_batch_size)} per rank of {cfg.micro_batch_size}"
         f" sequences, padded, {cfg.updates_per_step} optimizer step(s) per RL step"),
        f"token budget           {cfg.max_response_tokens} response tokens, {cfg.max_turns} turns per rollout; "
        f"at most {per_rank * cfg.rollouts_per_prompt * cfg.max_response_tokens:,} response tokens per rank per step",
        f"steps                  {cfg.steps} (stage {cfg.stage}), lr {cfg.lr} after {cfg.warmup_steps} warm-up steps",
        f"sampler                {cfg.sampler}; data {cfg.data}; out {cfg.out_dir}",
        attention_line(cfg),
    ]
    name = attention.resolve(cfg.attn_implementation)
    layout = layout_for(cfg.max_tokens_per_micro_batch, attention.one_row(name))
    return lines + engine_lines(cfg, world) + memory_lines(cfg, world, name, layout)


def attention_problems(cfg: TrainConfig, loading: bool) -> list[str]:
    """The attention's problems (plumbing/attention.py: an unknown name, a kernel not importable when a model will be
    loaded) and packing's: micro-batches cut by tokens on a transformers that packs wrongly."""
    problems = [p for p in [attention.check(cfg.attn_implementation, loading)] if p]
    if cfg.max_tokens_per_micro_batch:
        packing = attention.packing_problem(attention.transformers_version(),
                                            f"max_tokens_per_micro_batch={cfg.max_tokens_per_micro_batch}")
        problems += [packing] if packing else []
    return problems


def attention_line(cfg: TrainConfig) -> str:
    """The dry run's line for the attention and the update's layout (update_plan.layout_for)."""
    name = attention.resolve(cfg.attn_implementation)
    said = f"{name} (auto on this machine)" if cfg.attn_implementation == "auto" else name
    layout = layout_for(cfg.max_tokens_per_micro_batch, attention.one_row(name))
    return f"attention              {said}; micro-batch layout {layout}: " + {
        "padded": "one rollout a row, padded to the longest",
        "one_row": "the packed rollouts in one row, kept apart by position_ids (no mask)",
        "rows": "packed rows about as wide as the longest rollout, kept apart by a mask built from position_ids "
                "(sdpa, eager: a dense (rows, 1, width, width) one)"}[layout]


def unbound_clip(cfg: TrainConfig) -> str:
    """Why the configured clips cannot act ("" where they can): with updates_per_step 1 the update's old log-probs
    are its own log-probs, detached (train.update_policy), so the ratio is 1 at every token."""
    if cfg.updates_per_step > 1:
        return ""
    clips = f"clip_low={cfg.clip_low}, clip_high={cfg.clip_high}" + (
        f", dual_clip={cfg.dual_clip}" if cfg.dual_clip is not None else "")
    return (f"updates_per_step=1: the ratio pi / pi_old is 1 at every token (on policy), so {clips} never bind; "
            "set updates_per_step > 1 for the clip to act")


def validate(cfg: TrainConfig, world: int) -> None:
    """Config errors that need no files, raised before any work; a clip that cannot bind is a warning (one line on
    stderr, from the first process)."""
    if (note := unbound_clip(cfg)) and os.environ.get("RANK", "0") == "0":
        print(f"config warning: {note}", file=sys.stderr, flush=True)
    problems = check_ranges(cfg, RANGES) + lora.check_config(cfg)
    if cfg.roc_mode not in ROC_SELECTORS:
        problems.append(f"roc_mode must be one of {list(ROC_SELECTORS)}, got {cfg.roc_mode!r}")
    if cfg.roc_mode == "off" and cfg.group_size != cfg.rollouts_per_prompt:
        problems.append("roc_mode=off keeps every rollout: set group_size == rollouts_per_prompt")
    if cfg.claim_size > cfg.rollouts_per_prompt:
        problems.append(f"claim_size={cfg.claim_size} is more than a prompt's rollouts_per_prompt="
                        f"{cfg.rollouts_per_prompt}")
    if not 2 <= cfg.group_size <= cfg.rollouts_per_prompt:
        problems.append(f"need 2 <= group_size <= rollouts_per_prompt, got {cfg.group_size}, {cfg.rollouts_per_prompt}")
    if cfg.prompts_per_step % world:
        problems.append(f"prompts_per_step={cfg.prompts_per_step} must divide over {world} processes")
    size = 1 if cfg.max_tokens_per_micro_batch else max(cfg.micro_batch_size, 1)  # minibatch_of's unit
    most = math.ceil(cfg.prompts_per_step * cfg.group_size / size)
    if cfg.updates_per_step > most > 0:
        # the last optimizer steps would never get a micro-batch (minibatch_of): updates with nothing to learn from
        unit = "kept rollouts" if cfg.max_tokens_per_micro_batch else "micro-batch(es)"
        problems.append(f"updates_per_step={cfg.updates_per_step} exceeds the {most} {unit} of a step "
                        f"(prompts_per_step * group_size" + ("" if size == 1 else " / micro_batch_size") + ")")
    if cfg.loss_agg not in LOSSES:
        problems.append(f"loss_agg must be one of {sorted(LOSSES)}, got {cfg.loss_agg!r}")
    if cfg.mismatch_correction not in CORRECTIONS:
        problems.append(f"mismatch_correction must be one of {list(CORRECTIONS)}, got {cfg.mismatch_correction!r}")
    if cfg.claim_rule not in CLAIM_RULES:
        problems.append(f"claim_rule must be one of {list(CLAIM_RULES)}, got {cfg.claim_rule!r}")
    if cfg.schedule not in SCHEDULES:
        problems.append(f"schedule must be one of {list(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.sampler not in ("hf", "vllm"):
        problems.append(f"sampler must be hf or vllm, got {cfg.sampler!r}")
    problems += attention_problems(cfg, loading=not cfg.dry_run)
    if cfg.vllm_tensor_parallel_size != 1:
        problems.append(f"vllm_tensor_parallel_size={cfg.vllm_tensor_parallel_size}: only 1 is supported (one "
                        "engine per rank; tensor parallelism would need a rank group to submit the same requests)")
    if cfg.tool_error_format not in ERROR_FORMATS:
        problems.append(f"tool_error_format must be one of {ERROR_FORMATS}, got {cfg.tool_error_format!r}")
    try:  # the chat format's fields (protocol.chat_format)
        chat_format_of(cfg)
    except ValueError as e:
        problems.append(str(e))
    if not cfg.data:
        problems.append("data: give at least one JSONL file of problems")
    if problems:
        raise SystemExit("config error: " + "; ".join(problems))
