"""A scripted policy for trainer tests: a sampler whose answers we control, on top of the real model.

The trainer's mechanics (RoC, advantages, the update, hand-off, checkpoints, data parallelism) need groups with
mixed rewards; a randomly initialised tiny model never answers correctly, so every group would be dropped and
nothing would be tested. This sampler writes the turns itself (correct for some rollouts of a group, wrong for the
others, some through a real tool call) while the trainer computes log-probs and gradients on the real model.

Problems are "Say N." with answer N. Rollout k of a problem (its slot in the step, looked up from the seed train.py
gives each rollout, schedule.rollout_seed, as it is drawn; without one the k-th copy in one generate call) answers
correctly when k is even, with a pattern of period 4, so a rollout behaves the same whichever rank plays it (or,
with use_rng, when the global torch RNG says so: that makes resume tests check RNG restoring).

The sampler keeps its own copy of the model, as an engine does: `update_weights` copies the trainer's weights in
(or skips them with skip_updates=True, a stale engine), and `score` answers from that copy, so train.py's hand-off
check compares two models and can fail. With `logprob_shift` set, each turn comes with that copy's log-probs of its
tokens (after temperature) plus the shift: an engine whose numbers are off by a known amount.
"""
import copy
import re

import torch

import schedule
from samplers.hf import load_named_weights
from protocol import IM_END, format_tool_call
from plumbing.handoff import sequence_logprobs
from samplers.interface import Completion, TurnSampler


SLOT_OF_SEED = {}  # rollout seed -> the rollout's slot in its step, as schedule.rollout_seed hands them out
_rollout_seed = schedule.rollout_seed


def _recorded_rollout_seed(seed: int, step: int, slot: int, turn: int) -> int:
    out = _rollout_seed(seed, step, slot, turn)
    SLOT_OF_SEED[out] = slot
    return out


schedule.rollout_seed = _recorded_rollout_seed


def say_problems(n: int, start: int = 1) -> list[dict]:
    return [{"problem": f"Say {i}.", "answer": str(i)} for i in range(start, start + n)]


class ScriptedSampler(TurnSampler):
    def __init__(self, model, tokenizer, use_rng: bool = False, skip_updates: bool = False,
                 logprob_shift: float | None = None, slots: int | None = None):
        self.model, self.tok, self.use_rng = copy.deepcopy(model), tokenizer, use_rng
        self.skip_updates, self.logprob_shift, self.slots = skip_updates, logprob_shift, slots
        self.dtype = next(model.parameters()).dtype if model is not None else torch.float32  # None: eval only
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)
        self.updates = 0

    def kv_room(self) -> int | None:
        """As samplers/hf.py's: `slots` free less what is queued (claim_rule=free_kv); None without slots."""
        return None if self.slots is None else self.slots - len(self._pending())

    def _turn(self, text: str, copy: int) -> str:
        copy %= 4
        n = int(re.findall(r"Say (\d+)\.", text)[0])
        correct = bool(torch.rand(1).item() < 0.5) if self.use_rng else copy % 2 == 0
        if "<tool_response>" in text:  # second turn: answer from the tool's output (right, unless the RNG says no)
            return f"</reason>\n<answer>\\boxed{{{n if correct or not self.use_rng else n + 1}}}</answer>"
        if copy % 4 == 1:  # some rollouts use the tool first
            return "Use Python.</reason>\n" + format_tool_call(f"print({n})")
        filler = "" if correct else "Hmm. " * copy  # lengths differ, so token normalisation matters
        return f"{filler}</reason>\n<answer>\\boxed{{{n if correct else n + 1}}}</answer>"

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        seen, out = {}, []
        seeds = getattr(self, "call_seeds", None) or [None] * len(prompts)
        for ids, budget, seed in zip(prompts, max_new_tokens, seeds):
            text = self.tok.decode(ids)
            key = re.findall(r"Say (\d+)\.", text)[0]
            copy = seen[key] = seen.get(key, -1) + 1
            if seed is not None:  # a seeded rollout: its index in the step (schedule.rollout_seed), whoever plays it
                copy = SLOT_OF_SEED[seed]
            turn = self.tok.encode(self._turn(text, copy), add_special_tokens=False) + [self.im_end]
            logprobs = None if self.logprob_shift is None else self._logprobs(ids, turn[:budget], temperature)
            out.append(Completion(turn[:budget], logprobs, len(turn) <= budget))
        return out

    def _logprobs(self, prompt, tokens, temperature) -> list[float]:
        """log softmax(logits / T)[token] of each turn token under this sampler's model, plus logprob_shift."""
        with torch.no_grad():
            logits = self.model(torch.tensor([list(prompt) + tokens])).logits[0, len(prompt) - 1:-1]
        logp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        return (logp + self.logprob_shift).tolist()

    def update_weights(self, model, partial: bool = False) -> None:
        """The trainer's module, or gathered (name, tensor) pairs (a sharded trainer; LoRA's merged layers when
        partial), copied into this sampler's own model; skip_updates leaves it as it was (a stale engine)."""
        if not self.skip_updates:
            load_named_weights(self.model, model.state_dict().items() if isinstance(model, torch.nn.Module)
                               else model, partial)
        self.updates += 1

    def score(self, token_ids):
        return sequence_logprobs(self.model, token_ids).tolist()


def weights_sum(model) -> float:
    """sum over parameters of sum(p), in float64: equal on two ranks that hold the same weights."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))
