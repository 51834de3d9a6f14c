"""ReferenceSampler: the contract of samplers/interface.py on transformers' `model.generate`, one request at a time.

It shows in a few lines what every sampler returns: the sampled ids ending with the stop id, the log-prob of each
after temperature, whether the turn stopped. Slow on purpose (each turn re-reads its whole conversation, requests
never share a forward): HFSampler and VLLMSampler do the same work fast; the tests hold them to this one.
`sampler=reference` in eval.py.
"""
import contextlib

import torch

from samplers.interface import Completion, TurnSampler, stop_token_ids


class ReferenceSampler(TurnSampler):  # TurnSampler: `add` / `step` / `has_work` on top of `generate`
    """model: a transformers causal LM (the trainer's own object, or a copy); tokenizer: where <|im_end|> comes from."""

    def __init__(self, model, tokenizer):
        self.model, self.stops = model, stop_token_ids(tokenizer, model.generation_config.eos_token_id)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0) -> list[Completion]:
        return [self._one(p, n, temperature, top_p) for p, n in zip(prompts, max_new_tokens)]

    def _one(self, prompt: list[int], budget: int, temperature: float, top_p: float) -> Completion:
        # every sampling knob given, so a checkpoint's generation_config.json (Qwen3's top_k=20...) changes nothing
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
            else dict(do_sample=False)  # temperature 0: greedy, log-probs at temperature 1
        ids = torch.tensor([prompt], device=self.model.device)  # (1, T)
        with torch.no_grad(), _eval_mode(self.model):
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget,
                                      eos_token_id=self.stops, pad_token_id=self.stops[0],
                                      return_dict_in_generate=True, output_logits=True, **sampling)
        tokens = out.sequences[0, len(prompt):]  # (n,) the stop id kept
        # logprobs[t] = log softmax(logits_t / temperature)[token_t]; the raw logits: top-p not folded in
        logits = torch.cat(out.logits).float() / (temperature if temperature > 0 else 1.0)  # (n, V)
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)  # (n,)
        return Completion(tokens.tolist(), logprobs.tolist(), tokens[-1].item() in self.stops)

    def update_weights(self, model, partial: bool = False) -> None:
        """The trainer's module (nothing to copy when it is our own object) or (name, tensor) pairs (with
        `partial`, only the weights that changed)."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict() if isinstance(model, torch.nn.Module) else dict(model),
                                       strict=not partial)

    def score(self, token_ids: list[int]) -> list[float]:
        """log softmax(logits_t)[token_t+1], t = 0..T-2: one forward at temperature 1."""
        ids = torch.tensor([token_ids], device=self.model.device)  # (1, T)
        with torch.no_grad(), _eval_mode(self.model):
            logits = self.model(input_ids=ids).logits[0, :-1].float()  # (T-1, V)
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()


@contextlib.contextmanager
def _eval_mode(model):
    """Dropout off while sampling; the model's training flag back afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
