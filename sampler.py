"""Samplers: the policy's text generation behind one small interface, on transformers (CPU) or vLLM (GPU).

The rollout (`rollout.py`, report section 2) only needs token ids in and token ids out:

    sampler.generate(prompts, max_new_tokens, temperature, top_p) -> list[Completion]

- `prompts`: one token-id list per sequence (the whole conversation so far; never re-tokenized text).
- `max_new_tokens`: one budget per sequence (the rollout's remaining response budget).
- A sequence stops after `<|im_end|>` (or the model's own end-of-text id); the stop id is kept in `token_ids`.
- `Completion.logprobs[t]` = log softmax(logits_t / temperature)[token_t], the log-probability of each sampled token
  under the temperature-scaled distribution (the trainer's old_logp check). top-p truncation is NOT folded into it
  (with top_p < 1 the HF value ignores the truncation; vLLM's `processed_logprobs` includes it). The report samples
  with top_p = 1, where the two agree. temperature = 0 means greedy decoding, with log-probs at temperature 1.
- `update_weights(model)` loads the trainer's new policy weights; `weights_checksum()` returns `model_checksum` of
  the weights the sampler will use, so the trainer can check after each update that it equals its own.

Two implementations:
- `HFSampler`: transformers `generate` with the KV cache, left-padded batches, for the tiny CPU pipeline. It may
  share the trainer's model object (colocated): then `update_weights` has nothing to copy. Sampling draws from the
  global torch RNG: seed it with `torch.manual_seed` in the caller for reproducible rollouts.
- `VLLMSampler`: `vllm.LLM` for GPUs, colocated with the trainer via sleep mode. UNTESTED ON REAL HARDWARE (vLLM
  cannot be installed on the development machine); tests drive it with a fake engine of the same shape. vLLM is
  imported lazily, so this module loads without it. Nothing here is NVIDIA-specific (vLLM's sleep mode supports
  CUDA and ROCm).

Left out: streaming / per-request asynchronous generation (the report's scheduler, section 8): a call returns when
every sequence of the batch has finished.
"""
import os
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from protocol import IM_END


@dataclass
class Completion:
    """One sampled continuation."""
    token_ids: list[int]  # as sampled, ending with the stop id when `stopped`
    logprobs: list[float] | None  # log-prob of each sampled token after temperature; None if not available
    stopped: bool  # True: hit <|im_end|> (or the model's end-of-text); False: ran out of max_new_tokens


class Sampler(Protocol):
    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[Completion]: ...

    def update_weights(self, model) -> None: ...

    def weights_checksum(self) -> float: ...


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


def _cut(ids: list[int], logprobs: list[float] | None, budget: int, stops: list[int]) -> Completion:
    """Keep tokens up to the first stop id (inclusive) and at most `budget` tokens."""
    ids = ids[:budget]
    end = next((t + 1 for t, i in enumerate(ids) if i in stops), None)
    if end is not None:
        ids = ids[:end]
    return Completion(ids, None if logprobs is None else logprobs[:len(ids)], end is not None)


class _Regroup(StoppingCriteria):
    """Per row: done once it sampled a stop id or used its own budget. When at most `below` of the rows are still
    running, every row is reported done, so `generate` returns and the caller continues the rest in a new batch."""

    def __init__(self, width: int, budgets: list[int], stops: list[int], below: float, device):
        self.width, self.below = width, below
        self.budgets = torch.tensor(budgets, device=device)
        self.stops = torch.tensor(stops, dtype=torch.long, device=device)
        self.finished = torch.zeros(len(budgets), dtype=torch.bool, device=device)

    def __call__(self, input_ids, scores, **kwargs):
        self.finished |= torch.isin(input_ids[:, -1], self.stops)  # (B,)
        self.finished |= input_ids.shape[1] - self.width >= self.budgets
        if (~self.finished).sum() <= self.below * len(self.finished):
            return torch.ones_like(self.finished)
        return self.finished.clone()


class HFSampler:
    """Batched sampling with transformers `generate` (KV cache, left padding, attention mask).

    model: a causal LM, possibly the very object the trainer updates (colocated). The model is put in eval mode
    during generation and its training flag restored afterwards. batch_size: sequences per `generate` call.
    stop_ids: ids that end a sequence (default: <|im_end|> and the model's EOS; [] = run every budget out).

    Stragglers: `generate` keeps computing every row of its batch until the last one finishes, so one long sequence
    makes a whole batch pay for its length. When at most `regroup_below` of a batch is still running, the call
    stops and the unfinished sequences continue in a fresh, smaller batch (their context re-read in one prefill,
    which on the CPU costs about 1/20 of decoding the same tokens).
    Memory note: `generate` keeps every step's logits (B, T, V) to give log-probs: fine for the tiny model,
    not for a 150K-vocabulary model with long responses (use VLLMSampler there)."""

    def __init__(self, model, tokenizer, batch_size: int = 64, stop_ids: list[int] | None = None,
                 regroup_below: float = 0.25):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stops = stop_token_ids(tokenizer, model.generation_config.eos_token_id) if stop_ids is None \
            else list(stop_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stops[0]
        self.regroup_below = regroup_below

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        assert len(prompts) == len(max_new_tokens) and min(max_new_tokens, default=1) >= 1
        done = [Completion([], [], False) for _ in prompts]
        todo = list(range(len(prompts)))
        was_training = self.model.training
        self.model.eval()
        try:
            while todo:  # each pass continues the sequences a regroup left unfinished
                todo.sort(key=lambda i: len(prompts[i]) + len(done[i].token_ids))  # similar lengths: less padding
                for s in range(0, len(todo), self.batch_size):
                    idx = todo[s:s + self.batch_size]
                    parts = self._generate_batch([prompts[i] + done[i].token_ids for i in idx],
                                                 [max_new_tokens[i] - len(done[i].token_ids) for i in idx],
                                                 temperature, top_p)
                    for i, part in zip(idx, parts):
                        done[i] = Completion(done[i].token_ids + part.token_ids, done[i].logprobs + part.logprobs,
                                             part.stopped)
                todo = [i for i in todo if not done[i].stopped and len(done[i].token_ids) < max_new_tokens[i]]
        finally:
            self.model.train(was_training)
        return done

    def _generate_batch(self, prompts, budgets, temperature, top_p):
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: the last prompt token sits at the same column
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention_mask[row, width - len(p):] = 1
        config = GenerationConfig(
            do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_p=top_p,
            max_new_tokens=max(budgets), eos_token_id=self.stops, pad_token_id=self.pad_id,
            return_dict_in_generate=True, output_logits=True,
            # Neutral values, so nothing from the checkpoint's generation_config.json (Qwen ships top_k=20,
            # repetition_penalty=1.05, ...) silently changes the sampling distribution.
            top_k=0, min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
            no_repeat_ngram_size=0, min_new_tokens=0, num_beams=1, num_return_sequences=1)
        regroup = _Regroup(width, budgets, self.stops, self.regroup_below, device)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                      generation_config=config, stopping_criteria=StoppingCriteriaList([regroup]))
        new = out.sequences[:, width:]  # (B, T)
        scale = temperature if temperature > 0 else 1.0
        # logp_t = log softmax(logits_t / temperature)[sampled token], one step at a time (B, V) -> (B,)
        logp = torch.stack([torch.log_softmax(step.float() / scale, dim=-1).gather(-1, new[:, t:t + 1]).squeeze(-1)
                            for t, step in enumerate(out.logits)], dim=1)  # (B, T)
        return [_cut(new[r].tolist(), logp[r].tolist(), budgets[r], self.stops) for r in range(len(prompts))]

    def update_weights(self, model) -> None:
        """Colocated (the trainer's own model object): nothing to copy. Otherwise copy the state dict in."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())

    def weights_checksum(self) -> float:
        return model_checksum(self.model)


class VLLMSampler:
    """Sampling with `vllm.LLM`, colocated with the trainer on the same GPUs (UNTESTED ON REAL HARDWARE).

    Prompts go in as token ids ({"prompt_token_ids": ids}); each request has its own `max_tokens`; stops at
    <|im_end|> via `stop_token_ids` (the model's own EOS also stops, as in HFSampler); `logprobs=0` returns the
    sampled token's log-prob, with the engine built with `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) so
    it is taken after temperature, as this module's contract says (the default "raw_logprobs" is before it).

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
        self.sleeping: set[str] = set()  # parts of the engine put to sleep: {'weights', 'kv_cache'}

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        from vllm import SamplingParams
        assert len(prompts) == len(max_new_tokens) and min(max_new_tokens, default=1) >= 1
        self.wake_up()
        params = [SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=m, logprobs=0,
                                 stop_token_ids=[self.im_end_id], skip_special_tokens=False, detokenize=False)
                  for m in max_new_tokens]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [_vllm_completion(o.outputs[0]) for o in outputs]

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
