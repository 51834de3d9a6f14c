"""Non-reasoning SFT: teach the chat and tool-call format before RL, with loss on the assistant's tokens only.

Implements the first training stage of rStar2-Agent, its non-reasoning SFT (report §4): about 222K non-reasoning
examples (function calling, code-as-tool-call, instruction following, chat), 3 epochs, lr 5e-6, 4% linear warm-up
then cosine decay, batch 128 sequences. The report gives no weight decay or clip value for SFT; this file uses the RL stage's grad clip (1.0).

Data: JSONL conversations in the common `messages` format with tool calls (`data.load_conversations`); the tiny task
writes its own (`tiny/task.py`). Each conversation is rendered by `protocol.ChatFormat.render_messages` into
(text, trainable) segments: the prompt with `<|im_start|>assistant\\n<reason>`, each assistant turn (content, tool
call, `<|im_end|>`), each tool-response turn with the re-opened assistant header. Each segment is tokenized on its
own and the ids concatenated, so the boundaries are the ones a rollout has (it appends prompt, sampled turns and
tool turns as separate id lists and never re-tokenizes). Labels are -100 on every non-trainable segment (system,
user, tool responses, inserted headers) and on padding; `build_labels` is the one place that decides it.

Loss normalisation: each micro-batch's loss is the mean next-token cross-entropy over its trained tokens, and an
optimizer step's gradient is that of the sum of its micro-batch means / (batch_size / micro_batch_size). A
micro-batch with few trained tokens weighs each of them more than a long one does (the usual HF Trainer behaviour).
The RL loss (`grpo_roc.policy_loss`) normalises by the token count of the whole step instead; for SFT on
conversations of similar size the difference is small, and the per-micro-batch mean needs no count up front.

Precision: the weights are loaded as fp32 master weights whatever the checkpoint's dtype (Qwen3-Base ships bf16,
where AdamW's steps at lr 5e-6 round away for most weights: one step moved 7.8% of them), in every launch mode;
`mixed_precision: bf16` computes in bf16; model/ is saved in the checkpoint's own dtype (checkpoint.save_model).
`gradient_checkpointing: true` recomputes each layer in the backward instead of keeping its activations.

Global batch: batch_size sequences per optimizer step, W = batch_size / micro_batch_size micro-batches, whatever
the number of processes P (batch_size must divide by micro_batch_size * P). Each epoch's micro-batch order
(`LengthGroupedBatches`, a function of seed and epoch) is cut into windows of W, one per optimizer step, the epoch's
last possibly shorter; rank r collates and trains the window's micro-batches r, r+P, r+2P, ... Each micro-batch's
loss is divided by W / P and DDP/FSDP average the gradient over the ranks, so every step, a partial last window
included, has one process's gradient to float rounding: no sample is repeated to even out the ranks, and a rank
short of micro-batches in a partial window runs fillers that train no token, so all join every collective. Under
DDP the all-reduce waits for the window's last micro-batch; under FSDP2 each micro-batch's gradient is
reduce-scattered at once, so no rank holds a full unsharded gradient (at 14B, skipping the sync would keep ~59 GB
per GPU of them until the window ends). The lr schedule is stepped once per optimizer step. sft/loss averages the
real micro-batches' losses over all ranks. Left out: evaluation during training.

Checkpoints (`plumbing/checkpoint.py`): every `save_every` optimizer steps the run folder gets `checkpoint-{step}` (model,
optimizer, lr schedule, every rank's RNG states) and the data position: the epoch and the windows (optimizer steps)
done in it, which do not depend on the number of processes, so a run checkpointed on P processes continues on any
other number that divides the batch. A run started again in the same folder continues from the newest complete
checkpoint (`resume=auto`, the default): the epoch's micro-batch order is rebuilt from (seed, epoch), the windows
already trained are skipped, and metrics.jsonl is cut back to the checkpoint's step, so the resumed run ends with the
same weights and log as one that never stopped (to float rounding when the number of processes changed). A
checkpoint from before this position format (it counted one rank's micro-batches) is refused. `resume=never`
refuses a folder that already holds a run; `resume=PATH` starts from that checkpoint. A resume whose config or data
differ from the checkpoint's is refused unless the keys are named in `resume_allow_changes`; a folder stopped
before its first checkpoint starts over with its log kept aside (plumbing/checkpoint.py has the rules). A NaN or infinite
loss stops the run before the weights change; model/ is written beside and renamed.

Run:  python sft.py configs/tiny/sft.yaml [key=value ...]
      accelerate launch --num_processes 8 sft.py my_sft.yaml      (data-parallel)
Outputs in out_dir: config.yaml (resolved), metrics.jsonl (one line per logged step), checkpoint-*/ and `latest`
(while it runs, with the fp32 masters; the last `keep_checkpoints` are kept), model/ (model in the input's dtype +
tokenizer, at the end).
"""
import contextlib
import functools
import math
import sys
import time
from pathlib import Path

from plumbing import cpu_threads  # noqa: F401  (first: it sets OpenMP's wait policy, which is read when torch loads)
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from plumbing import accel
from plumbing import attention, lora
from plumbing.checkpoint import begin_run, input_dtype, resume_point, run_identity, save_checkpoint, save_model
from plumbing.config import check_ranges, format_config, parse_cli, save_config
from plumbing.data import check_model_path, load_conversations, load_pretrained
from plumbing.sft_config import RANGES, RESUME_FREE, SFTConfig
from plumbing.sft_run import (interval_row, log_step, make_accelerator, resume, saved_position, stop_unless_finite,
                              window_share)
from protocol import chat_format_of, encode

IGNORE = -100  # label of a token that is not trained (PyTorch cross_entropy's ignore_index)

USAGE = """Non-reasoning SFT (loss on the assistant's tokens only).
  python sft.py [CONFIG.yaml ...] [key=value ...]
  python sft.py configs/tiny/sft.yaml max_steps=100
  accelerate launch --num_processes 8 sft.py configs/qwen3-14b/sft.yaml          # data-parallel"""


# ----------------------------------------------------------------------------------- data (pure)
def build_labels(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and its labels: each (text, trainable) segment is tokenized on its own
    by `protocol.encode` (as a rollout tokenizes what it appends: markup with control tokens, data as ordinary text)
    and concatenated; labels equal the ids on trainable segments (assistant content, tool call, <|im_end|>) and are
    IGNORE (-100) on all others (system, user, tool responses, inserted headers)."""
    ids, labels = [], []
    for text, trainable in segments:
        seg = encode(tokenizer, text)
        ids += seg
        labels += seg if trainable else [IGNORE] * len(seg)
    return ids, labels


def build_examples(tokenizer, conversations, chat, max_seq_len: int) -> tuple[list[tuple[list, list]], int]:
    """(ids, labels) for each conversation no longer than max_seq_len tokens, and the number skipped."""
    examples, skipped = [], 0
    for messages in conversations:
        ids, labels = build_labels(tokenizer, chat.render_messages(messages))
        if len(ids) > max_seq_len:
            skipped += 1
        else:
            examples.append((ids, labels))
    return examples, skipped


def collate(batch: list[tuple[list, list]], pad_id: int) -> dict:
    """Right-pad a list of (ids, labels) to input_ids, labels, attention_mask, each (B, T); padding is not trained."""
    T = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), T), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    for b, (ids, lab) in enumerate(batch):
        input_ids[b, :len(ids)] = torch.tensor(ids)
        labels[b, :len(lab)] = torch.tensor(lab)
        mask[b, :len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def pack(batch: list[tuple[list, list]], pad_id: int, one_row: bool = False) -> dict:
    """The micro-batch's (ids, labels) packed into as few rows as first fit (longest first) allows, each row no
    longer than the longest conversation, instead of a padded row each: fewer rows and less padding for the same
    loss. position_ids restart at 0 for every conversation and there is no attention_mask, so transformers builds a
    block-diagonal causal mask from them (a new block wherever a position does not follow the one before it): no
    conversation attends to another. A conversation's first token is never a target (label IGNORE), as at position
    0 of a padded row; a row's padding is a block of its own, never trained. num_tokens: the conversations' tokens.
    one_row: every conversation in one row, for flash attention (plumbing/attention.py: its kernels keep packed
    sequences apart within a batch of one row only)."""
    T = sum(len(ids) for ids, _ in batch) if one_row else max(len(ids) for ids, _ in batch)
    rows, room = [], []
    for i in sorted(range(len(batch)), key=lambda i: -len(batch[i][0])):
        n = len(batch[i][0])
        r = next((r for r, free in enumerate(room) if free >= n), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(T)
        rows[r].append(i)
        room[r] -= n
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((len(rows), T), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            ids, lab = batch[i]
            input_ids[r, at:at + len(ids)] = torch.tensor(ids)
            labels[r, at + 1:at + len(ids)] = torch.tensor(lab[1:], dtype=torch.long)
            position_ids[r, at:at + len(ids)] = torch.arange(len(ids))
            at += len(ids)
        position_ids[r, at:] = torch.arange(T - at)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "num_tokens": torch.tensor(sum(len(ids) for ids, _ in batch))}


COLLATE = {False: collate, True: pack}  # SFTConfig.packing


class LengthGroupedBatches:
    """Micro-batches of similar length, so less compute goes to padding (the idea of HF's group_by_length).
    Each epoch: shuffle all indices, cut them into windows of `window` micro-batches, sort each window by length,
    cut it into micro-batches, and shuffle the order of all micro-batches. Deterministic for a seed; a new order
    every epoch. A micro-batch then tends to hold one kind of trace; the optimizer step mixes several.
    window=1 is a plain shuffle. The order depends only on (seed, epoch): `set_epoch` rebuilds any epoch's order,
    which is what an exact resume needs; iterating again without it moves on to the next epoch."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, window: int = 32):
        self.lengths, self.batch_size, self.seed, self.window, self.epoch = lengths, batch_size, seed, window, 0

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        order, span, batches = torch.randperm(len(self.lengths), generator=g).tolist(), self.batch_size * self.window, []
        for start in range(0, len(order), span):
            chunk = sorted(order[start:start + span], key=lambda i: self.lengths[i])
            batches += [chunk[j:j + self.batch_size] for j in range(0, len(chunk), self.batch_size)]
        for k in torch.randperm(len(batches), generator=g).tolist():
            yield batches[k]


# ----------------------------------------------------------------------------------- loss and schedule (pure)
def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over trained tokens. logits (B, T, V), labels (B, T) with IGNORE where untrained.
    Position t's logits predict the token at t+1."""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    # loss = sum over trained (b, t) of -log p(x[b, t+1] | x[b, :t+1]) / number of trained tokens
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                            reduction="sum")
    return total / (targets != IGNORE).sum().clamp(min=1)


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay_ratio: float = 1.0) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based): linear warm-up from 1/warmup to 1 over
    `warmup_steps`, then cosine decay 0.5 * (1 + cos(pi * progress)) from 1 to 0 at `total_steps`, over the last
    `decay_ratio` of the steps after warm-up (1.0: all of them; less: the peak lr is held until the decay starts)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, round(decay_ratio * (total_steps - warmup_steps)))
    progress = (step - (total_steps - decay_steps)) / decay_steps
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))


# ----------------------------------------------------------------------------------- steps over the data (pure)
def step_plan(n_micro: int, cfg: SFTConfig) -> tuple[int, int, int]:
    """(steps_per_epoch, total_steps, warmup_steps) for an epoch of `n_micro` micro-batches: one optimizer step per
    window of batch_size / micro_batch_size micro-batches (the epoch's last window may be partial). None of it
    depends on the number of processes."""
    steps_per_epoch = math.ceil(n_micro / (cfg.batch_size // cfg.micro_batch_size))
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(cfg.max_steps, total_steps)
    return steps_per_epoch, total_steps, max(1, round(cfg.warmup_ratio * total_steps))


def windows(batches: LengthGroupedBatches, epochs: int, size: int, start: tuple[int, int] = (0, 0)):
    """(epoch, k, micro-batches) of each optimizer step from start = (epoch, windows done in it): window k of an
    epoch is micro-batches k*size .. (k+1)*size - 1 of that epoch's order (a function of (seed, epoch)), the last
    one of an epoch possibly shorter. Every process walks the same windows, whatever their number."""
    for epoch in range(start[0], epochs):
        batches.set_epoch(epoch)
        order = list(batches)
        for k in range(start[1] if epoch == start[0] else 0, math.ceil(len(order) / size)):
            yield epoch, k, order[k * size:(k + 1) * size]


# ----------------------------------------------------------------------------------- one optimizer step (every rank)
def accumulate_window(acc: Accelerator, model, window: list, examples: list, collate_fn, per_rank: int,
                      sharded: bool) -> tuple[list, int]:
    """Forward and backward of this rank's share of one optimizer step's window; returns the real micro-batches'
    losses (detached) and their token count.

    Each micro-batch's loss (its mean over trained tokens) is divided by per_rank = W / P (W: the window's full
    size, P: ranks); DDP and FSDP average the gradient over the ranks, so the step's gradient is the sum of the
    window's micro-batch means / W, what one process accumulates, a partial last window included. A rank with fewer
    micro-batches than another runs fillers (labels all IGNORE, loss times 0: no gradient) so every rank joins every
    collective. Under DDP all but the last micro-batch skip the all-reduce (no_sync). Under FSDP2 every micro-batch
    is reduce-scattered into the shards as it comes: skipping the sync would keep each parameter's full unsharded
    gradient on every rank until the window ends."""
    mine, runs = window_share(window, acc.process_index, acc.num_processes)
    losses, tokens = [], 0
    for j in range(runs):
        real = j < len(mine)
        if real:
            batch = collate_fn([examples[i] for i in mine[j]])
        else:  # a filler: two tokens of the window's first conversation, none trained
            ids = examples[window[0][0]][0][:2]
            batch = collate_fn([(ids, [IGNORE] * len(ids))])
        # No padding mask: padding is on the right, so under the causal mask no real token attends to it and its
        # labels are IGNORE: the same loss, and attention takes its causal fast path (1.15x at the tiny scale,
        # bench/sft_speed.py). Packed rows carry position_ids instead. A cache would also turn off packing's mask.
        inputs = {k: v.to(acc.device) for k, v in batch.items() if k not in ("labels", "num_tokens", "attention_mask")}
        with contextlib.nullcontext() if j == runs - 1 or sharded else acc.no_sync(model):
            logits = model(**inputs, use_cache=False).logits
            loss = masked_lm_loss(logits, batch["labels"].to(acc.device))
            acc.backward(loss / per_rank if real else loss * 0.0)
        if real:
            losses.append(loss.detach())
            tokens += int(batch["num_tokens"] if "num_tokens" in batch else batch["attention_mask"].sum())
    return losses, tokens


def optimizer_step(acc: Accelerator, model, optimizer, scheduler, cfg: SFTConfig, losses: list, step: int,
                   out: Path) -> None:
    """Clip the gradient, stop on a non-finite loss or norm (before the weights change), step the optimizer and,
    once, the lr schedule."""
    grad_norm = accel.full(acc.clip_grad_norm_(model.parameters(), cfg.grad_clip))  # FSDP2: a DTensor
    stop_unless_finite(acc, losses, grad_norm, step, out)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


# ----------------------------------------------------------------------------------- main
def check_inputs(cfg: SFTConfig):
    """Stop with a clear message before any work: a value out of range, missing model or data, a bad conversation
    (file and line)."""
    problems = check_ranges(cfg, RANGES) + lora.check_config(cfg) + [attention.check(cfg.attn_implementation)]
    if cfg.packing:
        problems.append(attention.packing_problem(attention.transformers_version(), "packing=true"))
    if problems := [p for p in problems if p]:
        raise SystemExit("config error: " + "; ".join(problems))
    try:
        check_model_path(cfg.model_path)
    except ValueError as e:
        raise SystemExit(f"sft: {e}") from None
    if not cfg.data or not Path(cfg.data).is_file():
        raise SystemExit(f"sft: data file not found: {cfg.data!r}")
    if cfg.mixed_precision not in ("no", "bf16"):
        raise SystemExit(f"sft: mixed_precision must be 'no' or 'bf16', got {cfg.mixed_precision!r}")
    if cfg.save_every and cfg.save_every % cfg.log_every:
        # a checkpoint between two log lines would lose the losses gathered since the last line
        raise SystemExit(f"sft: save_every={cfg.save_every} must be a multiple of log_every={cfg.log_every}")
    try:
        chat = chat_format_of(cfg)
    except ValueError as e:
        raise SystemExit(f"config error: {e}") from None
    try:
        return chat, load_conversations(cfg.data, chat)
    except ValueError as e:
        raise SystemExit(f"sft: bad data: {e}") from None


def load_model(cfg: SFTConfig, saved_dtype: torch.dtype):
    """The model as fp32 master weights whatever the checkpoint's dtype (AdamW's steps at lr 5e-6 are below bf16's
    resolution for most weights: they would round away; mixed_precision=bf16 computes in bf16), or under LoRA
    frozen in `saved_dtype` with an fp32 adapter (plumbing/lora.py); and AdamW over what trains (no weight decay on norms
    and biases)."""
    from transformers import AutoModelForCausalLM
    try:
        model = load_pretrained(AutoModelForCausalLM, cfg.model_path, torch_dtype=lora.weights_dtype(cfg, saved_dtype),
                                **attention.load_kwargs(cfg.attn_implementation))
    except ValueError as e:
        raise SystemExit(f"sft: {e}") from None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model = lora.attach(model, cfg)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2))
    return model, optimizer


def training_data(acc: Accelerator, cfg: SFTConfig, tokenizer, chat, conversations):
    """The tokenized conversations that fit max_seq_len (examples), their length-grouped micro-batches, and the
    collate function (padded or packed) that turns a micro-batch into tensors."""
    examples, skipped = build_examples(tokenizer, conversations, chat, cfg.max_seq_len)
    acc.print(f"sft: {len(examples)} conversations, {skipped} skipped (longer than max_seq_len={cfg.max_seq_len})")
    if not examples:
        raise SystemExit("sft: every conversation is longer than max_seq_len")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    collate_fn = functools.partial(COLLATE[cfg.packing], pad_id=pad_id)
    if cfg.packing and attention.one_row(cfg.attn_implementation):  # flash: packed sequences apart in one row only
        collate_fn = functools.partial(pack, pad_id=pad_id, one_row=True)
    # group_by_length=False is the same sampler with windows of one micro-batch: a plain shuffle, resumable alike
    batches = LengthGroupedBatches([len(ids) for ids, _ in examples], cfg.micro_batch_size, cfg.seed,
                                   window=32 if cfg.group_by_length else 1)
    return examples, batches, collate_fn


def train(cfg: SFTConfig) -> Path:
    """Run SFT as configured (continuing from a checkpoint where there is one); returns the saved model's folder."""
    with accel.process_group_ends():  # on every way out, errors included (plumbing/accel.py, point 4)
        return run_sft(cfg)


def run_sft(cfg: SFTConfig) -> Path:
    """The set-up, the loop and model/ of `train`."""
    from transformers import AutoTokenizer
    chat, conversations = check_inputs(cfg)
    try:  # before out_dir is touched
        tokenizer = load_pretrained(AutoTokenizer, cfg.model_path)
        saved_dtype = input_dtype(cfg.model_path)
    except ValueError as e:
        raise SystemExit(f"sft: {e}") from None
    # ---- the run folder (resumed where it holds a checkpoint), the accelerator
    out = Path(cfg.out_dir)
    identity = run_identity(cfg, [cfg.data])
    checkpoint = resume_point(cfg, out, identity, RESUME_FREE)
    saved_position(checkpoint)
    acc, per_rank = make_accelerator(cfg)
    acc.print(format_config(cfg))
    acc.print(f"sft: {cpu_threads.set_torch_threads(cfg.torch_threads)} torch thread(s)")
    set_seed(cfg.seed)
    metrics_path = out / "metrics.jsonl"
    if acc.is_main_process:
        begin_run(out, checkpoint)
        save_config(cfg, out / "config.yaml")

    # ---- model, data, schedule
    model, optimizer = load_model(cfg, saved_dtype)  # model/ is saved in `saved_dtype` at the end
    examples, batches, collate_fn = training_data(acc, cfg, tokenizer, chat, conversations)
    W, P = cfg.batch_size // cfg.micro_batch_size, acc.num_processes
    steps_per_epoch, total_steps, warmup_steps = step_plan(len(batches), cfg)
    # Stepped once per optimizer step here, not prepared (Accelerate would step it once per process); registered,
    # so that save_state / load_state keep it.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps,
                                                                                 cfg.decay_ratio))
    model, optimizer = acc.prepare(model, optimizer)
    acc.register_for_checkpointing(scheduler)
    lora.checkpoint_adapter_only(acc, model)  # under LoRA checkpoints keep the adapter, not the frozen weights
    acc.print(f"sft: {total_steps} optimizer steps ({steps_per_epoch}/epoch), batch {cfg.batch_size} = "
              f"{cfg.micro_batch_size} x {per_rank} accumulation x {P} ranks, warm-up {warmup_steps} steps")
    step, start = resume(acc, checkpoint, steps_per_epoch, W)
    peers = accel.peers(cfg.peer_timeout_s, "sft")  # the watchdog: a silent rank is named (plumbing/accel.py, 7)

    # ---- the loop: each optimizer step accumulates one window of micro-batches; log and checkpoint every few
    sharded, losses, tokens, t0 = accel.is_sharded(model), [], 0, time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc="sft", disable=not acc.is_local_main_process, file=sys.stdout)
    model.train()
    for epoch, k, window in windows(batches, cfg.epochs, W, start):
        if step >= total_steps:
            break
        peers.phase("train", f"step {step + 1}")
        window_losses, window_tokens = accumulate_window(acc, model, window, examples, collate_fn, per_rank, sharded)
        losses, tokens = losses + window_losses, tokens + window_tokens
        lr = scheduler.get_last_lr()[0]  # the lr this step trains with (logged)
        optimizer_step(acc, model, optimizer, scheduler, cfg, losses, step + 1, out)
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == total_steps:
            row = interval_row(acc, step, losses, tokens, lr, steps_per_epoch, time.perf_counter() - t0)
            log_step(acc, metrics_path, row, bar)
            losses, tokens, t0 = [], 0, time.perf_counter()
        if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            peers.phase("checkpoint", f"step {step}")
            save_checkpoint(acc, out, step, {"epoch": epoch, "windows_in_epoch": k + 1, "total_steps": total_steps,
                                             "identity": identity}, keep_last=cfg.keep_checkpoints)
    bar.close()
    peers.phase("model", f"step {step}")
    save_model(acc, model, tokenizer, out / "model", saved_dtype)
    acc.print(f"sft: saved {out / 'model'}")
    acc.end_training()
    return out / "model"


if __name__ == "__main__":
    accel.run_and_exit(lambda: train(parse_cli(SFTConfig, usage=USAGE)))  # no abort at exit (plumbing/accel.py, 4)
