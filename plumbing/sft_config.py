"""sft.py's config: its fields (each with its comment, which `--help` shows), what may change on resume, and the
ranges checked before any work."""
from dataclasses import dataclass, field

from plumbing import accel
from plumbing.lora import DEFAULT_TARGETS
from protocol import DEFAULT_USER_INSTRUCTION, TOOL_NAME


@dataclass
class SFTConfig:
    model_path: str = ""  # base model: a save_pretrained folder (or a hub id, e.g. Qwen/Qwen3-14B-Base)
    data: str = ""  # JSONL of {"messages": [...]} conversations
    out_dir: str = "runs/sft"  # config.yaml, metrics.jsonl and model/ go here
    epochs: int = 3  # report: 3
    lr: float = 5e-6  # report: 5e-6 (peak, after warm-up)
    warmup_ratio: float = 0.04  # report: 4% of steps, linear from 0
    decay_ratio: float = 1.0  # the cosine decay's share of the steps after warm-up (report: all; less holds the peak)
    batch_size: int = 128  # report: 128 sequences per optimizer step (global, all ranks)
    micro_batch_size: int = 4  # sequences per forward pass per rank
    max_seq_len: int = 8192  # longer conversations are skipped (and counted)
    group_by_length: bool = True  # micro-batches of similar length (less padding); False: plain shuffle
    packing: bool = False  # each micro-batch's conversations packed into fewer rows (`pack`); the same loss
    weight_decay: float = 0.0  # AdamW; report: not stated
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0  # max global grad norm; report gives 1.0 for RL, nothing for SFT
    seed: int = 0
    system_prompt: str = "default"  # a preset (default, compact, rstar2_public) or the text itself (protocol.py)
    user_instruction: str = DEFAULT_USER_INSTRUCTION  # fills user_template's {instruction} slot ("" for none)
    user_template: str = "default"  # the user turn: a preset (default, rstar2_public) or a text with {problem}
    tool_name: str = TOOL_NAME  # the tool the conversations' calls name (public format: python_code_with_standard_io)
    tool_required: list[str] = field(default_factory=lambda: ["code"])  # the arguments its schema marks required
    tool_result_format: str = "default"  # the chat format's (train.py, eval.py); SFT data holds its results as text
    newline_after_turn: bool = True  # "\n" after an assistant turn's <|im_end|> (the public agent loop writes none)
    mixed_precision: str = "no"  # "no" or "bf16" (Accelerate autocast; the weights stay fp32 masters)
    gradient_checkpointing: bool = False  # recompute each layer in the backward: activations of one layer, not all
    attn_implementation: str = "auto"  # auto | sdpa | eager | flash_attention_2 | ... (plumbing/attention.py)
                                       # auto: flash_attention_2 on a GPU with flash_attn, else sdpa
    lora_rank: int = 0  # LoRA's r (lora.py); 0: no LoRA, every weight trains as fp32 masters
    lora_alpha: float = 32.0  # the adapter's change is scaled by lora_alpha / lora_rank
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))  # modules adapted: all linear
    lora_dropout: float = 0.0  # dropout on the adapter's input (>0 makes the update's ratios noisy)
    lora_from: str | None = None  # an adapter/ folder to continue; model_path is then the base it was on
    log_every: int = 10  # optimizer steps between log lines
    report_to: str | None = None  # None, "tensorboard" or "wandb"; a tracker that cannot start stops the run
    process_group_timeout_s: float = accel.PROCESS_GROUP_TIMEOUT_S  # NCCL watchdog: a collective waits this long
    init_timeout_s: float = accel.INIT_TIMEOUT_S  # every rank of a (re)started group joins within this
    peer_timeout_s: float = accel.PEER_TIMEOUT_S  # a rank silent this long stops every rank (accel.py, point 7)
    max_steps: int | None = None  # stop after this many optimizer steps (tests, smoke runs)
    save_every: int = 0  # optimizer steps between checkpoints (0: none); a multiple of log_every
    keep_checkpoints: int = 2  # newest checkpoints kept in out_dir
    resume: str = "auto"  # "auto": continue from out_dir's latest checkpoint; "never"; or a checkpoint folder
    resume_allow_changes: list[str] = field(default_factory=list)  # config keys that may differ from the checkpoint's
    torch_threads: int = 0  # torch CPU threads; 0: as many as the free cores (cpu_threads.py)


# Keys that may differ from the checkpoint's config on resume without `resume_allow_changes`: they change neither the
# weights nor the logged numbers (trackers, checkpoint cadence). log_every is not free: it sets which steps' losses
# each metrics line averages.
RESUME_FREE = {"resume", "resume_allow_changes", "out_dir", "report_to", "save_every", "keep_checkpoints",
               "torch_threads", "process_group_timeout_s", "init_timeout_s",
               "peer_timeout_s"}


# Allowed values of the numeric fields (config.check_ranges), checked by `check_inputs` before any work.
RANGES = {
    "epochs": ">= 1", "lr": "> 0", "warmup_ratio": ">= 0 and <= 1", "batch_size": ">= 1", "micro_batch_size": ">= 1",
    "decay_ratio": "> 0 and <= 1", "max_seq_len": ">= 2", "weight_decay": ">= 0", "adam_beta1": ">= 0 and < 1",
    "adam_beta2": ">= 0 and < 1",
    "grad_clip": "> 0", "seed": ">= 0 and <= 4294967295", "log_every": ">= 1", "max_steps": ">= 1",
    "save_every": ">= 0", "keep_checkpoints": ">= 1", "torch_threads": ">= 0", "process_group_timeout_s": "> 0",
    "init_timeout_s": "> 0", "peer_timeout_s": "> 0",
    "lora_rank": ">= 0", "lora_alpha": "> 0", "lora_dropout": ">= 0 and < 1",
}
