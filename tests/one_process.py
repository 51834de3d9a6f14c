"""What train_step hands train.update_policy on one process, for tests that call the update directly."""
from types import SimpleNamespace

import schedule
from plumbing import update_plan
import train

ONE = SimpleNamespace(num_processes=1, process_index=0, device="cpu")  # the Accelerator's fields the plan reads


def one_process_work(kept: list, cfg, one_row: bool = False):
    """kept: [(rollout.Trajectory, advantage)] of one step, in step order, cut into mini-batches as train.minibatch_of
    cuts a step's kept rollouts; planned and laid out by update_plan.update_work as on one process. Returns the
    update_plan.RankWork, the plan's metrics and the mini-batches' normalisers (train.minibatch_normalisers)."""
    trajs = [t for t, _ in kept]
    slots = list(range(len(trajs)))
    size = 1 if cfg.max_tokens_per_micro_batch else cfg.micro_batch_size
    minibatch = train.minibatch_of([len(kept)], cfg.updates_per_step, size)[0]
    chosen = {s: (a, m) for s, (_, a), m in zip(slots, kept, minibatch)}
    scores = schedule.gather_scores(ONE, slots, trajs)
    work, metrics = update_plan.update_work(ONE, scores, chosen, dict(zip(slots, trajs)), cfg.updates_per_step,
                                            cfg.max_tokens_per_micro_batch, cfg.micro_batch_size, cfg.schedule,
                                            update_plan.layout_for(cfg.max_tokens_per_micro_batch, one_row))
    return work, metrics, train.minibatch_normalisers(scores, chosen, cfg)
