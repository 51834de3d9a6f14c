"""What eval.py's command runs on, which a first read can skip: its ranks under torchrun / accelerate launch (the
process group, each rank's share of the problems and seed, the gather to the main process), the sampler on the
rank's device (`load_model`), and its output folder (what results.json records, the benchmarks an earlier run
finished, the trajectories kept, the unsolved problems).
"""
import json
import os
from pathlib import Path

from plumbing.checkpoint import config_changes, filter_jsonl, read_jsonl_rows, run_identity
from plumbing.data import load_pretrained
from plumbing.eval_config import CONTINUE_FREE, EvalConfig
from protocol import IM_END


# ============================================================================ ranks (torchrun / accelerate launch)
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


# ============================================================================ the output folder
def eval_identity(cfg: EvalConfig, benchmark_files: list[Path]) -> dict:
    """What results.json records of the evaluation: config, benchmark files' sha256, and the size and mtime of each
    model file (a model retrained in place is another model; hashing 30 GB of weights would take minutes)."""
    identity = run_identity(cfg, benchmark_files)
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
