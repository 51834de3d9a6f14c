"""The Accelerator that sft.py and train.py build, with the three settings a GPU run depends on and Accelerate
leaves to the caller.

1. The process-group timeout (`process_group_timeout_s` in both configs). torch's default for NCCL is 10 minutes,
   after which the watchdog kills a rank stuck in a collective. In train.py the fast ranks wait in the update's first
   collective while the slowest rank finishes its rollouts (schedule.py shortens that wait; it cannot remove it),
   and every rank waits while checkpoints and the final model are written. The default, 2 hours, is sized for the
   report's stages 2-3 at 64 GPUs under schedule=static: the slowest rank's 256 rollouts (8 prompts x 2G = 32) can
   all run to the 12,288-token budget, 3.1M tokens; a colocated 14B engine on an
   H200 holds ~250K tokens of KV cache (tools/memory_plan.py), ~18 such rollouts at once, and each decode step reads its
   weights and that cache (~70 GB at ~4.8 TB/s, ~15 ms) for ~18 tokens: ~1,200 tokens/s, ~45 minutes, plus the
   tool calls. Writing a 14B checkpoint adds minutes (the gathered model alone is 30-60 GB). Twice that worst case
   leaves room; a real hang still stops the run, after 2 hours instead of 10 minutes.
2. FSDP2's mixed-precision policy: parameters gathered in bf16 for compute, gradients reduce-scattered in fp32.
   From `mixed_precision: bf16` Accelerate 1.15 builds `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16,
   output_dtype=bf16)` (`FullyShardedDataParallelPlugin.set_mixed_precision`, called from `AcceleratorState`), so
   each gradient would be rounded to bf16's 8 mantissa bits before it is summed over ranks and added to the fp32
   shard. train.py reduce-scatters every micro-batch (about 128 per 14B step) and SFT every accumulation step,
   so those roundings add up; verl's FSDP workers reduce in fp32 by default. A policy set on the plugin is kept by
   Accelerate as it is, which is what `fsdp_plugin` does (`REDUCE_DTYPE`).
3. Trackers: Accelerate drops a `log_with` tracker whose package is not installed with a debug message only, so
   `report_to: tensorboard` without tensorboard would run without its curves. `check_tracker` stops the run first,
   with one line.

Plain `python sft.py` / `train.py` on one process builds the same Accelerator; the policy applies only under an FSDP
launch (`accelerate launch --config_file configs/accelerate/fsdp_*.yaml`, or tests/cpu_fsdp.py on CPU processes).
`is_sharded` and `full` are the two questions both loops ask of FSDP2's DTensors.

4. The end of the process group (`process_group_ends`, around each entry point's work). A process that exits with
   its process group alive leaves gloo's (and NCCL's) C++ worker threads running into interpreter finalization;
   one in a few such exits then dies in `terminate called without an active exception` (SIGABRT, exit code -6)
   after the work is done and saved, which every launcher and scheduler reads as a crash (pytorch/pytorch#190489).
   `Accelerator.end_training` destroys the group on the way out of a finished run; the error paths need it too.
"""
import contextlib
import os
from datetime import timedelta

import torch

PROCESS_GROUP_TIMEOUT_S = 7200  # the configs' default (point 1 above)
REDUCE_DTYPE = torch.float32    # FSDP2 reduce-scatters gradients in this dtype under mixed_precision=bf16
MIXED_PRECISION = {"no": None, "bf16": torch.bfloat16}  # the values the configs accept -> compute dtype


def check_tracker(report_to: str | None) -> None:
    """Stop with one line when `report_to` names a tracker that cannot start here (unknown, or not installed)."""
    if not report_to:
        return
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
    if report_to not in LOGGER_TYPE_TO_CLASS:
        raise SystemExit(f"config error: report_to={report_to!r} is not a tracker Accelerate knows "
                         f"({', '.join(sorted(LOGGER_TYPE_TO_CLASS))}); report_to=null logs to metrics.jsonl only")
    if report_to not in {str(t) for t in get_available_trackers()}:
        hint = "pip install -e '.[tensorboard]'" if report_to == "tensorboard" else f"pip install {report_to}"
        raise SystemExit(f"config error: report_to={report_to} but its package is not installed ({hint}, or "
                         "report_to=null to log to metrics.jsonl only)")


def fsdp_plugin(mixed_precision: str):
    """The FSDP plugin for an FSDP launch (None otherwise): the one Accelerate would build from the launch's FSDP_*
    variables, with gradients reduced in REDUCE_DTYPE when computing in bf16 (FSDP2; FSDP1 keeps Accelerate's)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin
    plugin = FullyShardedDataParallelPlugin()
    compute = MIXED_PRECISION.get(mixed_precision)
    if compute is not None and plugin.fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=REDUCE_DTYPE,
                                                             output_dtype=compute)
    return plugin


def make_accelerator(*, mixed_precision: str, report_to: str | None, out_dir: str, timeout_s: float,
                     gradient_accumulation_steps: int = 1):
    """The Accelerator of an entry point: trackers checked, the process group's timeout, the FSDP2 policy. On a
    machine without a GPU it runs on the CPU (cpu=True: the only way Accelerate sets up gloo across CPU processes)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    check_tracker(report_to)
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision,
                       gradient_accumulation_steps=gradient_accumulation_steps, log_with=report_to or None,
                       project_dir=out_dir, fsdp_plugin=fsdp_plugin(mixed_precision),
                       kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))])


def end_process_group(failed: bool = False) -> None:
    """Destroy the default process group if one is up (a no-op otherwise, and after `Accelerator.end_training`).
    On an error path (`failed`) an NCCL group is aborted instead: a graceful destroy waits for work that a dead or
    stuck peer may never finish; and nothing raised here hides the error that brought the rank out."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if failed and dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 (a group broken by a peer's failure; the process ends anyway)
        if not failed:
            raise


@contextlib.contextmanager
def process_group_ends():
    """Around an entry point's work: the process group it starts is ended on every way out, returns, errors and
    SystemExit alike (point 4 above)."""
    try:
        yield
    except SystemExit as e:
        end_process_group(failed=e.code not in (None, 0))
        raise
    except BaseException:
        end_process_group(failed=True)
        raise
    end_process_group()


def mixed_precision_policy(model) -> dict[str, tuple]:
    """{module name: (param_dtype, reduce_dtype)} of each FSDP2 parameter group of a prepared model ({} without
    FSDP2): what the sharded modules really use, read from torch's FSDP state (no public getter; torch 2.11-2.13)."""
    from torch.distributed.fsdp import FSDPModule
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            for group in filter(None, groups):
                out[name or "(root)"] = (group.mp_policy.param_dtype, group.mp_policy.reduce_dtype)
    return out


def reshard(model) -> None:
    """Free the gathered (unsharded) parameters of every FSDP2 group of a prepared model; a no-op without FSDP2.

    Why: Accelerate 1.15 shards the root module and the group holding the final norm and lm_head (with the
    embedding when tied) with reshard_after_forward=False (`fsdp2_prepare_model`, accelerate/utils/fsdp_utils.py),
    so that the backward need not gather them again. torch's `FSDPParamGroup.reshard` returns early for such a group
    after its forward (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py); only the post-backward frees it.
    A no-grad forward (handoff.verify_handoff's) has no backward, so those groups would stay gathered in bf16 through
    the whole rollout (1.6 GB for Qwen3-14B's lm_head). `FSDPModule.reshard` frees them; the next forward gathers
    them again."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gathered_parameters(model) -> dict[str, int]:
    """{name: bytes} of the parameters of a prepared FSDP2 model that this rank holds gathered (unsharded) now: the
    ones registered as plain tensors rather than as their DTensor shards ({} without FSDP2)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return {}
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters()
            if not isinstance(p, DTensor)}


def defer_replica_all_reduce(model, deferred: bool) -> None:
    """Under HSDP (FSDP2 on a 2-D mesh: shards within a node, replicas across nodes), a micro-batch's gradient is
    reduce-scattered within the node and then all-reduced across the replicas. deferred=True keeps each reduced
    shard in FSDP2's partial buffer (a shard's size, in the reduce dtype) without the cross-node all-reduce; the
    next micro-batch's shard is added to it, and the first backward with deferred=False all-reduces the sum once
    (FSDPModule.set_requires_all_reduce; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
    `foreach_reduce`). Without replicas there is no such all-reduce: a no-op, as it is without FSDP2."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_all_reduce(not deferred, recurse=False)


def is_sharded(model) -> bool:
    """True when FSDP has split the model's parameters over ranks (DTensors): no rank holds the whole model."""
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in model.parameters())


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor that FSDP may hand back as a DTensor (the gradient norm)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---------------------------------------------------------------- collectives over ranks (no-ops on one process)
def all_sum(accelerator, values: list[float]) -> list[float]:
    """Sum a list of numbers over ranks (a no-op on one process)."""
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(t)
    return t.tolist()


def reduce_sums(accelerator, sums: dict) -> dict:
    """{name: (sum, count)} from every rank -> {name: global sum / global count} (NaN where the count is 0)."""
    flat = all_sum(accelerator, [x for pair in sums.values() for x in pair])
    return {k: (flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else float("nan")) for i, k in enumerate(sums)}


def all_max(accelerator, values: list[float]) -> list[float]:
    """The element-wise largest of a list of numbers over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def all_gather(accelerator, obj) -> list:
    """Every rank's `obj`, in rank order (pickled; [obj] on one process)."""
    if accelerator.num_processes == 1:
        return [obj]
    out = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(out, obj)
    return out


def all_gather_rows(accelerator, rows: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's (n_r, k) tensor of numbers, in rank order, on the CPU; n_r may differ between ranks (one gather
    of the counts, one of the rows padded to the longest). [rows] on one process."""
    if accelerator.num_processes == 1:
        return [rows]
    world, device = accelerator.num_processes, accelerator.device
    count = torch.tensor([rows.shape[0]], device=device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    torch.distributed.all_gather(counts, count)
    counts = [int(c) for c in counts]
    if not max(counts):
        return [rows[:0].cpu() for _ in range(world)]
    padded = torch.zeros((max(counts), rows.shape[1]), dtype=rows.dtype, device=device)
    padded[:rows.shape[0]] = rows.to(device)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded)
    return [p[:c].cpu() for p, c in zip(parts, counts)]
