"""HFSampler: continuous batching on a transformers causal LM with our own decode loop (the tiny CPU pipeline, or
one GPU for small runs). It implements the interface of samplers/interface.py (`add` / `step` / `has_work` / `generate`,
`update_weights`, `score`); the rollout drives it through that interface (report §2 and §3).

Why not `model.generate`: a rollout calls the sampler once per turn, and `generate` would re-read the whole
conversation each time, keep computing finished rows until the last row of its batch ends, wait for the longest
turn before any tool result can come back, and copy its KV cache at every token. Here instead
- `step` reads new requests into free slots (prefill), then every slot samples one token (one forward);
- a finished request leaves its slot at once, so a returning conversation can take it on the next step;
- a request whose prompt extends a finished one starts from its stored keys and values (`_PrefixStore`, the
  analogue of vLLM's automatic prefix caching), and requests admitted together with the same prompt (a group's
  rollouts) read it once;
- the rows of a prefill are read in a few forwards of similar lengths (`prefill_groups`): a tool response may be
  a number or a traceback, and one forward pads every row to the longest;
- the cache is written in place (`_KVBuffer`).
bench/rollout.py measures it: plain sampling 2.3x transformers `generate`; a multi-turn rollout with tool calls
1.44x `generate` on the same number of sampled tokens.

Left out: paged memory (slots hold whole rows, laid out again when they run out), speculative decoding, and any
kernel beyond what the model's own attention implementation does. Needs a model whose attention calls
`cache.update(k, v, layer_idx)` and accepts a 4-D additive mask (transformers 4.57 and 5.x decoder LMs do); a model
loaded with flash attention, which takes no such mask, decodes here with sdpa (`mask_taking_attention`).
"""
import contextlib
import inspect
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from samplers.interface import Completion, generate_all, stop_token_ids


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


@contextlib.contextmanager
def mask_taking_attention(model):
    """The model's attention set to sdpa for the length of the block when it is a flash kernel: transformers' flash
    path reads a 2-D padding mask or position_ids, not the 4-D mask that gives each slot its own columns here. The
    trainer's own model (colocated) keeps flash for the update."""
    name = getattr(model.config, "_attn_implementation", None)
    if not name or "flash" not in name:
        yield
        return
    model.config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        model.config._attn_implementation = name


def load_named_weights(model: torch.nn.Module, weights, partial: bool = False) -> None:
    """Copy (name, tensor) pairs into `model`'s parameters and persistent buffers in place (cast to their dtype
    and device), consuming one pair at a time. Every weight must arrive (tied weights under either name) unless
    `partial` (the pairs are the weights that changed: LoRA's merged layers); a name the model lacks, or a shape
    that differs (a shard sent instead of the gathered parameter), is an error."""
    targets = model.state_dict(keep_vars=True)  # parameters themselves: tied names share one object
    needed = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers() if n in targets}
    got = set()
    with torch.no_grad():
        for name, tensor in weights:
            own = targets.get(name)
            if own is None:
                raise ValueError(f"weight hand-off: the sampler's model has no weight {name!r}")
            if own.shape != tensor.shape:
                raise ValueError(f"weight hand-off: {name} arrived with shape {tuple(tensor.shape)}, the sampler's "
                                 f"is {tuple(own.shape)} (a shard instead of the gathered parameter?)")
            own.copy_(tensor)
            got.update(n for n, t in targets.items() if t is own)
    if needed - got and not partial:
        raise ValueError(f"weight hand-off: {len(needed - got)} weights never arrived, e.g. {min(needed - got)}")


def _sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
            generators: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (B, V) logits, (B,) temperatures and top-p -> sampled ids (B,) and log softmax(logits / T)[id] (B,).
    T = 0 is greedy, with log-probs at T = 1. top-p keeps the smallest set of most likely tokens holding at least
    top_p of the mass (it is not folded into the log-prob). generators: per row, its own torch.Generator (a seeded
    request: its draws do not depend on the other rows) or None (the global RNG); None: every row global."""
    greedy = temperature <= 0
    logp = torch.log_softmax(logits.float() / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)  # (B, V)
    probs = logp.exp()
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p[sorted_p.cumsum(-1) - sorted_p >= top_p[:, None]] = 0.0  # the mass before it already reaches top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if generators is None or all(g is None for g in generators):
        drawn = torch.multinomial(probs, 1).squeeze(-1)
    else:
        drawn = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
    ids = torch.where(greedy, logp.argmax(-1), drawn)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)


# What one forward costs beyond its tokens, in token rows (rows x new tokens): on the tiny model on a CPU a forward
# costs ~15 ms, a token row ~0.25 ms. `prefill_groups` weighs padding against extra forwards with it.
PREFILL_FORWARD_COST = 64


def prefill_groups(widths: list[int], forward_cost: int) -> list[int]:
    """Cut rows reading widths[i] new tokens (ascending) into consecutive forwards, each padded to its widest row,
    minimising the token rows computed plus forward_cost per forward (dynamic programming over the cut points).
    Returns the end index of each forward's rows, e.g. [3, 5] for rows 0-2 and 3-4."""
    best, cut = [0] + [float("inf")] * len(widths), [0] * (len(widths) + 1)
    for j in range(1, len(widths) + 1):
        for i in range(j):  # rows i..j-1 in one forward, padded to widths[j - 1]
            cost = best[i] + (j - i) * widths[j - 1] + forward_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    ends, j = [], len(widths)
    while j:
        ends.append(j)
        j = cut[j]
    return ends[::-1]


@dataclass
class _Request:
    key: object
    prompt: list[int]
    budget: int
    temperature: float
    top_p: float
    generator: torch.Generator | None = None  # a seeded request's own random numbers
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class HFSampler:
    """Continuous batching on a transformers causal LM, with our own decode loop (CPU, or one GPU for small runs).

    model: a causal LM, possibly the very object the trainer updates (colocated); it is in eval mode while the
    sampler has requests and its training flag is restored when the last one is done (`has_work()` turns False).
    batch_size: requests decoded together (slots).
    stop_ids: ids that end a request (default: <|im_end|> and the model's EOS; [] = run every budget out).
    prefix_cache_rows: finished requests whose keys and values are kept for a later prompt that extends them
    (default 2 x batch_size, the oldest dropped first; 0 = off). Memory per kept token: layers x 2 x kv_heads x
    head_dim x dtype bytes.

    Live requests fill slots 0..n-1; a finished one leaves at once and the last slot's row moves into the gap.
    Slots share one column counter: a request's tokens end at the current column when it is admitted, and `seen`
    (slots, capacity) marks which columns hold its tokens. The 4-D additive attention mask is built from `seen`,
    with explicit position ids, so gaps between a request's columns are never attended; attention starts at the
    first column any live row uses. When rows or columns run out, the live columns slide left within the buffers
    (new, larger buffers only when they are too small), dropping the dead columns.
    A request added with a seed draws from its own generator, so its tokens do not depend on which others share
    its steps (up to float rounding of the batched forward); without one, sampling draws from the global torch RNG
    and seeded runs repeat exactly only when the caller adds requests in a fixed pattern (rollout(sync_turns=True))."""

    def __init__(self, model, tokenizer, batch_size: int = 64, stop_ids: list[int] | None = None,
                 prefix_cache_rows: int | None = None, kv_dtype: torch.dtype | None = None):
        self.model, self.tokenizer, self.batch_size, self.kv_dtype = model, tokenizer, batch_size, kv_dtype
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
        self._was_training = False  # the model was in training mode when the running requests began

    def add(self, key, prompt, max_new_tokens, temperature=1.0, top_p=1.0, seed=None) -> None:
        assert len(prompt) >= 1 and max_new_tokens >= 1
        generator = None if seed is None else torch.Generator(self.device).manual_seed(seed)
        self.queue.append(_Request(key, list(prompt), max_new_tokens, temperature, top_p, generator))

    def has_work(self) -> bool:
        return bool(self.queue or self.live)

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        return generate_all(self, prompts, max_new_tokens, temperature, top_p)

    def kv_room(self) -> int:
        """Requests this sampler can start now: its free slots (rows of the KV buffers) less the queued requests
        (schedule.free_kv_rule)."""
        return max(0, self.batch_size - len(self.live) - len(self.queue))

    def step(self) -> list[tuple[object, Completion]]:
        # Eval mode while requests run, the training flag back once none is left: `train()` and `eval()` walk every
        # module (about 2 ms for the tiny model, a fifth of a decode step), too much to pay twice per token.
        if self.model.training:
            self.model.eval()
            self._was_training = True
        try:
            with torch.inference_mode():
                done = self._admit() if self.queue and len(self.live) < self.batch_size else []
                done += self._decode() if self.live else []
        except BaseException:
            self._restore_mode()
            raise
        if not self.has_work():
            self._restore_mode()
        return done

    def _restore_mode(self) -> None:
        if self._was_training:
            self.model.train()
            self._was_training = False

    def _admit(self) -> list[tuple[object, Completion]]:
        """Move queued requests (up to the free slots) into slots and read their new tokens: a stored prefix is
        copied in, the new tokens end at the current column; then each samples its first token.
        - Requests with the same prompt (a group's 2G rollouts, an evaluation's k samples) read it once: the first
          one's row is computed, the others get copies of its keys, values and logits (the slots after it).
        - The rows are sorted by how many new tokens they read and cut into a few forwards (`prefill_groups`),
          each padded only to its own longest row: tool responses range from a number to a traceback."""
        reqs = [self.queue.popleft() for _ in range(min(len(self.queue), self.batch_size - len(self.live)))]
        first = {}  # prompt -> the first request with it
        for r in reqs:
            first.setdefault(tuple(r.prompt), r)
        unique = list(first.values())
        copies = [r for r in reqs if first[tuple(r.prompt)] is not r]
        reused = [self.prefixes.take(r.prompt) for r in unique]  # (cached length, kv) per computed request
        order = sorted(range(len(unique)), key=lambda j: len(unique[j].prompt) - reused[j][0])
        unique, reused = [unique[j] for j in order], [reused[j] for j in order]
        reqs = unique + copies
        new = [r.prompt[n:] for r, (n, _) in zip(unique, reused)]
        new_w, cached_w = len(new[-1]), max(n for n, _ in reused)
        lo, mid, hi = len(self.live), len(self.live) + len(unique), len(self.live) + len(reqs)
        self._make_room(hi, new_w + cached_w, max(r.budget - len(r.tokens) for r in self.live + reqs))
        end = self.kv.length
        self.seen[lo:hi] = False
        for slot, req in enumerate(reqs, start=lo):
            self.next_pos[slot], self.temps[slot], self.top_ps[slot] = len(req.prompt), req.temperature, req.top_p
        logits, a = [], 0
        for b in prefill_groups([len(t) for t in new], PREFILL_FORWARD_COST):
            logits.append(self._prefill(lo + a, reused[a:b], new[a:b], end))
            a = b
        logits, kv = torch.cat(logits), self.kv
        kv.length = end
        if copies:
            index = {id(r): j for j, r in enumerate(unique)}
            source = torch.tensor([index[id(first[tuple(r.prompt)])] for r in copies], device=self.device)
            columns = slice(end - new_w - cached_w, end)
            for k, v in zip(kv.k, kv.v):
                k[mid:hi, :, columns], v[mid:hi, :, columns] = k[lo + source, :, columns], v[lo + source, :, columns]
            self.seen[mid:hi] = self.seen[lo + source]
            logits = torch.cat([logits, logits[source]])
        self.live += reqs
        return self._sample_and_retire(logits, lo, hi)

    def _prefill(self, lo: int, reused: list, tails: list[list[int]], end: int) -> torch.Tensor:
        """One forward reading `tails` into slots lo, lo+1, ...: each row's new tokens end at column `end`
        (right-aligned to the longest), its stored prefix (reused: (length, kv)) just before the longest's start.
        Returns the logits of each row's last token."""
        kv, width, hi = self.kv, max(map(len, tails)), lo + len(tails)
        start = end - width
        ids = torch.full((len(tails), width), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(tails), width), dtype=torch.long)
        for j, ((n, cached), tail) in enumerate(zip(reused, tails)):
            slot = lo + j
            for layer, (k, v) in enumerate(cached or []):  # the stored prefix ends where the new part may begin
                kv.k[layer][slot, :, start - n:start], kv.v[layer][slot, :, start - n:start] = k, v
            ids[j, width - len(tail):] = torch.tensor(tail)
            pos[j, width - len(tail):] = torch.arange(n, n + len(tail))
            self.seen[slot, start - n:start] = self.seen[slot, end - len(tail):end] = True
        kv.rows, kv.length, kv.first = slice(lo, hi), start, self._first_column(lo, hi)
        return self._forward(ids.to(self.device), pos.to(self.device), self.seen[lo:hi], kv)

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
        sampled, logp = _sample(logits, self.temps[lo:hi], self.top_ps[lo:hi], [r.generator for r in self.live[lo:hi]])
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
        if kv is not None and not self.live:
            kv.length = before  # nothing live: every column is free, so the counter may start anywhere
        if kv is not None:
            first = self._first_column(0, len(self.live))
            if rows <= self.seen.shape[0] and before <= kv.length and kv.length + after <= kv.capacity:
                return
        n = len(self.live)
        keep = 0 if kv is None else kv.length - first  # live columns, copied over
        length = max(before, keep) + max(before, keep) // 4  # spare room: later prompts are longer
        if kv is not None and rows <= self.seen.shape[0] and length + after <= kv.capacity:
            # The buffers are large enough: slide the live columns [first, length) to [length' - keep, length')
            # in place (zeroing fresh buffers cost more than the rollout's sampling). Columns outside a row's
            # `seen` keep old but finite values, which the mask hides.
            for t in kv.k + kv.v:
                t[:n, :, length - keep:length] = t[:n, :, first:kv.length].clone()
            moved = self.seen[:n, first:kv.length].clone()
            self.seen[:n] = False
            self.seen[:n, length - keep:length] = moved
            kv.length = length
            return
        new = self._buffers(min(self.batch_size, max(rows, 2 * n)), length + 2 * after, length)
        slots = new.k[0].shape[0]
        seen = torch.zeros(slots, new.capacity, dtype=torch.bool, device=self.device)
        per_slot = [torch.zeros(slots, dtype=torch.long, device=self.device) for _ in range(2)] + \
            [torch.ones(slots, device=self.device) for _ in range(2)]  # feed, next_pos, temps, top_ps
        if n:  # the live rows' columns [first, length) move to [length' - keep, length')
            for old_t, new_t in zip(kv.k + kv.v, new.k + new.v):
                new_t[:n, :, length - keep:length] = old_t[:n, :, first:kv.length]
            seen[:n, length - keep:length] = self.seen[:n, first:kv.length]
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
        dtype = self.kv_dtype or next(self.model.parameters()).dtype
        keys = [torch.zeros(rows, heads, capacity, dim, dtype=dtype, device=self.device)
                for _ in range(c.num_hidden_layers)]
        return _KVBuffer(keys, [torch.zeros_like(k) for k in keys], length)

    def _forward(self, ids, pos, seen, cache, every_token: bool = False) -> torch.Tensor:
        """One forward of (rows, q) new tokens at columns [cache.length, cache.length + q), attending to columns
        from cache.first; the logits of each row's last token (rows, V), or of every new token (rows, q, V)."""
        q, end = ids.shape[1], cache.length + ids.shape[1]
        columns = torch.arange(cache.first, end, device=ids.device)
        queries = cache.length + torch.arange(q, device=ids.device)
        allowed = seen[:, None, cache.first:end] & (columns[None, :] <= queries[:, None])[None]  # (rows, q, columns)
        dtype = cache.k[0].dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(~allowed,
                                                                                      torch.finfo(dtype).min)
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw and not every_token:
            kwargs[self._keep_kw] = 1
        with mask_taking_attention(self.model):
            logits = self.model(input_ids=ids, position_ids=pos, attention_mask=mask[:, None], **kwargs).logits
        return logits if every_token else logits[:, -1]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def sleep(self) -> None:
        """Before the update (train.py): free the slot buffers and the stored prefixes, which hold every rollout's
        keys and values (on SmolLM2-135M, 128 rollouts' take gigabytes), so that the update's activations do not
        stack on them; the next rollout allocates them again (zeroing them costs about a second there)."""
        assert not self.has_work(), "sleep between rollouts, not during one"
        self.prefixes.clear()
        self.kv = self.seen = None

    def update_weights(self, model, partial: bool = False) -> None:
        """`model`: the trainer's module, or (name, tensor) pairs (the gathered weights of a sharded trainer,
        streamed; with `partial`, only the weights that changed). Colocated (the trainer's own model object):
        nothing to copy. Otherwise copy the weights in.
        Either way the stored keys and values were computed with the old weights: they are dropped. On an
        accelerator the slot buffers are freed too (allocated again by the next rollout); on the CPU they are kept
        here (train.py frees them before the update with `sleep`)."""
        assert not self.has_work(), "update_weights between rollouts, not during one"
        self.prefixes.clear()
        if self.device.type != "cpu":
            self.kv = self.seen = None
        if model is not self.model:
            load_named_weights(self.model, model.state_dict().items() if isinstance(model, torch.nn.Module)
                               else model, partial)

    def score(self, token_ids: list[int]) -> list[float]:
        """log softmax(logits)[token] of tokens 1..T-1 at temperature 1, through the decode path of `step`: the
        same masked forward, and the prefix store. The first half's keys and values come from the store when it
        holds them (as a later turn's would), else they are computed and stored there: stored keys and values that
        outlived a weight update show up as a gap in the second half's log-probs."""
        assert len(token_ids) >= 2 and not self.has_work(), "score between rollouts"
        T, half = len(token_ids), len(token_ids) // 2
        ids = torch.tensor([token_ids], device=self.device)
        kv = self._buffers(1, T, 0)
        seen = torch.ones(1, T, dtype=torch.bool, device=self.device)
        stored = self.prefixes.entries.pop(tuple(token_ids[:half]), None)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                head = self._forward(ids[:, :half], torch.arange(half, device=self.device)[None], seen, kv, True)
                for layer, (k, v) in enumerate(stored or []):  # what a rollout would reuse
                    kv.k[layer][0, :, :half], kv.v[layer][0, :, :half] = k, v
                kv.length = half
                tail = self._forward(ids[:, half:], torch.arange(half, T, device=self.device)[None], seen, kv,
                                     True)
        finally:
            self.model.train(was_training)
        self.prefixes.put(token_ids[:half], kv.row(0, torch.arange(half, device=self.device)))
        logp = torch.log_softmax(torch.cat([head[0], tail[0]])[:-1].float(), -1)  # (T-1, V)
        return logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
