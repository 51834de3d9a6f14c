"""One stage of agentic RL with GRPO-RoC (rStar2-Agent report, sections 3-4 and 6), on plain PyTorch + Accelerate.

    python train.py configs/tiny/stage1.yaml                       # one process (CPU or one GPU)
    accelerate launch --config_file configs/accelerate/fsdp_1node_8gpu.yaml train.py configs/qwen3-14b/stage1.yaml

Each step, in labelled phases (the banners in `train_step`):
  1. claim the step's B x 2G rollouts, a few at a time as this rank's engine frees up (schedule.py)
  2. rollout: 2G multi-turn rollouts per prompt with the Python tool (rollout.py)
  3. reward: 0/1 on the final answer (reward.py)
  4. drop equal groups (all right or all wrong)                    } grpo_roc.py
  5. Resample-on-Correct: 2G -> G per group                         }
  6. advantages per group of G                                      }
  7. old log-probs under the policy before the update
  8. policy update: the kept rollouts spread over ranks by tokens (schedule.py); mini-batches of micro-batches,
     gradient accumulation, the exact global token normaliser
  9. hand the new weights to the sampler, and verify they arrived (log-probs of a fixed sequence; handoff.py)
 10. log (metrics.jsonl, tqdm, trackers) and checkpoint
A stage is one invocation; the multi-stage recipe is a sequence of them (configs/*/stage{1,2,3}.yaml), each starting
from the previous stage's `model/`. Stage 3's data is the problems the stage-2 policy did not solve k of k times
(`eval.py ... unsolved_out=...`), and it starts with a fresh optimizer; stage 2 may carry stage 1's (`optimizer_from`).
The policy trains as fp32 master weights (checkpoints keep them); `model/` is written in the dtype the stage read
(bf16 from a Qwen3-Base lineage), so each stage hands the next what a hub checkpoint would be.

Exact token normalisation across micro-batches and ranks: each micro-batch's loss is its masked token sum divided by
the token count of the whole mini-batch over all ranks, times the world size (DDP/FSDP average gradients over
ranks, which the factor undoes). The accumulated gradient is then exactly that of one big batch on one process.
Ranks keep different numbers of rollouts after dropping equal groups, so the number of micro-batches is agreed on
first and ranks with fewer run empty (mask-0) micro-batches: every rank joins every collective.

Not here: a KL term or reference model, an entropy bonus (see grpo_roc.py). The report's rollout scheduler (§3.2)
is schedule.py's: across ranks, rollouts claimed as engines free up; within a rank, rollout.py batches continuously
and dispatches each tool call the moment its turn ends.
"""
import contextlib
import json
import math
import os
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import cpu_threads  # noqa: F401  (first: it sets OpenMP's wait policy, which is read when torch loads)
import torch
from tqdm import tqdm

import accel
import lora
from checkpoint import (atomic_write_text, begin_run, input_dtype, latest_checkpoint, load_checkpoint, load_optimizer, optimizer_file,
                        resume_point, run_identity, save_checkpoint, save_model)
from code_tool import ERROR_FORMATS, CodeTool, SandboxError, announce, choose_sandbox
from config import check_ranges, format_config, parse_cli, save_config, tracker_config
from data import check_model_path, load_pretrained, load_problems
from eval import trajectory_record
from samplers.hf import HFSampler
from logprobs import sampled_logprobs
from tools.plots import plot_curves
import handoff
from grpo_roc import ROC_SELECTORS, penalty_total, policy_loss, select_step, sequence_mean_policy_loss
from mismatch import mismatch_sums, sequence_log_ratios, sequence_mask_weights, sequence_mismatch, truncated_is_weights
from protocol import chat_format_of, encode
from reward import check_many, default_pool, extract_answer
from rollout import rollout, rollout_sums
from samplers.vllm_engine import VLLMSampler
from schedule import (FILLER_TOKENS, SCHEDULES, MicroBatch, filler_row, gather_scores, layout_for, step_claims,
                      update_work, wait_fraction)
from train_config import RANGES, RESUME_FREE, USAGE, TrainConfig, check_inputs, plan_lines

# ============================================================================ one RL step (phases 1-9)
def train_step(step: int, cfg: TrainConfig, run) -> dict:
    """Phases 1-9 for one step on this rank; returns {name: (sum, count)} to be reduced over ranks."""
    acc, K, B = run.accelerator, cfg.rollouts_per_prompt, cfg.prompts_per_step
    t0 = time.perf_counter()
    # ---------------------------------------------------------------- 1-2. claim rollouts, play them out
    indices = prompt_indices(step, B, len(run.problems), cfg.seed)
    run.peers.start(step)
    claims = step_claims(cfg.schedule, step, [run.problems[i]["problem"] for i in indices], K,
                         cfg.rollout_batch_size, cfg.claim_size, cfg.seed, run.peers)
    trajs = rollout([], run.sampler, run.tool, run.tokenizer, run.fmt, max_response_tokens=cfg.max_response_tokens,
                    max_turns=cfg.max_turns, temperature=cfg.temperature, top_p=cfg.top_p,
                    sync_turns=cfg.sync_turns, progress=acc.is_local_main_process, more=claims, seeds=claims.seed)
    t_rollout = time.perf_counter() - t0
    run.peers.wait("rollouts")  # for the slowest rank, with a heartbeat: a silent one stops the run (accel.py, 5)
    # ---------------------------------------------------------------- 3. reward: 0/1 on the final answer
    golds = [run.problems[indices[slot // K]]["answer"] for slot in claims.slots]
    verdicts = check_many([extract_answer(t.text) for t in trajs], golds)
    for t, v in zip(trajs, verdicts):
        t.reward = float(v.correct)
    # ---------------------------------------------------------------- 4-6. drop equal groups, RoC, advantages
    # ... on the whole step: every rank gathers every rollout's reward and penalty counts (not its tokens)
    scores = gather_scores(acc, claims.slots, trajs)
    if [s.slot for s in scores] != list(range(B * K)):  # the same on every rank: the scores are gathered
        raise SystemExit(f"train: step {step + 1}: the ranks rolled out {len(scores)} rollouts "
                         f"({len({s.slot for s in scores})} distinct) of the step's {B * K}")
    rewards, penalties = step_grids(scores, B, K)
    gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 10_007 + g) for g in range(B)]
    # A_i = (r_i - mean_group) / (std_group + 1e-6), unbiased std, every token of rollout i gets A_i
    groups, kept_idx, adv = select_step(rewards, penalties, cfg.group_size, cfg.roc_mode, gens)
    kept = kept_slots(groups, kept_idx, adv, K, cfg)  # slot -> (advantage, mini-batch)
    if cfg.save_rollouts_every and (step + 1) % cfg.save_rollouts_every == 0:
        save_rollouts(acc, run.out / "rollouts" / f"step_{step + 1:06d}.jsonl", step + 1,
                      [run.problems[indices[slot // K]] for slot in claims.slots], claims.slots, trajs, K, kept)
    # ---------------------------------------------------------------- 7-8. old log-probs, policy update
    # ... on micro-batch slots balanced over ranks by tokens (schedule.py: under `static`, each rank's own)
    t1 = time.perf_counter()
    if hasattr(run.sampler, "sleep"):
        run.sampler.sleep()  # colocated vLLM: free the GPU memory of its weights and KV cache for the update
    work, plan = update_work(acc, scores, kept, dict(zip(claims.slots, trajs)), cfg.updates_per_step,
                             cfg.max_tokens_per_micro_batch, cfg.micro_batch_size, cfg.schedule,
                             layout_for(cfg.max_tokens_per_micro_batch, run.one_row))
    lr = run.scheduler.get_last_lr()[0]  # the lr of this step's first optimizer step
    sums = {k if "/" in k else f"loss/{k}": v for k, v in update_policy(
        acc, run.model, run.optimizer, run.scheduler, work, cfg, run.pad_id).items()}
    t_update = time.perf_counter() - t1
    # ---------------------------------------------------------------- 9. hand the new weights to the sampler
    run.handoff_check = handoff.sync(acc, run.model, run.sampler, run.probe, f"after step {step + 1}",
                                     run.handoff_check)
    # ---------------------------------------------------------------- statistics for the log
    sums.update({f"rollout/{k}": v for k, v in rollout_sums(trajs, [t.reward for t in trajs]).items()})
    sums.update(shared_sums(acc.num_processes, {**roc_stats(scores, groups, kept, K), **plan}))
    sums.update(rollout_wait(acc, t_rollout))
    sums.update({
        "perf/tokens_per_s": (sum(sum(t.loss_mask) for t in trajs), t_rollout),
        "perf/rollout_s": (t_rollout, 1.0),
        "perf/update_s": (t_update, 1.0),
        "perf/step_s": (time.perf_counter() - t0, 1.0),
        "loss/lr": (lr, 1.0),
        "reward/timeouts": (sum(v.timed_out for v in verdicts), 1.0 / acc.num_processes),
    })
    return sums


# ============================================================================ the policy update (phases 7-8)
# Loss aggregation, for ablations: config string -> (loss function, what its `normaliser` counts over the whole
# mini-batch, a key of RankWork.counts), picked at update_policy's one call site.
LOSSES = {"token": (policy_loss, "tokens"), "sequence": (sequence_mean_policy_loss, "sequences")}
# Mismatch corrections (mismatch.py): config -> the per-token loss weights; None: no correction (the report's loss).
CORRECTIONS = {
    "off": lambda cfg: None,
    "tis": lambda cfg: partial(truncated_is_weights, cap=cfg.mismatch_tis_cap),
    "seq_mask": lambda cfg: partial(sequence_mask_weights, low=cfg.mismatch_seq_low, high=cfg.mismatch_seq_high),
}


def update_policy(accelerator, model, optimizer, scheduler, work, cfg, pad_id: int) -> dict:
    """Phases 7-8 on this rank's part of the step's update (schedule.RankWork: its micro-batch slots of every
    mini-batch, the same number of slots on every rank). Returns metrics as {name: (sum, count)}: the loss's, and
    the sampler-trainer gap on the kept rollouts' sampled tokens (`mismatch/*`, from the old log-probs the update
    computes anyway)."""
    world = accelerator.num_processes
    loss_fn, counted = LOSSES[cfg.loss_agg]
    correction = CORRECTIONS[cfg.mismatch_correction](cfg)
    if correction and not work.measured:
        raise SystemExit(f"config error: mismatch_correction={cfg.mismatch_correction} needs the sampler's "
                         "log-probs, and this sampler gives none")
    minibatches = [[make_batch(micro, pad_id, work.measured, cfg.max_tokens_per_micro_batch, accelerator.device)
                    for micro in slots] for slots in work.minibatches]
    # Phase 7: old log-probs under the policy before this step's first update.
    old = old_logprobs(model, minibatches, cfg.temperature)
    # Phase 8: `updates_per_step` optimizer steps (mini-batches), each accumulating its micro-batches.
    sums, seq_log_ratios = {}, []
    for micro, micro_old, counts in zip(minibatches, old, work.counts):
        # The normaliser, over ALL ranks and micro-batches of this mini-batch: unmasked tokens (token-level loss)
        # or sequences (sequence-mean ablation); every rank knows it from the gathered scores.
        normaliser = counts[counted]
        loss_sum = 0.0
        for j, ((batch, adv, n), old_logp) in enumerate(zip(micro, micro_old)):
            with gradient_sync(accelerator, model, last=j == len(micro) - 1):
                logp = token_logprobs(model, batch, cfg.temperature)
                old_logp = logp.detach() if old_logp is None else old_logp
                weights = correction(old_logp, batch.get("sampler_logp"), batch["loss_mask"]) if correction else None
                loss, metrics = loss_fn(logp, old_logp, adv, batch["loss_mask"], clip_low=cfg.clip_low,
                                        clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, is_weights=weights,
                                        normaliser=normaliser)
                # x world: DDP/FSDP average gradients over ranks, and the normaliser already counts every rank.
                accelerator.backward(loss * world)
            loss_sum += loss.item()
            add_micro_batch_metrics(sums, seq_log_ratios, metrics, batch, n, old_logp, weights, work.measured)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        check_finite(accelerator, loss_sum, grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # Each rank adds its share; reduce_sums divides the global sum by updates_per_step.
        _add(sums, "policy", loss_sum, 1.0 / world)
        _add(sums, "grad_norm", float(accel.full(grad_norm)) / world, 1.0 / world)
    if work.measured:  # the sequence-level gap over every rank's kept rollouts: the same numbers on every rank
        add_sequence_mismatch(sums, seq_log_ratios)
    return sums


def old_logprobs(model, minibatches: list[list[tuple]], temperature: float) -> list[list]:
    """Phase 7: each micro-batch's (n, L-1) log-probs under the policy before this step's first update. The first
    mini-batch's are the log-probs its own forward computes (nothing has changed the policy yet), so only later
    mini-batches need a forward of their own now (None: take them from the update's forward)."""
    model.eval()
    with torch.no_grad():
        old = [[None if u == 0 else token_logprobs(model, batch, temperature) for batch, _, _ in micro]
               for u, micro in enumerate(minibatches)]
    model.train()
    return old


def gradient_sync(accelerator, model, last: bool):
    """The context of one micro-batch's backward: gradients synced over ranks at the mini-batch's last one, held
    back before it (`no_sync`). Under FSDP, skipping the sync would keep a whole unsharded gradient on every GPU
    until the last micro-batch; instead each micro-batch's gradient is reduce-scattered into the shards as it comes,
    and under HSDP (shards within a node, replicas across nodes) the replicas' all-reduce of those shards waits for
    the last micro-batch (`accel.defer_replica_all_reduce`: one all-reduce per optimizer step, not per micro-batch)."""
    if accel.is_sharded(model):
        accel.defer_replica_all_reduce(model, deferred=not last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else accelerator.no_sync(model)


def add_micro_batch_metrics(sums: dict, seq_log_ratios: list, metrics: dict, batch: dict, n: int, old_logp,
                            weights, measured: bool) -> None:
    """One micro-batch's share of the update's metrics: the loss's, weighted by its sampled tokens; when the sampler
    gave log-probs, the gap on the tokens this loss sees (the kept rollouts' sampled tokens) and each rollout's
    sequence log-ratio (appended to `seq_log_ratios`); the correction's mean weight on the sampled tokens."""
    w = batch["loss_mask"].sum().item()
    for k, v in metrics.items():
        _add(sums, k, v * w, w)
    if measured:
        for k, (total, count) in mismatch_sums(old_logp, batch["sampler_logp"], batch["loss_mask"]).items():
            _add(sums, f"mismatch/{k}", total, count)
        log_w = sequence_log_ratios(old_logp, batch["sampler_logp"], batch["loss_mask"])
        seq_log_ratios.extend(log_w[:n].tolist())  # not a filler's
    if weights is not None:
        _add(sums, "mismatch/correction_weight_mean", float((weights * batch["loss_mask"]).sum()), w)


def add_sequence_mismatch(sums: dict, seq_log_ratios: list) -> None:
    """The sequence-level gap (`sequence_mismatch`) over every rank's kept rollouts, the same on every rank."""
    from accelerate.utils import gather_object  # every rank's list, concatenated (a no-op on one process)
    for k, v in sequence_mismatch(gather_object(seq_log_ratios)).items():
        _add(sums, f"mismatch/{k}", v, 1.0)


def check_finite(accelerator, loss_sum: float, grad_norm) -> None:
    """A NaN or infinite loss stops the run before it reaches the weights; summed over ranks, so all stop together."""
    if accel.all_sum(accelerator, [float(not (math.isfinite(loss_sum) and math.isfinite(float(grad_norm))))])[0]:
        raise FloatingPointError(f"the loss ({loss_sum}) or gradient norm ({float(grad_norm)}) is not finite")


# ============================================================================ the step's bookkeeping (every rank)
def step_grids(scores: list, groups: int, per_group: int) -> tuple[list[list[float]], list[list[float]]]:
    """(rewards, penalties), each (B, 2G), from the gathered scores of the step's B x 2G rollouts."""
    if [s.slot for s in scores] != list(range(groups * per_group)):
        raise RuntimeError(f"the step's rollouts were not each rolled out once: {len(scores)} scores for "
                           f"{groups * per_group} rollouts")
    rewards = [[s.reward for s in scores[g * per_group:(g + 1) * per_group]] for g in range(groups)]
    penalties = [[penalty_total(s.tool_calls, s.failed_calls, s.answer_blocks, s.turns)
                  for s in scores[g * per_group:(g + 1) * per_group]] for g in range(groups)]
    return rewards, penalties


def kept_slots(groups: list[int], kept_idx: list[list[int]], adv: list[list[float]], per_group: int,
               cfg: TrainConfig) -> dict[int, tuple[float, int]]:
    """Every kept rollout of the step: slot -> (advantage, mini-batch), the mini-batches cut by `minibatch_of`."""
    counts = [0] * cfg.prompts_per_step
    for g, idx in zip(groups, kept_idx):
        counts[g] = len(idx)
    every = minibatch_of(counts, cfg.updates_per_step, 1 if cfg.max_tokens_per_micro_batch else cfg.micro_batch_size)
    return {g * per_group + i: (a, m) for g, idx, advs in zip(groups, kept_idx, adv)
            for i, a, m in zip(idx, advs, every[g])}


def roc_stats(scores: list, groups: list[int], kept: dict, per_group: int) -> dict:
    """The step's RoC statistics from the gathered scores, as {name: (sum, count)}."""
    n_groups = len(scores) // per_group
    pos = [scores[s] for s in kept if scores[s].reward > 0]
    return {"roc/equal_group_frac": (n_groups - len(groups), n_groups),
            "roc/pos_kept_mean": (len(pos), len(groups)), "roc/neg_kept_mean": (len(kept) - len(pos), len(groups)),
            "roc/tool_error_rate_in_correct": (sum(s.failed_calls for s in pos), sum(s.tool_calls for s in pos))}


def shared_sums(world: int, sums: dict) -> dict:
    """{name: (sum, count)} that every rank computed alike from gathered numbers, scaled so that reduce_sums (which
    adds every rank's) counts them once."""
    return {k: (a / world, b / world) for k, (a, b) in sums.items()}


def rollout_wait(accelerator, seconds: float) -> dict:
    """The ranks' rollout times: the slowest, and the share of rollout time spent waiting for it (schedule.py)."""
    times = [float(t) for part in accel.all_gather_rows(accelerator, torch.tensor([[seconds]], dtype=torch.float64))
             for t in part.flatten()]
    return shared_sums(len(times), {"perf/rollout_wait_frac": (wait_fraction(times), 1.0),
                                    "perf/rollout_max_s": (max(times), 1.0)})


# ============================================================================ pure helpers of the step
def prompt_indices(step: int, per_step: int, n_data: int, seed: int) -> list[int]:
    """Indices of the prompts of a step: a fresh seeded permutation per data epoch, consumed in order, so the
    position is a pure function of the step (resume at any step, epoch boundaries included, skips nothing)."""
    out, start = [], step * per_step
    for i in range(start, start + per_step):
        epoch, offset = divmod(i, n_data)
        perm = torch.randperm(n_data, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(perm[offset]))
    return out


def minibatch_of(kept_per_group: list[int], updates: int, size: int) -> list[list[int]]:
    """The mini-batch (optimizer step) of each kept rollout, given how many each group of the step kept, in the
    step's group order: those rollouts, in that order, are cut into `updates` runs of whole micro-batches of `size`
    (the last runs may be short or empty). A function of the whole step only, so each optimizer step sees the same
    rollouts whatever the number of ranks and wherever a group was rolled out."""
    n = sum(kept_per_group)
    span = max(1, math.ceil(math.ceil(n / size) / updates)) * size  # rollouts per mini-batch
    out, position = [], 0
    for k in kept_per_group:
        out.append([(position + i) // span for i in range(k)])
        position += k
    return out


# ============================================================================ micro-batches as tensors
def make_batch(micro: MicroBatch, pad_id: int, measured: bool, budget: int,
               device="cpu") -> tuple[dict, torch.Tensor, int]:
    """(batch, advantages (n,), n) on `device` for one micro-batch slot (schedule.MicroBatch of TrainRows): packed
    as planned when the micro-batches are cut by tokens (budget > 0), padded otherwise; a slot without rows becomes
    a filler (schedule.filler_row), so a rank with nothing to train there still joins every collective. n counts
    the real rollouts (0 for a filler)."""
    n = len(micro.items())
    if not n:
        micro = MicroBatch([[filler_row(pad_id, measured)]], FILLER_TOKENS)
    real = micro.items()
    batch = pack_batch(micro, pad_id) if budget else pad_batch(real, pad_id)
    if measured:
        batch["sampler_logp"] = sampler_logprobs(real, batch["loss_mask"].shape[1])
    adv = torch.tensor([t.advantage for t in real], dtype=torch.float)
    return {k: v.to(device) for k, v in batch.items()}, adv.to(device), n


def target_mask(trajs, width: int) -> torch.Tensor:
    """(n, width) loss mask aligned with each sequence's next-token targets: row i, column t is 1 exactly where
    token t + 1 of sequence i is one the policy sampled (0 on prompt, tool text and past the sequence's end)."""
    mask = torch.zeros((len(trajs), width))
    for i, t in enumerate(trajs):
        p = len(t.prompt_ids)
        mask[i, p - 1:p - 1 + len(t.response_ids)] = torch.tensor(t.loss_mask, dtype=torch.float)
    return mask


def pad_batch(trajs, pad_id: int) -> dict:
    """Right-padded tensors for a micro-batch of n trajectories.
    input_ids, attention_mask: (n, L) with L = longest prompt + response; loss_mask: (n, L-1), aligned with the
    next-token targets input_ids[:, 1:], 1 exactly where the target is a token the policy sampled."""
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(trajs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(trajs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": target_mask(trajs, L - 1)}


def pack_batch(micro: MicroBatch, pad_id: int) -> dict:
    """Packed tensors for a micro-batch of n trajectories laid out in rows (schedule.MicroBatch): input_ids and
    position_ids (rows, width), positions restarting at 0 for every sequence and no attention mask, so the model
    keeps each sequence to itself (transformers' packed-sequence support: a new block wherever a position does not
    follow the one before it); a row's padding is a block of its own. unpack (n, L-1): where in the flattened
    (rows x width) next-token log-probs each sequence's lie, so token_logprobs hands back pad_batch's (n, L-1)
    layout; loss_mask as there. Sequences are numbered row by row (MicroBatch.items)."""
    trajs = micro.items()
    L = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    ids = torch.full((len(micro.rows), micro.width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(micro.rows), micro.width), dtype=torch.long)
    unpack = torch.zeros((len(trajs), L - 1), dtype=torch.long)
    i = 0
    for r, members in enumerate(micro.rows):
        at = 0
        for t in members:
            seq = t.prompt_ids + t.response_ids
            n = len(seq)
            ids[r, at:at + n] = torch.tensor(seq)
            pos[r, at:at + n] = torch.arange(n)
            unpack[i, :n - 1] = r * micro.width + at + torch.arange(n - 1)  # position t predicts token t + 1
            at, i = at + n, i + 1
        pos[r, at:] = torch.arange(micro.width - at)
    return {"input_ids": ids, "position_ids": pos, "unpack": unpack, "loss_mask": target_mask(trajs, L - 1)}


def sampler_logprobs(trajs, width: int) -> torch.Tensor | None:
    """The sampler's log-probs (Trajectory.logprobs, after temperature) in pad_batch's (n, width = L-1) layout,
    aligned with loss_mask; 0 on prompt, tool text (the sampler drew none of it) and padding. None when a
    trajectory carries none (a sampler that gives no log-probs)."""
    if any(getattr(t, "logprobs", None) is None for t in trajs):
        return None
    out = torch.zeros((len(trajs), width))
    for i, t in enumerate(trajs):
        p = len(t.prompt_ids)
        out[i, p - 1:p - 1 + len(t.logprobs)] = torch.tensor(t.logprobs, dtype=torch.float)
    return out


def token_logprobs(model, batch: dict, temperature: float) -> torch.Tensor:
    """log pi(x_t | x_<t) of every next token: (n, L-1), fp32, for a padded or a packed batch (the same layout
    either way). Logits are divided by the sampling temperature so the numbers are those of the distribution the
    rollouts were drawn from (verl does the same). Computed in chunks of positions (logprobs.py): no fp32
    log-softmax over the vocabulary is kept, only the logits. No KV cache: a cache would turn packing's mask off."""
    ids = batch["input_ids"]
    if "position_ids" in batch:
        logits = model(input_ids=ids, position_ids=batch["position_ids"], use_cache=False).logits  # (rows, w, V)
    else:
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits  # (n, L, V)
    # position t predicts token t+1; the last position's target (the first token, rolled over) is never used
    targets = torch.roll(ids, -1, dims=1)
    logp = sampled_logprobs(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), temperature)
    if "unpack" in batch:
        return logp[batch["unpack"]]  # (n, L-1): each packed sequence's own, in pad_batch's layout
    return logp.view(ids.shape)[:, :-1]


def _add(sums: dict, key: str, value: float, count: float) -> None:
    s = sums.setdefault(key, [0.0, 0.0])
    s[0] += value
    s[1] += count


# ============================================================================ configuration checks
def validate(cfg: TrainConfig, world: int) -> None:
    """Config errors that need no files, raised before any work."""
    problems = check_ranges(cfg, RANGES) + lora.check_config(cfg)
    if cfg.roc_mode not in ROC_SELECTORS:
        problems.append(f"roc_mode must be sample, lowest or off, got {cfg.roc_mode!r}")
    if cfg.roc_mode == "off" and cfg.group_size != cfg.rollouts_per_prompt:
        problems.append("roc_mode=off keeps every rollout: set group_size == rollouts_per_prompt")
    if cfg.claim_size > cfg.rollouts_per_prompt:
        problems.append(f"claim_size={cfg.claim_size} is more than a prompt's rollouts_per_prompt="
                        f"{cfg.rollouts_per_prompt}")
    if not 2 <= cfg.group_size <= cfg.rollouts_per_prompt:
        problems.append(f"need 2 <= group_size <= rollouts_per_prompt, got {cfg.group_size}, {cfg.rollouts_per_prompt}")
    if cfg.prompts_per_step % world:
        problems.append(f"prompts_per_step={cfg.prompts_per_step} must divide over {world} processes")
    size = 1 if cfg.max_tokens_per_micro_batch else max(cfg.micro_batch_size, 1)  # minibatch_of's unit
    most = math.ceil(cfg.prompts_per_step * cfg.group_size / size)
    if cfg.updates_per_step > most > 0:
        # the last optimizer steps would never get a micro-batch (minibatch_of): updates with nothing to learn from
        unit = "kept rollouts" if cfg.max_tokens_per_micro_batch else "micro-batch(es)"
        problems.append(f"updates_per_step={cfg.updates_per_step} exceeds the {most} {unit} of a step "
                        f"(prompts_per_step * group_size" + ("" if size == 1 else " / micro_batch_size") + ")")
    if cfg.loss_agg not in LOSSES:
        problems.append(f"loss_agg must be one of {sorted(LOSSES)}, got {cfg.loss_agg!r}")
    if cfg.mismatch_correction not in CORRECTIONS:
        problems.append(f"mismatch_correction must be one of {list(CORRECTIONS)}, got {cfg.mismatch_correction!r}")
    if cfg.schedule not in SCHEDULES:
        problems.append(f"schedule must be one of {list(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.sampler not in ("hf", "vllm"):
        problems.append(f"sampler must be hf or vllm, got {cfg.sampler!r}")
    if cfg.vllm_tensor_parallel_size != 1:
        problems.append(f"vllm_tensor_parallel_size={cfg.vllm_tensor_parallel_size}: only 1 is supported (one "
                        "engine per rank; tensor parallelism would need a rank group to submit the same requests)")
    if cfg.tool_error_format not in ERROR_FORMATS:
        problems.append(f"tool_error_format must be one of {ERROR_FORMATS}, got {cfg.tool_error_format!r}")
    try:  # the chat format's fields (protocol.chat_format)
        chat_format_of(cfg)
    except ValueError as e:
        problems.append(str(e))
    if not cfg.data:
        problems.append("data: give at least one JSONL file of problems")
    if problems:
        raise SystemExit("config error: " + "; ".join(problems))


# ============================================================================ set-up, evaluation, logging, main
def save_rollouts(acc, path: Path, step: int, problems: list[dict], slots: list[int], trajs: list, per_group: int,
                  kept: dict) -> None:
    """Every rollout of the step, from every rank, as eval.py's trajectory records (problem-major) with what the
    update made of it: the step, its penalty counts' total, whether RoC kept it, its advantage and mini-batch.
    Rank 0 writes the file whole (a resumed step writes it again)."""
    mine = [{**trajectory_record(f"step {step}", problem, slot // per_group, slot % per_group, t), "step": step,
             "penalty": penalty_total(t.num_tool_calls, t.num_failed_tool_calls, t.num_answer_blocks, t.num_turns),
             "kept": slot in kept, "advantage": kept[slot][0] if slot in kept else None,
             "minibatch": kept[slot][1] if slot in kept else None}
            for problem, slot, t in zip(problems, slots, trajs)]
    every = [r for rank in accel.all_gather(acc, mine) for r in rank]
    records = sorted(every, key=lambda r: (r["problem_index"], r["sample"]))
    if acc.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def held_out_eval(cfg: TrainConfig, run, step: int) -> dict:
    """Accuracy and diagnostics on the held-out split (mean reward over eval_samples samples per problem)."""
    acc = run.accelerator
    problems = run.eval_problems[acc.process_index::acc.num_processes]
    run.peers.start(f"held-out evaluation after step {step}")
    trajs = rollout([p["problem"] for p in problems for _ in range(cfg.eval_samples)], run.sampler, run.tool,
                    run.tokenizer, run.fmt, max_response_tokens=cfg.max_response_tokens, max_turns=cfg.max_turns,
                    temperature=cfg.eval_temperature, top_p=1.0, sync_turns=cfg.sync_turns, more=run.peers.beating)
    run.peers.wait("rollouts")
    verdicts = check_many([extract_answer(t.text) for t in trajs],
                          [problems[i // cfg.eval_samples]["answer"] for i in range(len(trajs))])
    rewards = [float(v.correct) for v in verdicts]
    stats = accel.reduce_sums(acc, rollout_sums(trajs, rewards))
    return {"eval/accuracy": stats["reward_mean"], "eval/tool_error_rate_in_correct":
            stats["tool_error_rate_in_correct"], "eval/response_tokens_mean": stats["response_tokens_mean"],
            "eval/tool_calls_mean": stats["tool_calls_mean"], "eval/truncated_frac": stats["truncated_frac"]}


def load_data(paths: list[str]) -> list[dict]:
    try:
        return [p for path in paths for p in load_problems(path)]
    except (OSError, ValueError) as e:
        raise SystemExit(f"input error: {e}") from None


def setup(cfg: TrainConfig):
    """Everything before step 0, in the order that stops on bad input before any expensive work."""
    from accelerate.utils import DistributedType, set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    acc = accel.make_accelerator(mixed_precision=cfg.mixed_precision, report_to=cfg.report_to, out_dir=cfg.out_dir,
                                 timeout_s=cfg.process_group_timeout_s)  # trackers, timeout, FSDP2 policy
    threads = cpu_threads.set_torch_threads(cfg.torch_threads)  # after Accelerate, which may set its own count
    validate(cfg, acc.num_processes)
    try:  # where and how model code runs (code_tool.py's sandbox modes)
        sandbox = choose_sandbox(cfg.tool_backend, cfg.tool_require_isolation)
    except SandboxError as e:
        raise SystemExit(f"config error: {e}") from None
    out = Path(cfg.out_dir)
    problems = load_data(cfg.data)
    eval_problems = load_data([cfg.eval_data]) if cfg.eval_data else []
    if cfg.eval_limit:
        eval_problems = eval_problems[:cfg.eval_limit]
    try:
        check_model_path(cfg.model_path)
        tokenizer = load_pretrained(AutoTokenizer, cfg.model_path)
    except ValueError as e:
        raise SystemExit(f"input error: {e}") from None
    fmt = chat_format_of(cfg)
    check_inputs(cfg, tokenizer, fmt, problems + eval_problems)
    identity = run_identity(cfg, cfg.data + ([cfg.eval_data] if cfg.eval_data else []))
    start = resume_point(cfg, out, identity, RESUME_FREE)
    if cfg.optimizer_from:
        optimizer_file(cfg.optimizer_from)
    acc.wait_for_everyone()  # every rank has read the folder before the main process changes it
    if acc.is_main_process:
        begin_run(out, start)
        print(format_config(cfg))
        print(f"{threads} torch thread(s)")
        save_config(cfg, out / "config.yaml")
        (out / "sandbox.txt").write_text(announce(sandbox) + "\n")
        if cfg.report_to:
            acc.init_trackers("rstar2", config=tracker_config(cfg))
    set_seed(cfg.seed + acc.process_index)  # rollouts differ per rank; everything else is seeded explicitly
    # fp32 master weights whatever the checkpoint's dtype: AdamW's steps at lr 1e-6 are far below bf16's
    # resolution (they would round away); mixed_precision=bf16 computes in bf16. Under LoRA the model's own
    # weights stay frozen in the checkpoint's dtype and only the adapter trains (lora.py).
    try:
        model = load_pretrained(AutoModelForCausalLM, cfg.model_path,
                                torch_dtype=lora.weights_dtype(cfg, input_dtype(cfg.model_path)))
    except ValueError as e:
        raise SystemExit(f"input error: {e}") from None
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model = lora.attach(model, cfg)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    # lr_t = lr * min(1, (t + 1) / warmup_steps) before optimizer step t: linear warm-up, then constant (report §4).
    # Not given to acc.prepare: Accelerate would step it once per process at every optimizer step (a warm-up
    # num_processes times too fast); registered, so checkpoints keep it all the same.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / max(cfg.warmup_steps, 1)))
    acc.register_for_checkpointing(scheduler)
    if acc.distributed_type == DistributedType.FSDP and not acc.is_fsdp2:
        raise SystemExit("config error: train.py shards with FSDP2: set fsdp_version: 2 in the Accelerate config "
                         "(configs/accelerate/*.yaml)")
    model, optimizer = acc.prepare(model, optimizer)
    lora.checkpoint_adapter_only(acc, model)  # under LoRA checkpoints keep the adapter, not the frozen weights
    if cfg.optimizer_from and start is None:  # after prepare: under FSDP the state is sharded like the model
        load_optimizer(acc, model, optimizer, optimizer_file(cfg.optimizer_from))
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"], group["initial_lr"] = lr, cfg.lr  # this stage's schedule, not the saved one
    step = 0
    if start is not None:
        step = load_checkpoint(acc, start)["step"]
        acc.print(f"resumed from {start} at step {step}")
    sampler = make_sampler(cfg, handoff.sampler_policy(cfg, acc, model), tokenizer)
    # The sampler starts from the trainer's weights (a resumed checkpoint's too), checked before any rollout.
    probe = encode(tokenizer, fmt.prompt(problems[0]["problem"]))[:handoff.HANDOFF_PROBE_TOKENS]
    # the objects a step needs, built once: a plain namespace, not a framework
    run = SimpleNamespace(accelerator=acc, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                          tokenizer=tokenizer, fmt=fmt, problems=problems, eval_problems=eval_problems, probe=probe,
                          pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, out=out,
                          identity=identity, handoff_check=handoff.sync(acc, model, sampler, probe, "at the start"),
                          one_row=one_row_attention(acc.unwrap_model(model)),
                          peers=accel.peers(cfg.peer_timeout_s, "train"))
    run.tool = CodeTool(workers=cfg.tool_workers, timeout=cfg.tool_timeout, memory_mb=cfg.tool_memory_mb,
                        max_output_chars=cfg.tool_max_output_chars, backend=cfg.tool_backend,
                        require_isolation=cfg.tool_require_isolation, error_format=cfg.tool_error_format)
    default_pool().start()  # the answer checkers import sympy while the first rollout runs, not after it
    return step, run


def one_row_attention(model) -> bool:
    """Whether the model's attention keeps packed sequences apart at the cost of their own lengths only (flash
    attention's varlen kernels, which read the sequences from position_ids in a batch of one row): then a packed
    micro-batch is one row (schedule.layout_for)."""
    return "flash" in str(getattr(model.config, "_attn_implementation", ""))


def make_sampler(cfg: TrainConfig, model, tokenizer):
    if cfg.sampler == "vllm":
        from accelerate import PartialState
        state = PartialState()
        # One engine per rank: under torchrun / accelerate launch, vLLM's external launcher gives each rank's
        # engine its own device (LOCAL_RANK); sampling seeds differ per rank.
        launcher = {"distributed_executor_backend": "external_launcher"} if state.num_processes > 1 else {}
        return VLLMSampler(cfg.model_path, tokenizer, seed=cfg.seed + state.process_index, dtype=cfg.vllm_dtype,
                           gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                           tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                           enforce_eager=cfg.vllm_enforce_eager, **launcher)
    return HFSampler(model, tokenizer, batch_size=cfg.rollout_batch_size)


# Shown on the step line above a threshold: the sampler-trainer gap (an fp32 engine's is ~1e-6, rounding in another
# summation order; a bf16 engine's ~1e-2: bench/sampler_gap.py), and the ranks' rollout time spent waiting for the
# slowest rank (schedule.py).
SHOWN_ABOVE = {"mismatch/logp_abs_diff_mean": ("gap", 1e-3), "perf/rollout_wait_frac": ("wait", 0.2)}


def log_line(step: int, m: dict) -> str:
    keys = [("reward", "rollout/reward_mean"), ("acc", "eval/accuracy"), ("err+", "rollout/tool_error_rate_in_correct"),
            ("calls", "rollout/tool_calls_mean"), ("len", "rollout/response_tokens_mean"),
            ("trunc", "rollout/truncated_frac"), ("equal", "roc/equal_group_frac"), ("tok/s", "perf/tokens_per_s")]
    keys += [(name, k) for k, (name, above) in SHOWN_ABOVE.items() if m.get(k, 0.0) > above]
    return f"step {step:4d} " + " ".join(f"{name} {m[k]:.3g}" for name, k in keys if k in m)


def main(argv=None) -> None:
    cfg = parse_cli(TrainConfig, argv, usage=USAGE)
    if cfg.dry_run:
        world = cfg.world_size or int(os.environ.get("WORLD_SIZE", 1))
        validate(cfg, world)
        print("\n".join(plan_lines(cfg, world)))
        return
    with accel.process_group_ends():  # on every way out, errors included (accel.py, point 4)
        run_stage(cfg)


def run_stage(cfg: TrainConfig) -> None:
    """Set-up, the steps (each logged and checkpointed), model/ at the end."""
    step, run = setup(cfg)
    acc, log_path = run.accelerator, run.out / "metrics.jsonl"
    bar = tqdm(total=cfg.steps, initial=step, desc=f"stage {cfg.stage}", disable=not acc.is_main_process)
    try:
        while step < cfg.steps:
            try:
                metrics = accel.reduce_sums(acc, train_step(step, cfg, run))
            except FloatingPointError as e:  # raised on every rank alike, before the weights change
                raise SystemExit(f"train: step {step + 1}: {e}; stopped, the last good checkpoint: "
                                 f"{latest_checkpoint(run.out) or 'none yet'}") from None
            step += 1
            if run.eval_problems and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps):
                start = time.perf_counter()
                metrics.update(held_out_eval(cfg, run, step))
                metrics["perf/eval_s"] = time.perf_counter() - start
            if acc.is_main_process:
                with open(log_path, "a") as f:
                    f.write(json.dumps({"step": step, "stage": cfg.stage, **metrics}) + "\n")
                if step % cfg.log_every == 0 or step == cfg.steps:
                    bar.write(log_line(step, metrics))
            if cfg.report_to:
                acc.log(metrics, step=step)
            bar.update(1)
            if step % cfg.save_every == 0 or step == cfg.steps:
                save_checkpoint(acc, run.out, step, {"stage": cfg.stage, "identity": run.identity,
                                                     "prompts_consumed": step * cfg.prompts_per_step},
                                keep_last=cfg.keep_checkpoints)
        # model/ in the dtype the stage started from (the masters stay fp32 in the checkpoints), whole or absent
        save_model(acc, run.model, run.tokenizer, run.out / "model", input_dtype(cfg.model_path))
        if acc.is_main_process:
            plot_curves(log_path, run.out / "curves.png")
            print(f"saved {run.out / 'model'} and {run.out / 'curves.png'}")
    finally:
        run.tool.close()
        bar.close()
        if hasattr(run.sampler, "close"):  # vLLM, on every way out: after the last collective, before the process
            run.sampler.close()            # group ends under it (see VLLMSampler.close)
    acc.end_training()


if __name__ == "__main__":
    main()
