"""Samplers: the policy's text generation behind one small interface, on transformers (CPU) or vLLM (GPU or CPU).

The rollout (`rollout.py`, report §2) only needs token ids in and token ids out, one request per turn:

    sampler.add(key, prompt_ids, max_new_tokens, temperature, top_p)   queue a request
    sampler.step() -> [(key, Completion), ...]                         advance; the requests that finished
    sampler.has_work() -> bool                                          anything queued or running
    sampler.kv_room() -> int | None                                     optional: room to start more now
    sampler.generate(prompts, max_new_tokens, temperature, top_p)      all at once (eval, tests) -> [Completion]
    sampler.update_weights(model)                                       load the trainer's new policy
    sampler.score(token_ids) -> [float]                                 log-probs of a fixed sequence (hand-off check)

`add`/`step` is continuous batching: a conversation whose tool result is back joins the batch on the next step,
while the others keep generating (the report's asynchronous tool dispatch, §3, on one engine).
- `prompt_ids`: the whole conversation so far, as token ids (never re-tokenized text).
- `max_new_tokens`: the request's budget (the rollout's remaining response budget).
- A request stops after `<|im_end|>` (or the model's own end-of-text id); the stop id is kept in `token_ids`.
- `Completion.logprobs[t]` = log softmax(logits_t / temperature)[token_t], the log-probability of each sampled token
  under the temperature-scaled distribution (the trainer's old_logp check). top-p truncation is NOT folded into it
  (with top_p < 1 the HF value ignores the truncation; vLLM's `processed_logprobs` includes it). The report samples
  with top_p = 1, where the two agree. temperature = 0 means greedy decoding, with log-probs at temperature 1.
- `update_weights(model)` loads the trainer's new policy weights (an nn.Module with HF parameter names, or an
  iterable of (name, tensor)), between rollouts; `partial=True`: the pairs are only the weights that changed (LoRA's
  merged layers, plumbing/lora.py), the others keep what the sampler holds. A sampler that may lose its weights
  between rollouts (VLLMSampler asleep at level 2) says so with `missing_weights`, and then gets every weight.
- `score(token_ids)` = log softmax(logits)[token] of tokens 1..T-1, temperature 1, computed the way the sampler
  generates (its weights, its dtype, its cached keys and values). After each update the trainer compares it with
  its own forward pass (plumbing/handoff.py): a sampler still generating from old weights is caught, not trained on.

Three implementations, in samplers/:
- `ReferenceSampler` (samplers/reference.py): transformers' `model.generate`, one request at a time; the contract
  above in about thirty lines, for reading and for checking the others against.
- `HFSampler` (samplers/hf.py): a transformers causal LM driven by our own decode loop (slots, an in-place KV
  cache, the keys and values of earlier turns reused), for the tiny CPU pipeline. It may share the trainer's model
  object (colocated): then `update_weights` has no weights to copy, only stale keys and values to drop.
- `VLLMSampler` (samplers/vllm_engine.py): `vllm.LLM` in this process, colocated with the trainer; on GPUs its
  sleep mode frees the memory for the update. Runs on vLLM's CPU build too. vLLM is imported only there.
`TurnSampler` gives `add`/`step` to anything that has only `generate` (each step generates everything queued).

Across ranks, schedule.py hands each engine a few of the step's rollouts at a time as it frees up (the report's
scheduler, §3.2); the engine packs its own KV cache. Under `claim_rule: free_kv` a rank claims while its engine's
`kv_room()` is above 0 (vLLM: free KV-cache tokens, 0 while a request waits; HFSampler: free slots); a sampler
without it, or returning None, stops the run at start-up with one line (schedule.check_kv_room): `claim_rule:
count` claims by the count of unfinished rollouts instead.
"""
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
            top_p: float = 1.0, seed: int | None = None) -> None: ...  # seed: this request's own random numbers

    def step(self) -> list[tuple[object, Completion]]: ...  # advance; the requests that finished, with their keys

    def has_work(self) -> bool: ...  # requests queued or running

    def kv_room(self) -> int | None: ...  # optional: > 0 while it can start one more request now; None: cannot say

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[Completion]: ...  # add all, step until done (`generate_all`)

    def update_weights(self, model, partial: bool = False) -> None: ...  # between rollouts; partial: changed only

    def score(self, token_ids: list[int]) -> list[float]: ...  # (T-1) log-probs, temperature 1

    dtype: torch.dtype  # what the sampler computes in: with the trainer's, picks the hand-off check's tolerance


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

    def add(self, key, prompt, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        self._pending().append((key, prompt, max_new_tokens, temperature, top_p, seed))

    def has_work(self):
        return bool(self._pending())

    def step(self):
        queue, self._queue = self._pending(), []
        done = []
        for params in dict.fromkeys(q[3:5] for q in queue):
            batch = [q for q in queue if q[3:5] == params]
            self.call_seeds = [q[5] for q in batch]  # each request's seed, for a generate that draws per request
            completions = self.generate([q[1] for q in batch], [q[2] for q in batch], *params)
            done += [(q[0], c) for q, c in zip(batch, completions)]
        return done

    def _pending(self) -> list:
        return vars(self).setdefault("_queue", [])  # a mixin: the class's own __init__ does not create it


def stop_token_ids(tokenizer, model_eos=None) -> list[int]:
    """<|im_end|> first, then the model's own end-of-text ids (a base model may end a turn with those)."""
    ids = [tokenizer.convert_tokens_to_ids(IM_END)]
    extra = model_eos if isinstance(model_eos, (list, tuple)) else [model_eos]
    return ids + [i for i in extra if i is not None and i not in ids]
