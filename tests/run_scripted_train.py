"""`python tests/run_scripted_train.py [train.py args]`: train.py's real entry point with the scripted policy
(tests/scripted_policy.py), for tests that need a separate process (SIGKILL, torchrun). SCRIPTED_RNG=1 makes the
policy's answers depend on the global torch RNG; CPU_FSDP=1 lets Accelerate's FSDP run on CPU processes
(tests/cpu_fsdp.py); SKIP_GATHER=1 makes the hand-off skip the gather of a sharded trainer, so the sampler's own
copy never receives the weights (what the hand-off check must catch). Each rank writes rank{R}.json (world size,
weight checksum) and sampler{R}.pt (the weights its sampler holds at the end); RECORD=1 records what each rank
rolled out and trained on (`record_inputs`); WATCH_GRADS=1 records the whole gradients each rank holds after every
backward (`watch_unsharded_grads`); COUNT_ALL_REDUCE=1 records how many all-reduces FSDP2 ran across replicas in every
backward, and where each optimizer step fell (`count_replica_all_reduces`); FAULT=stop|kill:RANK:STEP[:PHASE] makes a
rank stop or die during a step's rollouts or another phase (`inject_fault`); SLOW=RANK:PHASE:SECONDS slows one;
ALTER_PLAN=RANK alters one rank's update plan (`alter_plan`); EXIT_BEFORE_GROUP=RANK makes that rank exit once
before the process group starts (its launcher restarts it alone); LOGPROBS_RANKS=0,2 gives log-probs from those
ranks' samplers only (all: every rank's; unset: none)."""
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from plumbing import accel  # noqa: E402
from plumbing import handoff  # noqa: E402
import train  # noqa: E402
from plumbing import rl_stage  # noqa: E402
from scripted_policy import ScriptedSampler, weights_sum  # noqa: E402

def unsharded_grad_elements(model) -> int:
    """Elements of whole (unsharded) gradients FSDP2 holds for the model's parameters: what it keeps between
    backwards when gradient sync is off (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), plus any parameter
    gradient that is not a DTensor shard."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    held = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            for group in filter(None, getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]):
                for p in group.fsdp_params:
                    for g in (p.unsharded_accumulated_grad, getattr(p._unsharded_param, "grad", None)
                              if hasattr(p, "_unsharded_param") else None):
                        held += g.numel() if g is not None else 0
    return held + sum(p.grad.numel() for p in model.parameters()
                      if p.grad is not None and not isinstance(p.grad, DTensor))


def watch_unsharded_grads(out: Path, rank: int) -> None:
    """WATCH_GRADS=1: after every backward, each rank appends to grads{R}.jsonl the elements of whole gradients it
    holds (`unsharded_grad_elements`) and the model's parameter count."""
    import accelerate
    real = accelerate.Accelerator.backward

    def backward(self, loss, **kwargs):
        real(self, loss, **kwargs)
        model = self._models[0]
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"grads{rank}.jsonl", "a") as f:
            f.write(json.dumps({"held": unsharded_grad_elements(model),
                                "params": sum(p.numel() for p in model.parameters())}) + "\n")
    accelerate.Accelerator.backward = backward


def count_replica_all_reduces(out: Path, rank: int) -> None:
    """COUNT_ALL_REDUCE=1: each rank appends to allreduce{R}.jsonl, after every backward, the all-reduces FSDP2's
    gradient reduction issued during it (HSDP's across replicas: torch's _fsdp_collectives.foreach_reduce calls
    torch.distributed.all_reduce), and a row {"step": true} at every optimizer step."""
    import inspect
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    real_all_reduce, real_backward, real_step = torch.distributed.all_reduce, accelerate.Accelerator.backward, \
        AcceleratedOptimizer.step
    seen = [0]

    def write(row):
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"allreduce{rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def all_reduce(*args, **kwargs):
        if "_fsdp_collectives" in inspect.stack()[1].filename:
            seen[0] += 1
        return real_all_reduce(*args, **kwargs)

    def backward(self, loss, **kwargs):
        real_backward(self, loss, **kwargs)
        write({"all_reduces": seen[0]})
        seen[0] = 0

    def step(self, *args, **kwargs):
        write({"step": True})
        return real_step(self, *args, **kwargs)
    torch.distributed.all_reduce, accelerate.Accelerator.backward, AcceleratedOptimizer.step = all_reduce, backward, step


def inject_fault(spec: str, mark: Path) -> None:
    """FAULT=stop|kill:RANK:STEP[:PHASE]: rank RANK sends itself SIGSTOP or SIGKILL at its first claim of training
    step STEP (from 0), or as it enters PHASE of that step (accel.Peers.phase: "score gather", "update", "hand-off",
    "checkpoint", ...), once per run folder: it first writes `mark` ({"pid", "time"}), and a restarted worker that
    finds the mark goes on. The rollout asks for work before its first engine step whether or not any is left, so
    the fault lands in the step's rollouts even where the other ranks have claimed every rollout of it.
    SLOW=RANK:PHASE:SECONDS makes rank RANK spend that long (its main thread asleep) as it enters PHASE of every
    step: a slow but live rank."""
    import schedule
    kind, rank, step, *phase = spec.split(":")
    if int(os.environ.get("RANK", 0)) != int(rank):
        return
    real_train_step, real_claim, real_phase, now = train.train_step, schedule.Claims.__call__, accel.Peers.phase, [None]

    def fault():
        if now[0] == int(step) and not mark.exists():
            mark.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            os.kill(os.getpid(), {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}[kind])

    def train_step(s, cfg, run):
        now[0] = s
        return real_train_step(s, cfg, run)

    def claim(self, running):
        if not phase:
            fault()
        return real_claim(self, running)

    def enter(self, what, where=None):
        real_phase(self, what, where)
        if phase and what == phase[0]:
            fault()
    train.train_step, schedule.Claims.__call__, accel.Peers.phase = train_step, claim, enter


def slow_down(spec: str) -> None:
    """SLOW=RANK:PHASE:SECONDS (see inject_fault)."""
    rank, phase, seconds = spec.split(":")
    if int(os.environ.get("RANK", 0)) != int(rank):
        return
    real_phase = accel.Peers.phase

    def enter(self, what, where=None):
        real_phase(self, what, where)
        if what == phase:
            time.sleep(float(seconds))
    accel.Peers.phase = enter


def alter_plan(rank: str) -> None:
    """ALTER_PLAN=RANK: that rank's update plan gets one more filler slot in its first mini-batch than every other
    rank's (a rank that computed another plan: without the digest check, a hang in the update's collectives)."""
    if int(os.environ.get("RANK", 0)) != int(rank):
        return
    from plumbing import update_plan
    real = update_plan.plan_update

    def plan_update(tokens, owners, minibatch, updates, world, *args):
        plan = real(tokens, owners, minibatch, updates, world, *args)
        plan[0].append([update_plan.MicroBatch([], 0) for _ in range(world)])
        return plan
    update_plan.plan_update = plan_update


def record_inputs(out: Path, rank: int) -> None:
    """RECORD=1: each rank appends, per rollout() call, the problems it rolled out (rollouts{R}.jsonl), and per
    update_policy() call, each rollout it trains as (digest of its tokens, advantage, mini-batch) (kept{R}.jsonl)."""
    import hashlib
    real_rollout, real_update = train.rollout, train.update_policy

    def write(name, row):
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{name}{rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def rollout(problems, *args, **kwargs):
        trajs = real_rollout(problems, *args, **kwargs)  # what it played out, claimed prompts included
        write("rollouts", {"temperature": kwargs.get("temperature"), "problems": sorted(t.problem for t in trajs)})
        return trajs

    def update_policy(acc, model, optimizer, scheduler, work, *args, **kwargs):
        digest = lambda t: hashlib.sha1(str(t.prompt_ids + t.response_ids).encode()).hexdigest()[:12]  # noqa: E731
        write("kept", sorted([digest(t), round(t.advantage, 6), u] for u, slots in enumerate(work.minibatches)
                             for micro in slots for t in micro.items()))
        return real_update(acc, model, optimizer, scheduler, work, *args, **kwargs)
    train.rollout = rl_stage.rollout = rollout  # training and held-out rollouts (rl_stage.held_out_eval)
    train.update_policy = update_policy


if __name__ == "__main__":
    if os.environ.get("CPU_FSDP") == "1":
        import cpu_fsdp
        cpu_fsdp.enable()
    if os.environ.get("SKIP_GATHER") == "1":
        real_hand_off = handoff.hand_off
        handoff.hand_off = lambda acc, model, sampler: (None if accel.is_sharded(acc.unwrap_model(model))
                                                        else real_hand_off(acc, model, sampler))
    made = []
    if os.environ.get("WATCH_GRADS") == "1":
        watch_unsharded_grads(Path(next(a for a in sys.argv[1:] if a.startswith("out_dir=")).split("=", 1)[1]),
                              int(os.environ.get("RANK", 0)))
    if os.environ.get("COUNT_ALL_REDUCE") == "1":
        count_replica_all_reduces(Path(next(a for a in sys.argv[1:] if a.startswith("out_dir=")).split("=", 1)[1]),
                                  int(os.environ.get("RANK", 0)))
    if os.environ.get("RECORD") == "1":  # what each rank rolled out and trained on, for the invariance tests
        record_inputs(Path(next(a for a in sys.argv[1:] if a.startswith("out_dir=")).split("=", 1)[1]),
                      int(os.environ.get("RANK", 0)))

    out_dir = Path(next(a for a in sys.argv[1:] if a.startswith("out_dir=")).split("=", 1)[1])
    if os.environ.get("FAULT"):
        inject_fault(os.environ["FAULT"], out_dir.parent / f"{out_dir.name}.fault")
    if os.environ.get("EXIT_BEFORE_GROUP", "none") == os.environ.get("RANK", "0"):  # once per run folder, early
        early = out_dir.parent / f"{out_dir.name}.early"
        if not early.exists():
            early.write_text(os.environ.get("TORCHELASTIC_RESTART_COUNT", ""))
            os._exit(3)
    if os.environ.get("ALTER_PLAN"):
        alter_plan(os.environ["ALTER_PLAN"])
    if os.environ.get("SLOW"):
        slow_down(os.environ["SLOW"])
    with_logprobs = os.environ.get("LOGPROBS_RANKS", "")

    def make(cfg, model, tokenizer):
        rank = os.environ.get("RANK", "0")
        shift = 0.0 if with_logprobs == "all" or rank in with_logprobs.split(",") else None
        made.append(ScriptedSampler(model, tokenizer, use_rng=os.environ.get("SCRIPTED_RNG") == "1",
                                    logprob_shift=shift, slots=cfg.rollout_batch_size))
        return made[-1]

    rl_stage.make_sampler = make

    def run():
        train.main(sys.argv[1:])
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        weights = {k: v.detach().flatten()[:4].tolist() for k, v in made[0].model.state_dict().items()}
        (out_dir / f"rank{rank}.json").write_text(json.dumps({"world_size": world, "weights": weights,
                                                              "checksum": weights_sum(made[0].model)}))
        torch.save({k: v.detach().clone() for k, v in made[0].model.state_dict().items()},
                   out_dir / f"sampler{rank}.pt")
    accel.run_and_exit(run)  # as the entry points end (plumbing/accel.py, point 4)
