"""Samplers: the policy's text generation behind one small interface, on transformers (CPU) or vLLM (GPU or CPU).

The rollout (`rollout.py`, report §2) only needs token ids in and token ids out, one request per turn:

    sampler.add(key, prompt_ids, max_new_tokens, temperature, top_p)   queue a request
    sampler.step() -> [(key, Completion), ...]                         advance; the requests that finished
    sampler.has_work() -> bool                                          anything queued or running
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
  iterable of (name, tensor)), between rollouts.
- `score(token_ids)` = log softmax(logits)[token] of tokens 1..T-1, temperature 1, computed the way the sampler
  generates (its weights, its dtype, its cached keys and values). After each update the trainer compares it with
  its own forward pass (`check_handoff`): a sampler still generating from old weights is caught, not trained on.

Three implementations, in samplers/:
- `ReferenceSampler` (samplers/reference.py): transformers' `model.generate`, one request at a time; the contract
  above in about thirty lines, for reading and for checking the others against.
- `HFSampler` (samplers/hf.py): a transformers causal LM driven by our own decode loop (slots, an in-place KV
  cache, the keys and values of earlier turns reused), for the tiny CPU pipeline. It may share the trainer's model
  object (colocated): then `update_weights` has no weights to copy, only stale keys and values to drop.
- `VLLMSampler` (samplers/vllm_engine.py): `vllm.LLM` in this process, colocated with the trainer; on GPUs its
  sleep mode frees the memory for the update. Runs on vLLM's CPU build too. vLLM is imported only there.
`TurnSampler` gives `add`/`step` to anything that has only `generate` (each step generates everything queued).

Left out: the report's KV-cache-aware balancing of requests across several engines (§3): each rank drives its own.
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
            top_p: float = 1.0) -> None: ...

    def step(self) -> list[tuple[object, Completion]]: ...  # advance; the requests that finished, with their keys

    def has_work(self) -> bool: ...  # requests queued or running

    def generate(self, prompts: list[list[int]], max_new_tokens: list[int], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[Completion]: ...  # add all, step until done (`generate_all`)

    def update_weights(self, model) -> None: ...  # between rollouts

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


def stop_token_ids(tokenizer, model_eos=None) -> list[int]:
    """<|im_end|> first, then the model's own end-of-text ids (a base model may end a turn with those)."""
    ids = [tokenizer.convert_tokens_to_ids(IM_END)]
    extra = model_eos if isinstance(model_eos, (list, tuple)) else [model_eos]
    return ids + [i for i in extra if i is not None and i not in ids]


# ============================================================================ the weight hand-off check
# Largest mean |log-prob gap| between a sampler and the trainer that still counts as "the same weights", by the
# dtype a side computes in (`handoff_tolerance` takes the coarser side's). fp32: only the summation order differs. 16-bit engines round
# weights and activations, so they sit further from an fp32 trainer (bf16 keeps 8 mantissa bits, fp16 11).
# Measured with vLLM's CPU build on the tiny SFT model, 111-121 tokens, against an fp32 transformers forward pass:
# mean gap fp32 8.5e-7, fp16 1.6e-3, bf16 1.4e-2 (largest single token 5.7e-6, 9.1e-3, 9.4e-2). Deeper models
# accumulate more rounding: the 16-bit values leave 7-19x room.
HANDOFF_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 1e-1}


def handoff_tolerance(sampler_dtype: torch.dtype, trainer_dtype: torch.dtype) -> float:
    """The hand-off check's tolerance: that of the coarser of the two compute dtypes. The sampler's is its weights'
    (a bf16 engine); the trainer's is bf16 under mixed_precision=bf16 (autocast, FSDP2's bf16 parameters), whatever
    its fp32 master weights. A stale sampler is still caught at any tolerance: `check_handoff`'s second rule."""
    return max(HANDOFF_TOLERANCE[sampler_dtype], HANDOFF_TOLERANCE[trainer_dtype])
HANDOFF_PROBE_TOKENS = 256  # the check's fixed sequence: the first training prompt, cut to this many tokens


def sequence_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log softmax(logits_t)[token_t+1] for t = 0..T-2 from one forward pass of `model` at temperature 1: (T-1,),
    float32 on the CPU. The model runs in eval mode and gets its training flag back."""
    ids = torch.tensor([token_ids], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()  # (T-1, V)
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).cpu()


def check_handoff(engine, trainer, tolerance: float, previous=None) -> str | None:
    """Does a sampler hold the trainer's weights? Judged from the log-probs of one fixed token sequence.

    engine, trainer: (T-1,) log-probs of tokens 1..T-1, from `sampler.score` and from the trainer's own forward pass
    (`sequence_logprobs`). previous: the (engine, trainer) pair of the last check, or None.
    1. gap = mean_t |engine_t - trainer_t| <= tolerance (`handoff_tolerance` of the two sides' dtypes);
    2. if the trainer's log-probs moved since the last check, the sampler's moved too. A sampler that skipped the
       update returns the same numbers, bit for bit, even where one step moves them by less than the tolerance
       (lr 1e-6 seen through a bf16 engine). This would misfire only for an update that changes no weight at all
       in the sampler's dtype.
    Returns None when both hold, else one line saying which failed."""
    engine = torch.as_tensor(engine, dtype=torch.float64)
    trainer = torch.as_tensor(trainer, dtype=torch.float64)
    if engine.shape != trainer.shape:
        return f"the sampler scored {engine.numel()} tokens, the trainer {trainer.numel()}"
    gap = (engine - trainer).abs().mean().item()
    if not gap <= tolerance:  # a NaN fails too
        return f"the sampler's log-probs differ from the trainer's by {gap:.3g} per token (tolerance {tolerance:g})"
    if previous is not None:
        moved = (trainer - torch.as_tensor(previous[1], dtype=torch.float64)).abs().mean().item()
        if moved > 0 and torch.equal(engine, torch.as_tensor(previous[0], dtype=torch.float64)):
            return (f"the trainer's log-probs moved by {moved:.3g} per token since the last hand-off and the "
                    "sampler's did not change at all: it is still generating from the old weights")
    return None
