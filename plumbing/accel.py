"""The Accelerator that sft.py, train.py and eval.py build, and what a run over many processes depends on that
Accelerate leaves to the caller: timeouts, precision, the group's start and end, waiting for the slowest rank.

1. The process-group timeout (`process_group_timeout_s` in the three entry points): how long one collective may
   wait before it fails (torch's default for NCCL is 10 minutes, after which its watchdog stops the rank). The
   long, uneven wait of a step, fast ranks waiting for the slowest one's rollouts, is not a collective: it is
   `Peers.wait` (point 5). What is left are waits for work that every rank does alike: the hand-off's gathers, the
   update's all-gathers and reduce-scatters, and the checkpoint and model writes, the longest of them. Writing a 14B
   checkpoint (sharded: the fp32 masters and AdamW's two moments, 168 GB over the ranks) and the gathered model
   (30-60 GB, from one rank) takes minutes; the default, 30 minutes, leaves several times that, and a rank that
   hangs inside a collective stops the run after 30 minutes instead of 2 hours.
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

4. The end of the process group and of the process (`process_group_ends` around each entry point's work, and
   `run_and_exit` around its command line). torch's backward stashes a copy of the Python context (contextvars) in
   thread-local state while it runs (`_engine_run_backward`, torch/autograd/graph.py, torch 2.13), and every gloo
   collective issued inside a backward (DDP's bucket all-reduces, FSDP2's reduce-scatters) keeps a copy of that
   state. Gloo's worker thread often holds the last reference to a finished collective, and releasing it then needs
   the GIL. If that thread asks for the GIL while the interpreter is shutting down, Python ends it with pthread_exit,
   whose unwinding reaches a destructor that may not throw: `terminate called without an active exception`,
   SIGABRT (exit code -6), after the work is done and saved, which every launcher and scheduler reads as a crash
   (pytorch/pytorch#190489). Destroying the group narrows the window (it waits for the group's pending work) but
   does not close it: gloo's worker threads live until the last reference to the group goes, which Accelerate's and
   FSDP2's state keep (a destroyed group's threads were still running at exit on 2 CPU processes), and on a loaded
   machine a worker can reach the GIL only after the interpreter has begun to shut down. So an entry point ends
   the group on every way out, errors included, and then ends the process as Python would (threading's exit hooks
   run, which stop idle thread pools, non-daemon threads joined, atexit handlers run, standard streams flushed, the
   same exit status) but without the interpreter's shutdown, which is the only time this abort can happen.
   tests/late_release.py makes it happen on every run. On an error path the vLLM engine is left unclosed
   (`end_sampler`): its shutdown would end the group gracefully before the group's own end could abort it.
5. Waiting for the slowest rank with a heartbeat (`Peers`). While a rank rolls out, it adds to a counter of its
   own in the process group's store (the TCP store torchrun and `accelerate launch` run, which outlives a worker)
   after its engine steps, at most once a second. A rank that has finished says so in the store and polls the
   others; one whose counter has not moved for `peer_timeout_s` (600 s by default: a healthy engine finishes a
   step, and a tool call ends, well within it) is named in one line, and every rank still alive exits non-zero, so
   that the launcher (`torchrun --max_restarts N`) restarts the group from the last checkpoint. A stopped process,
   a hung engine and a dead node all read the same: NCCL itself would not notice a vanished peer. A rank that has
   not reached the phase yet (still in the step before's checkpoint) is progressing while its watchdog (point 7)
   beats; once there, only its engine's steps count. Keys carry the
   launch's identity (a token rank 0 draws when the group starts, so a restarted group never reads an earlier
   attempt's claims) and the step; a step's keys are deleted once every rank is past the step's first collective.
6. A restarted group (`torchrun --max_restarts N`). torchrun's agent keeps one store for the whole launch under its
   static rendezvous, and torch's env:// set-up hands it to the workers as it is (torch 2.13,
   `torch/distributed/rendezvous.py`: "a new TCPStore for every retry", which the static rendezvous does not make).
   A restarted worker then reads the dead attempt's addresses and fails ("Gloo connectFullMesh failed ... Connection
   refused"). `start_process_group` sets up the group first, on that store under a prefix of the attempt, with
   torch's default backend for the machine's accelerator (NCCL for CUDA, gloo without one); Accelerate then uses the
   group it finds. The attempt is agreed through the store (`agree_attempt`), not read from
   TORCHELASTIC_RESTART_COUNT: each node's agent counts its own restarts, and a node whose worker failed before the
   group formed is restarted alone (its count runs ahead of the others'). Every rank of an attempt arrives within `init_timeout_s` (600 s by default,
   a setting of its own: a node that is slow to start loads its model later, not the group) or each one there stops
   with one line naming the ranks missing, instead of waiting a collective's 30 minutes in the group's set-up.
7. One watchdog for the whole step (`Peers.watch`). A rank blocked in a collective (the score gather, the update's
   reduce-scatters, the hand-off's gathers, a checkpoint's barriers) cannot check anything itself, so every rank runs
   a daemon thread that adds to a counter of its own in the store every poll (a tenth of `peer_timeout_s`, at most a
   second) and reads every peer's; the main thread records the phase it enters (`Peers.phase`: rollouts, score
   gather, update, hand-off, metrics, checkpoint, the held-out or benchmark evaluation; SFT's steps) in the store.
   Progress here is the process running: a stopped (SIGSTOP) or dead process's threads stop with it, and a node that
   vanishes stops its counters; a rank that is slow but runs (a long rollout, a long checkpoint write, a long tool
   call) keeps beating, whatever its main thread is doing. A peer whose counter has not moved for `peer_timeout_s` is
   named in one line with the step and phase it was last seen in; the first rank to see it writes that in the store,
   so every live rank says it within a poll, and each ends its process with exit status 1 (os._exit: its main thread
   may never return from the collective), after NCCL's abort where the backend is NCCL. A poll costs the store
   four round trips whatever the number of ranks: every peer's counter is read with one `multi_get`
   (`read_counters`; bench/store_load.py measures it at 64 and 128 ranks). The store is torchrun's
   agent's, not rank 0's, so a stopped rank 0 is named like any other; the watchdog talks to it through a client of
   its own whose operations give up after `peer_timeout_s` (10 s at least), and an agent that is gone stops the rank
   with one line. A rank that ends says so first: normally, and the ranks still finishing do not name it; with an
   error, and every other rank stops at once with one line (a launcher sees only its own node's workers fail). What
   the watchdog cannot see is a process that runs but whose main thread makes no progress outside a wait on peers
   (a hung engine in the rollouts is caught by point 5, which counts the engine's steps); the others' collective
   then waits out `process_group_timeout_s`.
"""
import atexit
import contextlib
import os
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Callable, NoReturn

import torch

PROCESS_GROUP_TIMEOUT_S = 1800  # the configs' default (point 1 above)
PEER_TIMEOUT_S = 600            # a peer silent this long while others wait for it stops the run (point 5 above)
INIT_TIMEOUT_S = 600            # every rank of a (re)started group joins within this, or one line (point 6 above)
FAILED = threading.Event()      # set when this process's work ends with an error: its watchdog tells the peers
REDUCE_DTYPE = torch.float32    # FSDP2 reduce-scatters gradients in this dtype under mixed_precision=bf16
MIXED_PRECISION = {"no": None, "bf16": torch.bfloat16}  # the values the configs accept -> compute dtype
# torch's GPU allocator setting for the trainer (`cuda_allocator_conf`) unless the user gives one under any of the
# names torch 2.13 reads: segments that grow in place, so the update's varying sizes fragment less
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


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


def cuda_allocator_conf() -> None:
    """Set ALLOC_CONF in this process's environment unless one of ALLOC_CONF_NAMES is set; torch reads it when CUDA
    initialises, so this comes first in the trainer's set-up. vLLM turns expandable segments off itself while it
    allocates in its own pools (`CuMemAllocator.use_memory_pool`), which its sleep mode needs."""
    if not any(os.environ.get(name) for name in ALLOC_CONF_NAMES):
        os.environ[ALLOC_CONF[0]] = ALLOC_CONF[1]


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


def start_process_group(timeout_s: float, init_timeout_s: float = INIT_TIMEOUT_S) -> None:
    """Under torchrun's agent store, the default process group on that store under a prefix of the attempt the
    ranks agree on through the store (`agree_attempt`, point 6 above), every rank there within init_timeout_s or one
    line; nothing on one process, under another launcher, or when a group is up."""
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or world <= 1 or dist.is_initialized():
        return
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=init_timeout_s))
    attempt = agree_attempt(store, rank, world, init_timeout_s)
    dist.init_process_group(store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    store.set_timeout(timedelta(seconds=timeout_s))  # the group's later store waits are collectives' waits


def agree_attempt(store, rank: int, world: int, wait_s: float, poll_s: float = 0.2) -> int:
    """The number of this start of the group, agreed through the launch's store rather than read from each node's
    TORCHELASTIC_RESTART_COUNT (each agent counts its own restarts, and a node whose worker failed before joining
    restarts alone). Rank 0 counts its starts in the store; any other rank joins the newest start newer than the
    one it last joined (and moves on to a newer one while it waits). Then every rank of that start arrives within
    wait_s, or each one there stops with one line naming the ranks missing (a node whose launcher did not restart,
    or one that did alone)."""
    newest = lambda: store.add("rstar2/attempt", 0)  # noqa: E731
    if rank == 0:
        attempt = store.add("rstar2/attempt", 1)
    else:
        mine = f"rstar2/attempt/joined/{rank}"
        last = int(store.get(mine)) if store.check([mine]) else 0
        deadline = time.monotonic() + wait_s
        while (attempt := newest()) <= last:
            if time.monotonic() > deadline:
                raise SystemExit(f"process group: rank {rank} restarted, and rank 0 started no new attempt of the "
                                 f"group within {wait_s:g} s (init_timeout_s; its node did not restart: the "
                                 "launchers' restarts are out of step)")
            time.sleep(poll_s)
    deadline = time.monotonic() + wait_s
    while True:
        if rank:
            store.set(f"rstar2/attempt/joined/{rank}", str(attempt))
        store.set(f"rstar2/attempt/{attempt}/{rank}", "1")
        arrived = store.add(f"rstar2/attempt/{attempt}/arrived", 1)
        while arrived < world and not (rank and newest() > attempt):
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not store.check([f"rstar2/attempt/{attempt}/{r}"])]
                raise SystemExit(f"process group: attempt {attempt}: rank(s) {', '.join(map(str, missing))} did "
                                 f"not join within {wait_s:g} s (init_timeout_s; not started, or started for "
                                 f"another attempt); rank {rank} stops")
            time.sleep(poll_s)
            arrived = store.add(f"rstar2/attempt/{attempt}/arrived", 0)
        if arrived >= world:
            return attempt
        attempt = newest()  # rank 0 started again while this rank waited: join its new attempt


def make_accelerator(*, mixed_precision: str, report_to: str | None, out_dir: str, timeout_s: float,
                     gradient_accumulation_steps: int = 1, init_timeout_s: float = INIT_TIMEOUT_S):
    """The Accelerator of an entry point: trackers checked, the process group's timeout, the FSDP2 policy. On a
    machine without a GPU it runs on the CPU (cpu=True: the only way Accelerate sets up gloo across CPU processes)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    check_tracker(report_to)
    start_process_group(timeout_s, init_timeout_s)
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision,
                       gradient_accumulation_steps=gradient_accumulation_steps, log_with=report_to or None,
                       project_dir=out_dir, fsdp_plugin=fsdp_plugin(mixed_precision),
                       kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))])


def runs_nccl() -> bool:
    """Whether NCCL is among the backends torch set up for the default group (which must be up): its
    `get_backend_config`, "cuda:nccl" for a group started without naming a backend on a GPU machine, as
    `start_process_group` does, and for Accelerate's "nccl" too. `get_backend()` is no answer: it says "undefined"
    for the first (torch 2.13)."""
    import torch.distributed as dist
    return "nccl" in dist.get_backend_config()


def end_process_group(failed: bool = False) -> None:
    """Destroy the default process group if one is up (a no-op otherwise, and after `Accelerator.end_training`).
    On an error path (`failed`) a group with NCCL among its backends (`runs_nccl`) is aborted instead: a graceful
    destroy waits for work that a dead or stuck peer may never finish; and nothing raised here hides the error that
    brought the rank out."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if failed and runs_nccl() and hasattr(dist.distributed_c10d, "_abort_process_group"):
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
        if e.code not in (None, 0):
            FAILED.set()
        end_process_group(failed=e.code not in (None, 0))
        raise
    except BaseException:
        FAILED.set()
        end_process_group(failed=True)
        raise
    end_process_group()


def failing() -> bool:
    """Whether the `finally` calling this runs on an error path: an exception on its way out, other than
    SystemExit(0) or SystemExit(None) (the line `process_group_ends` draws). There the entry points leave vLLM's
    engine unclosed (`end_sampler`): its shutdown destroys the launcher's process group gracefully (vLLM 0.32,
    `cleanup_dist_env_and_memory`), which could wait forever on a failed peer before the group is aborted; the
    engine's GPU memory goes with the process."""
    error = sys.exc_info()[1]
    return error is not None and not (isinstance(error, SystemExit) and error.code in (None, 0))


def end_sampler(sampler) -> None:
    """A sampler's end, in an entry point's `finally`: on a clean way out its `close` (vLLM's engine: after the last
    collective, before the group ends under it); on an error path (`failing`) its `abandon` where it has one
    (vLLM's: the engine's shutdown is dropped from the process's end as well), never its `close`."""
    if not failing():
        if hasattr(sampler, "close"):
            sampler.close()
    elif hasattr(sampler, "abandon"):
        sampler.abandon()


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """An entry point's command line: `main()` with the process group ended on every way out, then the process
    ended without the interpreter's shutdown (point 4 above), with the exit status Python would give: 0, a
    SystemExit's code (its message on stderr and 1 when it is not a number), 1 after an uncaught error's traceback."""
    try:
        with process_group_ends():
            main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # noqa: BLE001 (reported as Python reports it, with its exit status)
        sys.excepthook(type(e), e, e.__traceback__)
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    # the interpreter's first step at exit: threading's exit hooks (concurrent.futures' tells its idle workers to
    # stop, without which a live ThreadPoolExecutor is waited for forever), then every non-daemon thread joined
    threading._shutdown()
    atexit._run_exitfuncs()  # weakref finalizers, logging, the code tool's pool, Accelerate's and the user's own
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


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


def shared_sums(world: int, sums: dict) -> dict:
    """{name: (sum, count)} that every rank computed alike from gathered numbers, scaled so that reduce_sums (which
    adds every rank's) counts them once."""
    return {k: (a / world, b / world) for k, (a, b) in sums.items()}


def reduce_sums(accelerator, sums: dict) -> dict:
    """{name: (sum, count)} from every rank -> {name: global sum / global count} (NaN where the count is 0). The
    sums are matched by position, so the names are checked first to be the same, in the same order, on every rank
    (one small gather): a difference stops every rank with one line naming the names, not a hang or mislabelled
    numbers."""
    check_same_names(all_gather(accelerator, list(sums)))
    flat = all_sum(accelerator, [x for pair in sums.values() for x in pair])
    return {k: (flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else float("nan")) for i, k in enumerate(sums)}


def check_same_names(names: list[list[str]]) -> None:
    """Every rank's metric names (in rank order) are one list, or SystemExit with one line naming the difference."""
    if any(n != names[0] for n in names):
        differ = sorted({k for n in names for k in n} - set.intersection(*(set(n) for n in names)))
        where = {k: [r for r, n in enumerate(names) if k in n] for k in differ}
        raise SystemExit("reduce_sums: the ranks report different metrics: " + (
            "; ".join(f"{k} on rank(s) {rs} only" for k, rs in where.items()) or "the same names in another order"))


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


def gather_to_main(accelerator, obj) -> list | None:
    """Every rank's `obj`, in rank order, on rank 0 only (pickled; None on the others): what one rank writes."""
    if accelerator.num_processes == 1:
        return [obj]
    out = [None] * accelerator.num_processes if accelerator.is_main_process else None
    torch.distributed.gather_object(obj, out, dst=0)
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


# ---------------------------------------------------------------- waiting for the slowest rank (point 5 above)
class Peers:
    """The ranks of this process group as seen through its store: `beat()` while working, `wait(phase)` when done
    until every rank is done, stopping the run when one falls silent for `timeout_s`. `key(name)` names a key of
    the current step (`start(step)`) under the launch's identity. Built by `peers` from the process group; on one
    process there is nothing to wait for and no store."""

    def __init__(self, timeout_s: float, name: str, store=None, rank: int = 0, world: int = 1, launch: str = "",
                 poll_s: float = 1.0):
        self.timeout_s, self.name, self.store, self.rank, self.world = timeout_s, name, store, rank, world
        self.poll_s, self.prefix, self.step, self.last_beat = min(poll_s, timeout_s / 10), f"{name}/{launch}", None, 0.0
        self.at, self.stopping = "set-up", threading.Lock()  # where the main thread is; held by whoever stops the rank
        self.watched = store  # the store the watchdog's keys are in (its own client: `watch`)

    def key(self, what: str, step=None) -> str:
        return f"{self.prefix}/{self.step if step is None else step}/{what}"

    def start(self, step) -> None:
        """A new step (any label: `step`, or ("eval", step)). Rank 0 deletes the previous step's keys: every rank
        has passed a collective since it last read them."""
        if self.store is not None and self.rank == 0 and self.step is not None:
            for what in ["claims"] + [f"{k}/{r}" for k in ("beat", "done") for r in range(self.world)]:
                self.store.delete_key(self.key(what))
        self.step, self.last_beat = step, 0.0

    def beat(self) -> None:
        """Progress made: add to this rank's counter, at most once a second."""
        now = time.monotonic()
        if self.store is not None and now - self.last_beat >= 1.0:
            self.store.add(self.key(f"beat/{self.rank}"), 1)
            self.last_beat = now

    def beating(self, running: int) -> list:
        """rollout()'s `more` for rollouts that claim nothing (held-out evaluation): the heartbeat only."""
        self.beat()
        return []

    def phase(self, what: str, where: str | None = None) -> None:
        """The main thread enters `what` (rollouts, score gather, update, hand-off, checkpoint...) of `where` (the
        current step's label by default): what the watchdog reports when this rank falls silent."""
        self.at = f"{where or self.label()}, {what}"
        if self.store is not None:  # at once: the rank may stop (or be stopped) right after entering it
            self.watched.set(self.watch_key(f"at/{self.rank}"), self.at)

    def wait(self, phase: str) -> None:
        """This rank is done with `phase`; return once every rank is, or stop (SystemExit, one line) when a rank
        not done has not moved its counter for timeout_s, as this rank's clock counts (no clocks are compared)."""
        if self.store is None:
            return
        store = self.store
        store.add(self.key(f"done/{self.rank}"), 1)
        pending, seen = [r for r in range(self.world) if r != self.rank], {}
        while True:
            now = time.monotonic()
            pending = [r for r in pending if not store.add(self.key(f"done/{r}"), 0)]
            if not pending:
                return
            for r in pending:
                beats = (store.add(self.key(f"beat/{r}"), 0), self.still_before(r))
                if seen.get(r, (None,))[0] != beats:
                    seen[r] = (beats, now)
            silent = [r for r in pending if now - seen[r][1] > self.timeout_s]
            if silent and self.stopping.acquire(blocking=False):  # else the watchdog is stopping this rank
                with contextlib.suppress(Exception):
                    self.watched.set(self.watch_key("stop"), f"{self.label()}, {phase}: rank "
                              f"{', '.join(map(str, silent))}")
                raise SystemExit(f"{self.name}: {self.label()}, {phase}: rank {', '.join(map(str, silent))} made no "
                                 f"progress for {self.timeout_s:g} s (stopped, hung or gone; peer_timeout_s); rank "
                                 f"{self.rank} stops so that the launcher can restart the group from the last "
                                 "checkpoint")
            time.sleep(self.poll_s)

    def still_before(self, r: int):
        """While rank r's main thread has not reached this rank's phase (a long checkpoint write of the step before,
        say), its watchdog's counter (which moves while its process runs); None once it has, or without a watchdog:
        then only its engine's beats count."""
        at = self.watch_key(f"at/{r}")
        if not self.watched.check([at]) or self.watched.get(at).decode() == self.at:
            return None
        return self.watched.add(self.watch_key(f"alive/{r}"), 0)

    def label(self) -> str:
        return f"step {self.step + 1}" if isinstance(self.step, int) else str(self.step)

    # ------------------------------------------------------------ the watchdog (point 7 above)
    def watch_key(self, what: str) -> str:
        return f"{self.prefix}/watch/{what}"

    def watch(self, store=None, abort: Callable[[], None] | None = None) -> None:
        """Start this rank's watchdog: a daemon thread that beats into the store (through `store`, a client of its
        own, or the group's) and stops the process when a peer's beats stop for timeout_s (`watchdog`). A rank
        that ends (atexit) says so first, so that the ranks still finishing do not name it; one that ends with an
        error (`FAILED`) stops the others at once, as its launcher may be alone in seeing it (another node's)."""
        if self.store is None:
            return
        store = self.watched = store or self.store
        closed = threading.Event()
        store.set(self.watch_key(f"at/{self.rank}"), self.at)

        def close():
            closed.set()
            with contextlib.suppress(Exception):
                store.set(self.watch_key(f"gone/{self.rank}"), "error" if FAILED.is_set() else "done")
                if FAILED.is_set():
                    store.add(self.watch_key("errors"), 1)
        atexit.register(close)
        threading.Thread(target=watchdog, args=(self, store, closed, abort or (lambda: None)), daemon=True,
                         name=f"{self.name}-watchdog").start()

    def stop(self, line: str, abort: Callable[[], None]) -> NoReturn:
        """End this process from the watchdog thread (the main thread may be blocked in a collective): `line` on
        stderr, a grace of a few polls so that the other live ranks say theirs before the launcher ends them,
        the group aborted where the backend can be (given a few seconds), exit status 1."""
        print(line, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        time.sleep(min(3 * self.poll_s, 3.0))
        ender = threading.Thread(target=abort, daemon=True)
        ender.start()
        ender.join(5.0)
        os._exit(1)


def watchdog(peers: Peers, store, closed: threading.Event, abort: Callable[[], None]) -> None:
    """The loop of a rank's watchdog thread (point 7 above): add to this rank's counter every poll; read every
    peer's, and when one that has not ended has not moved for timeout_s (as this rank's clock counts), another rank
    has already stopped the group, or a peer's work ended with an error, stop this process with one line naming the
    rank and where it was last seen."""
    key, me, seen = peers.watch_key, peers.rank, {}
    others = [r for r in range(peers.world) if r != me]
    alive, polls = [key(f"alive/{r}") for r in others], 0
    try:
        while not closed.is_set():
            store.add(key(f"alive/{me}"), 1)
            now = time.monotonic()
            stopped = store.check([key("stop")])
            failed = [r for r in others if store.check([key(f"gone/{r}")]) and store.get(key(f"gone/{r}")) == b"error"
                      ] if not (stopped or FAILED.is_set()) and store.add(key("errors"), 0) else []
            if stopped:
                found = f"{store.get(key('stop')).decode()} made no progress for {peers.timeout_s:g} s"
                silent = []
            elif failed:
                found = (f"rank {', '.join(map(str, failed))} ended with an error (its own lines say which), last seen "
                         f"in {store.get(key(f'at/{failed[0]}')).decode()}")
                silent = []
            else:
                for r, beats in zip(others, read_counters(store, alive, exist=polls > 0)):
                    if seen.get(r, (None,))[0] != beats:
                        seen[r] = (beats, now)
                polls += 1
                silent = [r for r in others if now - seen[r][1] > peers.timeout_s
                          and not store.check([key(f"gone/{r}")])]
                if not silent:
                    time.sleep(peers.poll_s)
                    continue
                where = {r: store.get(key(f"at/{r}")).decode() if store.check([key(f"at/{r}")]) else "set-up"
                         for r in silent}
                named = (f"{where[silent[0]]}: rank {silent[0]}" if len(silent) == 1 else
                         "ranks " + ", ".join(f"{r} ({where[r]})" for r in silent))
                found = f"{named} made no progress for {peers.timeout_s:g} s"
            if closed.is_set() or not peers.stopping.acquire(blocking=False):
                return  # the rank is ending, or its main thread is already stopping it
            if silent:
                with contextlib.suppress(Exception):
                    store.set(key("stop"), named)
            why = "" if failed else " (stopped, hung or gone; peer_timeout_s)"
            peers.stop(f"{peers.name}: {found}{why}; rank {me} stops so that the launcher can restart the group "
                       "from the last checkpoint", abort)
    except Exception as e:  # noqa: BLE001 (the store itself is gone: the launcher's agent died)
        if not closed.is_set() and peers.stopping.acquire(blocking=False):
            peers.stop(f"{peers.name}: {peers.at}: rank {me} lost the process group's store ({type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}); it stops", abort)


def read_counters(store, keys: list[str], exist: bool) -> list[int]:
    """The values of the store's counters `keys` (made by `add`): one `multi_get` where they are known to exist,
    one round trip whatever their number (64 ranks: 63 peers a poll); else an `add` of 0 each, which makes a
    missing one at 0 (a peer whose watchdog has not started yet: `multi_get` would wait for it)."""
    if exist:
        return [int(v) for v in store.multi_get(keys)]
    return [store.add(k, 0) for k in keys]


def peers(timeout_s: float, name: str) -> Peers:
    """The Peers of this process's group: its store, rank and size, and a launch token drawn by rank 0 (one
    broadcast, so every rank calls this at the same point); a store-less Peers of one without a group."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Peers(timeout_s, name)
    launch = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(launch, src=0)
    out = Peers(timeout_s, name, dist.distributed_c10d._get_default_store(), dist.get_rank(),
                dist.get_world_size(), launch[0])
    out.watch(watch_store(timeout_s), abort=abort_process_group)
    return out


def watch_store(timeout_s: float):
    """A client of its own on torchrun's agent store for the watchdog thread, whose operations give up after
    timeout_s (the group's client waits as long as a collective may); None (the group's store) elsewhere."""
    import torch.distributed as dist
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=max(timeout_s, 10)))


def abort_process_group() -> None:
    """The watchdog's way out of a group whose collective its main thread is blocked in: NCCL's abort path
    (end_process_group(failed=True)); nothing for gloo, whose peers see the connection close when the process ends
    (a destroy would wait for the blocked collective)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and runs_nccl():
        end_process_group(failed=True)
