"""What sft.py's loop runs on, which a first read can skip: the Accelerator and the micro-batches each rank runs per
optimizer step, a rank's share of a step's window, the stop on a non-finite loss (all ranks together), the metrics
line over ranks, and the resume point (its refusal of a position counted per rank)."""
import json
import math
from pathlib import Path

import torch
from accelerate import Accelerator

from plumbing import accel
from plumbing.checkpoint import STATE_FILE, latest_checkpoint, load_checkpoint
from plumbing.config import tracker_config
from plumbing.sft_config import SFTConfig


def make_accelerator(cfg: SFTConfig) -> tuple[Accelerator, int]:
    """The Accelerator (plumbing/accel.py: trackers, process-group timeout, FSDP2 policy) and the micro-batches each rank
    runs per optimizer step (micro_batch_size * that * world_size == batch_size)."""
    acc = accel.make_accelerator(mixed_precision=cfg.mixed_precision, report_to=cfg.report_to, out_dir=cfg.out_dir,
                                 timeout_s=cfg.process_group_timeout_s, init_timeout_s=cfg.init_timeout_s)
    per_step = cfg.micro_batch_size * acc.num_processes
    if cfg.batch_size % per_step:
        raise SystemExit(f"sft: batch_size={cfg.batch_size} is not a multiple of micro_batch_size * world_size "
                         f"= {cfg.micro_batch_size} * {acc.num_processes}")
    if cfg.report_to:
        acc.init_trackers("sft", config=tracker_config(cfg))
    return acc, cfg.batch_size // per_step


def window_share(window: list, rank: int, world: int) -> tuple[list, int]:
    """This rank's micro-batches of a window (the window's r, r+P, r+2P, ...) and how many micro-batches every rank
    runs: the most any rank has, so that all join every collective (the others run fillers)."""
    return window[rank::world], math.ceil(len(window) / world)


def log_step(acc: Accelerator, metrics_path: Path, row: dict, bar) -> None:
    """Write one metrics line (main process only), send it to the tracker, and print one readable line."""
    if acc.is_main_process:
        with metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        bar.write(f"step {row['step']:>5} | epoch {row['sft/epoch']:.2f} | loss {row['sft/loss']:.4f} | "
                  f"lr {row['sft/lr']:.2e} | {row['perf/tokens_per_s']:,.0f} tok/s")
    if acc.log_with:
        acc.log(row, step=row["step"])


def interval_row(acc: Accelerator, step: int, losses: list, tokens: int, lr: float, steps_per_epoch: int,
                 seconds: float) -> dict:
    """The metrics line of the steps since the last one: the loss averaged over every rank's real micro-batches of
    the interval (fillers are not counted; sums in float64), tokens per second over all ranks."""
    sums = torch.tensor([0.0, len(losses), tokens], dtype=torch.float64, device=acc.device)
    if losses:
        sums[0] = torch.stack(losses).double().sum()
    total, count, all_tokens = acc.reduce(sums, reduction="sum").tolist()
    return {"step": step, "sft/loss": total / max(count, 1), "sft/lr": lr, "sft/epoch": step / steps_per_epoch,
            "perf/tokens_per_s": all_tokens / seconds, "perf/seconds": seconds}


def stop_unless_finite(acc: Accelerator, losses: list, grad_norm, step: int, out: Path) -> None:
    """Stop the run, on every rank together, when a loss since the last log line or the gradient norm is NaN or
    infinite: the weights are not updated, and the last checkpoint stays the newest."""
    values = torch.stack([x.float().to(acc.device) for x in losses]
                         + [torch.as_tensor(grad_norm, dtype=torch.float).to(acc.device)])
    bad = acc.reduce((~torch.isfinite(values)).any().float(), reduction="sum")  # every rank gets the same answer
    if bad.item() > 0:
        raise SystemExit(f"sft: the loss or gradient norm is not finite at step {step}; stopped before updating "
                         f"the weights. The last good checkpoint: {latest_checkpoint(out) or 'none yet'}")


def saved_position(checkpoint: Path | None) -> None:
    """Refuse, in one line, a checkpoint whose data position counts one rank's micro-batches (written before the
    position was made independent of the number of processes): it cannot be placed in the global order."""
    if checkpoint is not None and "windows_in_epoch" not in json.loads((checkpoint / STATE_FILE).read_text()):
        raise SystemExit(f"resume error: {checkpoint} records its data position as one rank's micro-batches (an "
                         f"earlier sft.py), which this one cannot place; start over in another out_dir")


def resume(acc: Accelerator, checkpoint: Path | None, steps_per_epoch: int, window: int) -> tuple[int, tuple]:
    """(step, (epoch, windows done in it)) to start from: (0, (0, 0)), or the checkpoint's, with model, optimizer,
    lr schedule and RNG states restored."""
    if checkpoint is None:
        return 0, (0, 0)
    state = load_checkpoint(acc, checkpoint)
    epoch, done = state["epoch"], state["windows_in_epoch"]
    if done >= steps_per_epoch:  # the checkpoint closed its epoch
        epoch, done = epoch + 1, 0
    acc.print(f"sft: resumed from {checkpoint} at step {state['step']} (epoch {epoch}, {done * window} micro-batches "
              f"in)")
    return state["step"], (epoch, done)
