"""Samplers: the policy's text generation behind one small interface, on transformers (CPU) or vLLM (GPU).

The rollout (`rollout.py`, report section 2) only needs token ids in and token ids out, one request per turn:

    sampler.add(key, prompt_ids, max_new_tokens, temperature, top_p)   queue a request
    sampler.step() -> [(key, Completion), ...]                         advance; the requests that finished
    sampler.has_work() -> bool                                          anything queued or running
    sampler.generate(prompts, max_new_tokens, temperature, top_p)      all at once (eval, tests) -> [Completion]

`add`/`step` is continuous batching: a conversation whose tool result is back joins the batch on the next step,
while the others keep generating (the report's asynchronous tool dispatch, section 8, on one engine).
- `prompt_ids`: the whole conversation so far, as token ids (never re-tokenized text).
- `max_new_tokens`: the request's budget (the rollout's remaining response budget).
- A request stops after `<|im_end|>` (or the model's own end-of-text id); the stop id is kept in `token_ids`.
- `Completion.logprobs[t]` = log softmax(logits_t / temperature)[token_t], the log-probability of each sampled token
  under the temperature-scaled distribution (the trainer's old_logp check). top-p truncation is NOT folded into it
  (with top_p < 1 the HF value ignores the truncation; vLLM's `processed_logprobs` includes it). The report samples
  with top_p = 1, where the two agree. temperature = 0 means greedy decoding, with log-probs at temperature 1.
- `update_weights(model)` loads the trainer's new policy weights; `weights_checksum()` returns `model_checksum` of
  the weights the sampler will use, so the trainer can check after each update that it equals its own.

Two implementations:
- `HFSampler` (hf_sampler.py): a transformers causal LM driven by our own decode loop (slots, an in-place KV
  cache, the keys and values of earlier turns reused), for the tiny CPU pipeline. It may share the trainer's model
  object (colocated): then `update_weights` has nothing to copy.
- `VLLMSampler`: `vllm.LLM` for GPUs, colocated with the trainer via sleep mode. UNTESTED ON REAL HARDWARE (vLLM
  cannot be installed on the development machine); tests drive it with a fake engine of the same shape. vLLM is
  imported lazily, so this module loads without it. Nothing here is NVIDIA-specific (vLLM's sleep mode supports
  CUDA and ROCm).
`TurnSampler` gives `add`/`step` to anything that has only `generate` (each step generates everything queued).

Left out: the report's KV-cache-aware balancing of requests across several engines (section 8): each rank drives
its own engine.
"""
import itertools
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from protocol import IM_END


@dataclass
class Completion:
    """One sampled continuation."""
    token_ids: list[int]  # as sampled, ending with the stop id when `stopped`
    logprobs: list[float] | None  # log-prob of each sampled token after temperature; None if not available
    stopped: bool  # True: hit <|im_end|> (or the model's end-of-text); False: ran out of max_new_tokens


class Sampler(Protocol):
    """Requests go in with `add` and come out, finished, from `step`: a rollout can hand a conversation back the
    moment its tool result arrives, while the others keep generating (continuous batching)."""

    def add(self, key, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
            top_p: float = 1.0) -> None: ...

    def step(self) -> list[tuple[object, Completion]]: ...  # advance; the requests that finished, with their keys

    def has_work(self) -> bool: ...  # requests queued or running

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[Completion]: ...  # add all, step until done (`generate_all`)

    def update_weights(self, model) -> None: ...

    def weights_checksum(self) -> float: ...


def generate_all(sampler, prompts, max_new_tokens, temperature=1.0, top_p=1.0) -> list[Completion]:
    """One completion per prompt, in order, through `add` and `step` (the shortest prompts are added first)."""
    assert len(prompts) == len(max_new_tokens) and not sampler.has_work()
    for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
        sampler.add(i, prompts[i], max_new_tokens[i], temperature, top_p)
    out: list[Completion | None] = [None] * len(prompts)
    while sampler.has_work():
        for i, completion in sampler.step():
            out[i] = completion
    return out


class TurnSampler:
    """For a sampler that only has `generate` (scripted test policies, simple wrappers): `step` generates every
    queued request in one `generate` call per (temperature, top_p)."""

    def add(self, key, prompt, max_new_tokens, temperature=1.0, top_p=1.0):
        self._pending().append((key, prompt, max_new_tokens, temperature, top_p))

    def has_work(self):
        return bool(self._pending())

    def step(self):
        queue, self._queue = self._pending(), []
        done = []
        for params in dict.fromkeys((t, p) for *_, t, p in queue):
            batch = [q for q in queue if q[3:] == params]
            completions = self.generate([q[1] for q in batch], [q[2] for q in batch], *params)
            done += [(q[0], c) for q, c in zip(batch, completions)]
        return done

    def _pending(self) -> list:
        return vars(self).setdefault("_queue", [])  # a mixin: the class's own __init__ does not create it


def model_checksum(model: torch.nn.Module) -> float:
    """A cheap fingerprint of a model's weights: sum over parameters of sum(p) + sum(p^2), in float64.

    Order-free on purpose, so it is the same when an engine fuses tensors (vLLM's qkv_proj = q, k, v stacked) and
    counts tied embeddings once (as `parameters()` does). Exact between two copies in the same dtype; compare with a
    tolerance across dtypes (fp32 trainer vs bf16 engine)."""
    with torch.no_grad():
        total = sum(p.detach().double().sum() + p.detach().double().square().sum() for p in model.parameters())
    return float(total)


def stop_token_ids(tokenizer, model_eos=None) -> list[int]:
    """<|im_end|> first, then the model's own end-of-text ids (a base model may end a turn with those)."""
    ids = [tokenizer.convert_tokens_to_ids(IM_END)]
    extra = model_eos if isinstance(model_eos, (list, tuple)) else [model_eos]
    return ids + [i for i in extra if i is not None and i not in ids]


class VLLMSampler:
    """Sampling with `vllm.LLM`, colocated with the trainer on the same GPUs (UNTESTED ON REAL HARDWARE).

    Prompts go in as token ids ({"prompt_token_ids": ids}); each request has its own `max_tokens`; stops at
    <|im_end|> via `stop_token_ids` (the model's own EOS also stops, as in HFSampler); `logprobs=0` returns the
    sampled token's log-prob, with the engine built with `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) so
    it is taken after temperature, as this module's contract says (the default "raw_logprobs" is before it).
    `generate` is `LLM.generate`; `add` / `step` go to the engine underneath (`LLM.llm_engine.add_request` and
    `.step`, vLLM's documented offline engine API), so a rollout hands a conversation back the moment its tool
    result arrives; vLLM's own prefix caching then skips re-reading the earlier turns.

    Memory sharing: `sleep()` (level 1: weights to CPU, KV cache dropped) after a rollout frees the GPU for the
    update; `update_weights` wakes the weights, loads the new ones in place, clears the prefix cache and wakes the
    KV cache. Weights are loaded through `LLM.apply_model`, which needs the model in this process: when this class
    builds the engine it sets VLLM_ENABLE_V1_MULTIPROCESSING=0 (unless already set). `weights_checksum` is exact
    only with tensor_parallel_size=1 (with TP each worker holds a shard and the shard sums are added up).

    tokenizer (or im_end_id): where the <|im_end|> id comes from (default: the engine's tokenizer).
    llm: an engine object to use instead of building one (tests pass a fake)."""

    def __init__(self, model_path: str | None = None, tokenizer=None, *, im_end_id: int | None = None, llm=None,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16",
                 seed: int = 0, enable_sleep_mode: bool = True, max_model_len: int | None = None, **llm_kwargs):
        if llm is None:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model runs in this process
            from vllm import LLM
            llm = LLM(model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                      gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                      max_model_len=max_model_len, logprobs_mode="processed_logprobs", **llm_kwargs)
        if im_end_id is None:  # from the given tokenizer, else the engine's own
            im_end_id = (tokenizer or llm.get_tokenizer()).convert_tokens_to_ids(IM_END)
        self.llm, self.im_end_id = llm, im_end_id
        self.keys: dict[str, object] = {}  # engine request id -> the caller's key, for requests added and not done
        self._ids = itertools.count()
        self.sleeping: set[str] = set()  # parts of the engine put to sleep: {'weights', 'kv_cache'}

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        assert len(prompts) == len(max_new_tokens) and min(max_new_tokens, default=1) >= 1
        self.wake_up()
        params = [self._params(m, temperature, top_p) for m in max_new_tokens]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [_vllm_completion(o.outputs[0]) for o in outputs]

    def add(self, key, prompt, max_new_tokens, temperature=1.0, top_p=1.0) -> None:
        """Queue one request on the engine (`LLMEngine.add_request`); vLLM batches it with the running ones."""
        assert max_new_tokens >= 1
        self.wake_up()
        request_id = str(next(self._ids))
        self.keys[request_id] = key
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(prompt)},
                                        self._params(max_new_tokens, temperature, top_p))

    def step(self) -> list[tuple[object, Completion]]:
        """One engine step (`LLMEngine.step`); the requests it finished."""
        return [(self.keys.pop(o.request_id), _vllm_completion(o.outputs[0]))
                for o in self.llm.llm_engine.step() if o.finished]

    def has_work(self) -> bool:
        return bool(self.keys)

    def _params(self, max_new_tokens: int, temperature: float, top_p: float):
        from vllm import SamplingParams
        return SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0,
                              stop_token_ids=[self.im_end_id], skip_special_tokens=False, detokenize=False)

    def sleep(self) -> None:
        """Free the GPU for training: weights to CPU memory, KV cache discarded (sleep level 1)."""
        if not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        """Wake the given parts (vLLM's wake_up tags), skipping parts already awake."""
        todo = [t for t in tags if t in self.sleeping]
        if todo:
            self.llm.wake_up(tags=todo)
            self.sleeping -= set(todo)

    def update_weights(self, model) -> None:
        """Load new policy weights: `model` is an nn.Module (HF parameter names) or an iterable of (name, tensor)."""
        weights = list((model.state_dict() if isinstance(model, torch.nn.Module) else dict(model)).items())
        self.wake_up(tags=["weights"])  # the KV cache wakes only after the load: lower peak memory
        self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.wake_up(tags=["kv_cache"])

    def weights_checksum(self) -> float:
        self.wake_up(tags=["weights"])
        return float(sum(self.llm.apply_model(model_checksum)))


def _vllm_completion(out) -> Completion:
    """vLLM CompletionOutput -> Completion. out.logprobs: one {token_id: Logprob} dict per sampled token."""
    ids = list(out.token_ids)
    logprobs = None if out.logprobs is None else [step[t].logprob for t, step in zip(ids, out.logprobs)]
    return Completion(ids, logprobs, out.finish_reason == "stop")
