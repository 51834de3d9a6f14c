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
- `HFSampler`: a transformers causal LM driven by our own decode loop (slots, an in-place KV cache, the keys and
  values of earlier turns reused), for the tiny CPU pipeline. It may share the trainer's model object
  (colocated): then `update_weights` has nothing to copy.
- `VLLMSampler`: `vllm.LLM` for GPUs, colocated with the trainer via sleep mode. UNTESTED ON REAL HARDWARE (vLLM
  cannot be installed on the development machine); tests drive it with a fake engine of the same shape. vLLM is
  imported lazily, so this module loads without it. Nothing here is NVIDIA-specific (vLLM's sleep mode supports
  CUDA and ROCm).
`TurnSampler` gives `add`/`step` to anything that has only `generate` (each step generates everything queued).

Left out: the report's KV-cache-aware balancing of requests across several engines (section 8): each rank drives
its own engine.
"""
import inspect
import itertools
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache

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


class _KVBuffer(DynamicCache):
    """Keys and values written in place into preallocated buffers, (slots, kv_heads, capacity, head_dim) per layer.
    transformers' DynamicCache appends with torch.cat, which copies the whole cache at every token: 70% of a decode
    step at 700 tokens of context on the tiny model (torch.profiler). A forward runs on the slots in `rows` (a
    slice), writes its new tokens at columns [length, length + q) and attends to columns [first, length + q); the
    caller sets these three."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int):
        super().__init__()
        self.k, self.v, self.length, self.rows, self.first = keys, values, length, slice(None), 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        k, v = self.k[layer_idx][self.rows], self.v[layer_idx][self.rows]
        k[:, :, self.length:end], v[:, :, self.length:end] = key_states, value_states
        return k[:, :, self.first:end], v[:, :, self.first:end]  # columns left of `first` hold nothing of these rows

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def row(self, slot: int, columns: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One slot's keys and values at the given columns: per layer (kv_heads, len(columns), head_dim) copies."""
        return [(k[slot][:, columns], v[slot][:, columns]) for k, v in zip(self.k, self.v)]


class _PrefixStore:
    """Keys and values of finished requests, so a later request whose prompt extends one re-reads only the new
    tokens. A multi-turn rollout's next prompt is the last prompt + its completion + the tool response: without
    this, every turn would re-read its whole history (vLLM's automatic prefix caching does the same on GPUs).
    Entries: token tuple -> per layer (k, v), each (kv_heads, n, head_dim). An entry is used once (taken out); the
    oldest is dropped beyond `max_rows`; `clear` on new weights."""

    def __init__(self, max_rows: int):
        self.max_rows, self.entries = max_rows, {}

    def put(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.max_rows > 0:
            self.entries[tuple(tokens)] = kv
            while len(self.entries) > self.max_rows:
                del self.entries[next(iter(self.entries))]

    def take(self, prompt: list[int]) -> tuple[int, list | None]:
        """The longest stored sequence that is a proper prefix of `prompt`: (its length, its kv), or (0, None)."""
        best = max((key for key in self.entries if len(key) < len(prompt) and prompt[len(key) - 1] == key[-1]
                    and tuple(prompt[:len(key)]) == key), key=len, default=None)  # (last token first: cheap)
        return (0, None) if best is None else (len(best), self.entries.pop(best))

    def clear(self) -> None:
        self.entries.clear()


def _sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (B, V) logits, (B,) temperatures and top-p -> sampled ids (B,) and log softmax(logits / T)[id] (B,).
    T = 0 is greedy, with log-probs at T = 1. top-p keeps the smallest set of most likely tokens holding at least
    top_p of the mass (it is not folded into the log-prob)."""
    greedy = temperature <= 0
    logp = torch.log_softmax(logits.float() / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)  # (B, V)
    probs = logp.exp()
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p[sorted_p.cumsum(-1) - sorted_p >= top_p[:, None]] = 0.0  # the mass before it already reaches top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    ids = torch.where(greedy, logp.argmax(-1), torch.multinomial(probs, 1).squeeze(-1))
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


@dataclass
class _Request:
    key: object
    prompt: list[int]
    budget: int
    temperature: float
    top_p: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class HFSampler:
    """Continuous batching on a transformers causal LM, with our own decode loop (CPU, or one GPU for small runs).

    model: a causal LM, possibly the very object the trainer updates (colocated); it is in eval mode during each
    step and its training flag is restored afterwards. batch_size: requests decoded together (slots).
    stop_ids: ids that end a request (default: <|im_end|> and the model's EOS; [] = run every budget out).
    prefix_cache_rows: finished requests whose keys and values are kept for a later prompt that extends them
    (default 2 x batch_size, the oldest dropped first; 0 = off). Memory per kept token: layers x 2 x kv_heads x
    head_dim x dtype bytes.

    Why not `model.generate`: a rollout calls the sampler once per turn, and `generate` would re-read the whole
    conversation each time, keep computing finished rows until the last row of its batch ends, wait for the
    longest turn before any tool result can come back, and copy its KV cache at every token. Here instead
    - `step` is one forward: new requests are read (prefill) into free slots, then every slot samples one token;
    - a finished request leaves its slot at once (the last slot's row moves in), so a returning conversation can
      take it on the next step while the others go on;
    - a request whose prompt extends a finished one starts from its stored keys and values (`_PrefixStore`);
    - the cache is written in place (`_KVBuffer`).
    Slots share one column counter: a request's tokens end at the current column when it is admitted, and `seen`
    (slots, capacity) marks which columns hold its tokens. The 4-D additive attention mask is built from `seen`,
    with explicit position ids, so gaps between a request's columns are never attended; attention starts at the
    first column any live row uses. When rows or columns run out, the buffers are laid out again without the dead
    columns.
    Sampling draws from the global torch RNG; which requests share a step depends on when tool results come back,
    so seeded runs repeat exactly only when the caller adds requests in a fixed pattern (rollout(sync_turns=True))."""

    def __init__(self, model, tokenizer, batch_size: int = 64, stop_ids: list[int] | None = None,
                 prefix_cache_rows: int | None = None):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stops = stop_token_ids(tokenizer, model.generation_config.eos_token_id) if stop_ids is None \
            else list(stop_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stops[0]
        self.prefixes = _PrefixStore(2 * batch_size if prefix_cache_rows is None else prefix_cache_rows)
        params = inspect.signature(model.forward).parameters  # keyword names moved between transformers versions
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.queue: deque[_Request] = deque()
        self.live: list[_Request] = []  # the request in each slot 0..len(live)-1
        self.kv: _KVBuffer | None = None
        self.seen = self.feed = self.next_pos = self.temps = self.top_ps = None  # per slot, see _make_room

    def add(self, key, prompt, max_new_tokens, temperature=1.0, top_p=1.0) -> None:
        assert len(prompt) >= 1 and max_new_tokens >= 1
        self.queue.append(_Request(key, list(prompt), max_new_tokens, temperature, top_p))

    def has_work(self) -> bool:
        return bool(self.queue or self.live)

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        return generate_all(self, prompts, max_new_tokens, temperature, top_p)

    def step(self) -> list[tuple[object, Completion]]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                done = self._admit() if self.queue and len(self.live) < self.batch_size else []
                return done + (self._decode() if self.live else [])
        finally:
            self.model.train(was_training)

    def _admit(self) -> list[tuple[object, Completion]]:
        """Move queued requests (up to the free slots) into slots and read their prompts in one forward: a stored
        prefix is copied in, the new tokens end at the current column; then each samples its first token."""
        reqs = [self.queue.popleft() for _ in range(min(len(self.queue), self.batch_size - len(self.live)))]
        reused = [self.prefixes.take(r.prompt) for r in reqs]  # (cached length, kv) per request
        new = [r.prompt[n:] for r, (n, _) in zip(reqs, reused)]
        new_w, lo, hi = max(map(len, new)), len(self.live), len(self.live) + len(reqs)
        self._make_room(hi, new_w + max(n for n, _ in reused),
                        max(r.budget - len(r.tokens) for r in self.live + reqs))
        kv, end = self.kv, self.kv.length
        start = end - new_w  # the new tokens of the batch: columns [start, end), each row's right-aligned
        ids = torch.full((len(reqs), new_w), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(reqs), new_w), dtype=torch.long)
        self.seen[lo:hi] = False
        for j, (req, (n, cached), tail) in enumerate(zip(reqs, reused, new)):
            slot = lo + j
            for layer, (k, v) in enumerate(cached or []):  # the stored prefix ends where the new part may begin
                kv.k[layer][slot, :, start - n:start], kv.v[layer][slot, :, start - n:start] = k, v
            ids[j, new_w - len(tail):] = torch.tensor(tail)
            pos[j, new_w - len(tail):] = torch.arange(n, n + len(tail))
            self.seen[slot, start - n:start] = self.seen[slot, end - len(tail):end] = True
            self.next_pos[slot], self.temps[slot], self.top_ps[slot] = len(req.prompt), req.temperature, req.top_p
        kv.rows, kv.length, kv.first = slice(lo, hi), start, self._first_column(lo, hi)
        logits = self._forward(ids.to(self.device), pos.to(self.device), self.seen[lo:hi], kv)
        kv.length = end
        self.live += reqs
        return self._sample_and_retire(logits, lo, hi)

    def _decode(self) -> list[tuple[object, Completion]]:
        """Every live slot feeds its last sampled token (at the next column) and samples the next one."""
        n, kv = len(self.live), self.kv
        self.seen[:n, kv.length] = True
        kv.rows, kv.first = slice(0, n), self._first_column(0, n)
        logits = self._forward(self.feed[:n, None], self.next_pos[:n, None], self.seen[:n], kv)
        kv.length += 1
        self.next_pos[:n] += 1
        return self._sample_and_retire(logits, 0, n)

    def _sample_and_retire(self, logits, lo: int, hi: int) -> list[tuple[object, Completion]]:
        """Slots lo..hi-1 sample a token each; finished requests leave (the last slot's row moves into the gap)."""
        sampled, logp = _sample(logits, self.temps[lo:hi], self.top_ps[lo:hi])
        self.feed[lo:hi] = sampled
        finished = [lo + j for j, (req, t, lp) in enumerate(zip(self.live[lo:hi], sampled.tolist(), logp.tolist()))
                    if self._record(req, t, lp)]
        done, kv = [], self.kv
        for slot in reversed(finished):  # highest first, so the row moved in from the end is never a finished one
            done.append(self._finish(self.live[slot], kv.row(slot, self.seen[slot].nonzero().squeeze(-1))))
            last = len(self.live) - 1
            if slot != last:
                for k, v in zip(kv.k, kv.v):
                    k[slot], v[slot] = k[last], v[last]
                for t in (self.seen, self.feed, self.next_pos, self.temps, self.top_ps):
                    t[slot] = t[last]
                self.live[slot] = self.live[last]
            self.live.pop()
        return done[::-1]

    def _first_column(self, lo: int, hi: int) -> int:
        """The first column holding a token of any slot in lo..hi-1: attention starts there."""
        used = self.seen[lo:hi].any(0).nonzero()
        return int(used[0]) if len(used) else self.kv.length

    def _record(self, req: _Request, token: int, logprob: float) -> bool:
        """Append a sampled token; True when the request is finished."""
        req.tokens.append(token)
        req.logprobs.append(logprob)
        return token in self.stops or len(req.tokens) >= req.budget

    def _finish(self, req: _Request, kv) -> tuple[object, Completion]:
        """Store the keys and values of everything the request fed (its prompt and all but its last token)."""
        self.prefixes.put(req.prompt + req.tokens[:-1], kv)
        return req.key, Completion(req.tokens, req.logprobs, req.tokens[-1] in self.stops)

    def _make_room(self, rows: int, before: int, after: int) -> None:
        """Lay the slots out again when they need more rows, `before` columns up to the current one, or `after`
        columns from it; the dead columns (left of every live row) are dropped then."""
        kv = self.kv
        if kv is not None and not self.live and rows <= self.seen.shape[0] and before + after <= kv.capacity:
            kv.length = before  # nothing live: start over in the same buffers
            return
        if kv is not None:
            first = self._first_column(0, len(self.live))
            if rows <= self.seen.shape[0] and before <= kv.length and kv.length + after <= kv.capacity:
                return
        n = len(self.live)
        keep = 0 if kv is None else kv.length - first  # live columns, copied over
        length = max(before, keep) + max(before, keep) // 4  # spare room: later prompts are longer
        new = self._buffers(min(self.batch_size, max(rows, 2 * n)), length + 2 * after, length)
        seen = torch.zeros(new.k[0].shape[0], new.capacity, dtype=torch.bool, device=self.device)
        if n:
            for old_t, new_t in zip(kv.k + kv.v, new.k + new.v):
                new_t[:n, :, length - keep:length] = old_t[:n, :, first:kv.length]
            seen[:n, length - keep:length] = self.seen[:n, first:kv.length]
        slots = seen.shape[0]
        per_slot = [torch.zeros(slots, dtype=torch.long, device=self.device) for _ in range(2)] + \
            [torch.ones(slots, device=self.device) for _ in range(2)]
        if n:
            for old_t, new_t in zip((self.feed, self.next_pos, self.temps, self.top_ps), per_slot):
                new_t[:n] = old_t[:n]
        self.kv, self.seen = new, seen
        self.feed, self.next_pos, self.temps, self.top_ps = per_slot

    @property
    def device(self):
        return next(self.model.parameters()).device

    def _buffers(self, rows: int, capacity: int, length: int) -> _KVBuffer:
        """Zeroed keys and values for `rows` slots and `capacity` columns, `length` of them counted as used."""
        c = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") \
            else self.model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        keys = [torch.zeros(rows, heads, capacity, dim, dtype=dtype, device=self.device)
                for _ in range(c.num_hidden_layers)]
        return _KVBuffer(keys, [torch.zeros_like(k) for k in keys], length)

    def _forward(self, ids, pos, seen, cache) -> torch.Tensor:
        """One forward of (rows, q) new tokens at columns [cache.length, cache.length + q), attending to columns
        from cache.first; the logits of each row's last token."""
        q, end = ids.shape[1], cache.length + ids.shape[1]
        columns = torch.arange(cache.first, end, device=ids.device)
        queries = cache.length + torch.arange(q, device=ids.device)
        allowed = seen[:, None, cache.first:end] & (columns[None, :] <= queries[:, None])[None]  # (rows, q, columns)
        dtype = cache.k[0].dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(~allowed,
                                                                                      torch.finfo(dtype).min)
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw:
            kwargs[self._keep_kw] = 1
        return self.model(input_ids=ids, position_ids=pos, attention_mask=mask[:, None], **kwargs).logits[:, -1]

    def update_weights(self, model) -> None:
        """Colocated (the trainer's own model object): nothing to copy. Otherwise copy the state dict in. Either
        way the stored keys and values were computed with the old weights: they are dropped, and the slot buffers
        are freed for the update."""
        assert not self.has_work(), "update_weights between rollouts, not during one"
        self.prefixes.clear()
        self.kv = self.seen = None  # the slot buffers are allocated again by the next rollout
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
