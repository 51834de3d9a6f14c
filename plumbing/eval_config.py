"""eval.py's config: its fields (each with its comment, which `--help` shows), their ranges and the checks made
before any work, including those that depend on the launch."""
import os
from dataclasses import dataclass, field

from plumbing.config import check_ranges
from protocol import DEFAULT_USER_INSTRUCTION, TOOL_NAME, chat_format_of


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


def check_launch(cfg: EvalConfig) -> None:
    """Config errors that depend on the launch: vLLM's external launcher makes the ranks of one tensor-parallel
    group share an engine, which must then get the same prompts; here every rank plays its own problems."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and cfg.sampler == "vllm" and cfg.vllm_tensor_parallel_size > 1:
        raise SystemExit(f"config error: vllm_tensor_parallel_size={cfg.vllm_tensor_parallel_size} under a launcher "
                         f"with {world} processes; launch one process (its engine spans the GPUs) or use "
                         "vllm_tensor_parallel_size=1 (one engine per rank)")
