"""One stage of agentic RL with GRPO-RoC (rStar2-Agent report, sections 3-4 and 6), on plain PyTorch + Accelerate.

    python train.py configs/tiny/stage1.yaml                       # one process (CPU or one GPU)
    accelerate launch --config_file configs/accelerate/fsdp_1node_8gpu.yaml train.py configs/qwen3-14b/stage1.yaml

Each step, in labelled phases (the banners in `train_step`):
  1. claim the step's B x 2G rollouts, a few at a time as this rank's engine frees up (schedule.py)
  2. rollout: 2G multi-turn rollouts per prompt with the Python tool (rollout.py)
  3. reward: 0/1 on the final answer (reward.py)
  4. drop equal groups (all right or all wrong)                    } grpo_roc.select_step
  5. Resample-on-Correct: 2G -> G per group                         }
  6. advantages per kept group: A_i = (r_i - mean) / (std + 1e-6)   grpo_roc.group_advantages
  7. old log-probs under the policy before the update
  8. policy update: mini-batches of micro-batches, gradient accumulation, the exact global token normaliser
     (`minibatch_normalisers`); the micro-batch slots by tokens, as many on every rank (plumbing/update_plan.py)
  9. hand the new weights to the sampler, and verify they arrived (log-probs of a fixed sequence; plumbing/handoff.py)
 10. the step's numbers; `run_stage` then logs them (metrics.jsonl, tqdm, trackers) and checkpoints
A stage is one invocation; the multi-stage recipe is a sequence of them (configs/*/stage{1,2,3}.yaml), each starting
from the previous stage's `model/`. Stage 3's data is the problems the stage-2 policy did not solve k of k times
(`eval.py ... unsolved_out=...`), and it starts with a fresh optimizer; stage 2 may carry stage 1's (`optimizer_from`).
The policy trains as fp32 master weights (checkpoints keep them); `model/` is written in the dtype the stage read
(bf16 from a Qwen3-Base lineage), so each stage hands the next what a hub checkpoint would be.

Exact token normalisation across micro-batches and ranks: each micro-batch's loss is its masked token sum divided by
the token count of the whole mini-batch over all ranks, times the world size (DDP/FSDP average gradients over
ranks, which the factor undoes). The accumulated gradient is then exactly that of one big batch on one process.
Ranks hold different numbers and lengths of kept rollouts, so every rank computes one plan of micro-batch slots from
the gathered scores (as many slots on every rank; the ranks compare its digest) and trains its planned slots, a
rank with nothing for a slot a filler (two pad tokens, nothing under the loss mask): every rank joins every
collective. A mini-batch with no kept rollout on any rank has no slots and takes no optimizer or scheduler step.

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

from plumbing import cpu_threads  # noqa: F401  (first: it sets OpenMP's wait policy, which is read when torch loads)
import torch
from tqdm import tqdm

from grpo_roc import LOSSES, group_advantages, penalty_total, select_step
from mismatch import CORRECTIONS, mismatch_sums, sequence_log_ratios, sequence_mismatch
from reward import score_trajectories
from rollout import rollout
from schedule import gather_scores, step_claims
from plumbing.update_plan import layout_for, update_work
from plumbing import accel, handoff
from plumbing.batches import make_batch, token_logprobs
from plumbing.checkpoint import input_dtype, latest_checkpoint, save_checkpoint, save_model
from plumbing.config import parse_cli
from plumbing.rl_stage import Stage, held_out_eval, log_line, save_rollouts, setup, step_metrics
from plumbing.train_config import USAGE, TrainConfig, plan_lines, validate
from tools.plots import plot_curves


# ============================================================================ one RL step (phases 1-10)
def train_step(step: int, cfg: TrainConfig, run: Stage) -> dict:
    """Phases 1-10 for one step on this rank; returns {name: (sum, count)} to be reduced over ranks."""
    acc, K, B = run.accelerator, cfg.rollouts_per_prompt, cfg.prompts_per_step
    t0 = time.perf_counter()
    # ---------------------------------------------------------------- 1-2. claim rollouts, play them out
    indices = prompt_indices(step, B, len(run.problems), cfg.seed)
    run.peers.start(step)
    run.peers.phase("rollouts")  # where this rank is, for the watchdog's line (plumbing/accel.py, 7)
    claims = step_claims(cfg.schedule, step, [run.problems[i]["problem"] for i in indices], K,
                         cfg.rollout_batch_size, cfg.claim_size, cfg.seed, run.peers, cfg.claim_rule, run.sampler)
    trajs = rollout([], run.sampler, run.tool, run.tokenizer, run.fmt, max_response_tokens=cfg.max_response_tokens,
                    max_turns=cfg.max_turns, temperature=cfg.temperature, top_p=cfg.top_p,
                    sync_turns=cfg.sync_turns, progress=acc.is_local_main_process, more=claims, seeds=claims.seed)
    t_rollout = time.perf_counter() - t0
    run.peers.wait("rollouts")  # for the slowest rank, with a heartbeat: a silent one stops the run (plumbing/accel.py, 5)
    # ---------------------------------------------------------------- 3. reward: 0/1 on the final answer
    golds = [run.problems[indices[slot // K]]["answer"] for slot in claims.slots]
    verdicts = score_trajectories(trajs, golds)  # sets each t.reward
    # ---------------------------------------------------------------- 4-5. drop equal groups, RoC (2G -> G)
    # ... on the whole step: every rank gathers every rollout's reward and penalty counts (not its tokens)
    run.peers.phase("score gather")
    scores = gather_scores(acc, claims.slots, trajs)
    rewards, penalties = step_grids(scores, B, K, step)
    # RoC's random choices: a generator per group, seeded by the group's place in the step (not by the rank)
    gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 10_007 + g) for g in range(B)]
    groups, kept_idx = select_step(rewards, penalties, cfg.group_size, cfg.roc_mode, gens)
    # ---------------------------------------------------------------- 6. advantages per kept group
    # A_i = (r_i - mean_group) / (std_group + 1e-6) over the group's kept rollouts, std unbiased; every token of
    # rollout i gets A_i
    adv = [group_advantages(torch.tensor([float(rewards[g][i]) for i in idx]), len(idx)).tolist()
           for g, idx in zip(groups, kept_idx)]
    kept = kept_slots(groups, kept_idx, adv, K, cfg)  # slot -> (advantage, mini-batch)
    if cfg.save_rollouts_every and (step + 1) % cfg.save_rollouts_every == 0:
        run.peers.phase("rollouts saved")
        save_rollouts(acc, run.out / "rollouts" / f"step_{step + 1:06d}.jsonl", step + 1,
                      [run.problems[indices[slot // K]] for slot in claims.slots], claims.slots, trajs, K, kept)
    # ---------------------------------------------------------------- 7-8. old log-probs, policy update
    # ... on micro-batch slots balanced over ranks by tokens (plumbing/update_plan.py; under schedule `static`, each
    # rank trains its own rollouts)
    t1 = time.perf_counter()
    run.peers.phase("update")
    if hasattr(run.sampler, "sleep"):
        run.sampler.sleep()  # free the sampler's KV cache for the update (colocated vLLM: its weights' memory too)
    work, plan = update_work(acc, scores, kept, dict(zip(claims.slots, trajs)), cfg.updates_per_step,
                             cfg.max_tokens_per_micro_batch, cfg.micro_batch_size, cfg.schedule,
                             layout_for(cfg.max_tokens_per_micro_batch, run.one_row))
    # each mini-batch's loss divides by its kept rollouts' sampled tokens summed over ALL ranks and micro-batches
    # (by their number under loss_agg: sequence)
    normalisers = minibatch_normalisers(scores, kept, cfg)
    lr = run.scheduler.get_last_lr()[0]  # the lr of this step's first optimizer step
    sums = {k if "/" in k else f"loss/{k}": v for k, v in update_policy(
        acc, run.model, run.optimizer, run.scheduler, work, normalisers, cfg, run.pad_id).items()}
    t_update = time.perf_counter() - t1
    # ---------------------------------------------------------------- 9. hand the new weights to the sampler
    run.peers.phase("hand-off")
    run.handoff_check = handoff.sync(acc, run.model, run.sampler, run.probe, f"after step {step + 1}",
                                     run.handoff_check)
    # ---------------------------------------------------------------- 10. the step's numbers, for the log
    run.peers.phase("metrics")
    sums.update(step_metrics(acc, trajs, verdicts, scores, groups, kept, K, plan, lr, rollout=t_rollout,
                             update=t_update, step=time.perf_counter() - t0))
    return sums


# ============================================================================ the policy update (phases 7-8)
def correction_weights(cfg):
    """The configured sampler-trainer correction (mismatch.CORRECTIONS) with its parameters bound, or None."""
    weights = CORRECTIONS[cfg.mismatch_correction]
    params = {"tis": {"cap": cfg.mismatch_tis_cap},
              "seq_mask": {"low": cfg.mismatch_seq_low, "high": cfg.mismatch_seq_high}}
    return partial(weights, **params[cfg.mismatch_correction]) if weights else None


def update_policy(accelerator, model, optimizer, scheduler, work, normalisers: list[int], cfg, pad_id: int) -> dict:
    """Phases 7-8 on this rank's part of the step's update (update_plan.RankWork: its micro-batch slots of every
    mini-batch, the same number of slots on every rank); normalisers: each mini-batch's (`minibatch_normalisers`).
    Returns metrics as {name: (sum, count)}: the loss's, and the sampler-trainer gap on the kept rollouts' sampled
    tokens (`mismatch/*`, from the old log-probs the update computes anyway)."""
    world = accelerator.num_processes
    loss_fn = LOSSES[cfg.loss_agg][0]
    correction = correction_weights(cfg)
    if correction and not work.measured:
        raise SystemExit(f"config error: mismatch_correction={cfg.mismatch_correction} needs the sampler's "
                         "log-probs, and this sampler gives none")
    minibatches = [[make_batch(micro, pad_id, work.measured, cfg.max_tokens_per_micro_batch, accelerator.device)
                    for micro in slots] for slots in work.minibatches]
    # Phase 7: old log-probs under the policy before this step's first update.
    old = old_logprobs(model, minibatches, cfg.temperature)
    # Phase 8: `updates_per_step` optimizer steps (mini-batches), each accumulating its micro-batches.
    sums, seq_log_ratios = {}, []
    for micro, micro_old, normaliser in zip(minibatches, old, normalisers, strict=True):
        if not micro:  # no kept rollout on any rank: no optimizer or scheduler step, the weights stay as they are
            continue
        loss_sum = 0.0
        for j, ((batch, adv, n), old_logp) in enumerate(zip(micro, micro_old)):
            with gradient_sync(accelerator, model, last=j == len(micro) - 1):
                logp = token_logprobs(model, batch, cfg.temperature)
                # the first mini-batch is on policy: old = its own log-probs, ratio 1, so no clip binds there
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
def step_grids(scores: list, groups: int, per_group: int, step: int) -> tuple[list[list[float]], list[list[float]]]:
    """(rewards, penalties), each (B, 2G), from the gathered scores of the step's B x 2G rollouts; one line when
    they are not every rollout of the step once (alike on every rank: the scores are gathered)."""
    if [s.slot for s in scores] != list(range(groups * per_group)):
        raise SystemExit(f"train: step {step + 1}: the ranks rolled out {len(scores)} rollouts "
                         f"({len({s.slot for s in scores})} distinct) of the step's {groups * per_group}")
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


def minibatch_normalisers(scores: list, kept: dict, cfg: TrainConfig) -> list[int]:
    """The exact global normaliser of each mini-batch (phase 8): its kept rollouts' sampled tokens over ALL ranks
    and micro-batches (token-level loss), or their number (`loss_agg: sequence`). Every rank computes it alike from
    the gathered scores: no collective. kept: slot -> (advantage, mini-batch)."""
    counted = LOSSES[cfg.loss_agg][1]  # "tokens" or "sequences"
    out = [0] * cfg.updates_per_step
    for s in scores:
        if s.slot in kept:
            out[kept[s.slot][1]] += s.sampled_tokens if counted == "tokens" else 1
    return out


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


def _add(sums: dict, key: str, value: float, count: float) -> None:
    s = sums.setdefault(key, [0.0, 0.0])
    s[0] += value
    s[1] += count


def main(argv=None) -> None:
    cfg = parse_cli(TrainConfig, argv, usage=USAGE)
    if cfg.dry_run:
        world = cfg.world_size or int(os.environ.get("WORLD_SIZE", 1))
        validate(cfg, world)
        print("\n".join(plan_lines(cfg, world)))
        return
    with accel.process_group_ends():  # on every way out, errors included (plumbing/accel.py, point 4)
        run_stage(cfg)


def optimizer_and_schedule(cfg: TrainConfig, parameters: list) -> tuple:
    """AdamW on the trainable weights, and its learning rate before optimizer step t:
    lr_t = lr * min(1, (t + 1) / warmup_steps), a linear warm-up, then constant (report §4)."""
    optimizer = torch.optim.AdamW(parameters, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / max(cfg.warmup_steps, 1)))
    return optimizer, warmup


def run_stage(cfg: TrainConfig) -> None:
    """Set-up (plumbing/rl_stage.py; the optimizer and its schedule from `optimizer_and_schedule`), the steps (each
    logged and checkpointed), model/ at the end."""
    step, run = setup(cfg, optimizer_and_schedule)
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
                run.peers.phase("checkpoint", f"step {step}")
                save_checkpoint(acc, run.out, step, {"stage": cfg.stage, "identity": run.identity,
                                                     "prompts_consumed": step * cfg.prompts_per_step},
                                keep_last=cfg.keep_checkpoints)
        # model/ in the dtype the stage started from (the masters stay fp32 in the checkpoints), whole or absent
        run.peers.phase("model", f"step {step}")
        save_model(acc, run.model, run.tokenizer, run.out / "model", input_dtype(cfg.model_path))
        if acc.is_main_process:
            plot_curves(log_path, run.out / "curves.png")
            print(f"saved {run.out / 'model'} and {run.out / 'curves.png'}")
    finally:
        run.tool.close()
        bar.close()
        accel.end_sampler(run.sampler)  # vLLM closed on a clean way out only, before the group ends under it
    acc.end_training()


if __name__ == "__main__":
    accel.run_and_exit(main)  # no abort at exit (plumbing/accel.py, point 4)
