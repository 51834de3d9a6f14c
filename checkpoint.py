"""Crash-safe checkpoints for sft.py and train.py (resume after a lost machine, to the same weights and metrics).

A checkpoint is a folder `checkpoint-{step}` in the run folder holding what Accelerate's `save_state` writes
(model, optimizer, scheduler, and every process's RNG states: python, numpy, torch, device) plus our
`trainer_state.json` (step, stage, data position, anything else the loop needs to continue exactly).

Written so that a kill at any moment leaves a loadable checkpoint:
1. everything is written into `checkpoint-{step}.tmp` (a half-written folder is never read);
2. the main process renames it to `checkpoint-{step}` (atomic on one filesystem);
3. then it replaces the one-line file `latest` (write `latest.tmp`, fsync, `os.replace`), which is what resume reads;
4. only then are checkpoints older than the newest `keep_last` removed.
A kill between 2 and 3 leaves `latest` on the previous complete checkpoint.
"""
import json
import os
import shutil
from pathlib import Path

STATE_FILE = "trainer_state.json"


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def latest_checkpoint(run_dir) -> Path | None:
    """The checkpoint `latest` points to, or None when the run folder has none."""
    pointer = Path(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = Path(run_dir) / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise RuntimeError(f"{pointer} points to {path}, which is not a complete checkpoint")
    return path


def save_checkpoint(accelerator, run_dir, step: int, state: dict, keep_last: int = 2) -> Path:
    """Save model/optimizer/scheduler/RNG (via Accelerate) and `state` (JSON) as checkpoint-{step}; all ranks call."""
    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f"checkpoint-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_write(tmp / STATE_FILE, json.dumps({"step": step, **state}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_write(run_dir / "latest.tmp", final.name + "\n")
        os.replace(run_dir / "latest.tmp", run_dir / "latest")
        steps = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*") if p.name[11:].isdigit())
        for old in steps[:-keep_last]:
            shutil.rmtree(run_dir / f"checkpoint-{old}", ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path) -> dict:
    """Restore what save_checkpoint saved into the prepared objects; returns the trainer state dict."""
    accelerator.load_state(str(path))
    return json.loads((Path(path) / STATE_FILE).read_text())


def resume_point(cfg, out: Path) -> Path | None:
    """Which checkpoint to continue from. A folder that already holds a run is never silently started over."""
    latest = latest_checkpoint(out)
    has_log = (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0
    if cfg.resume == "never":
        if latest or has_log:
            raise SystemExit(f"resume error: {out} already holds a run; use another out_dir or resume=auto")
        return None
    if cfg.resume == "auto":
        if latest is None and has_log:
            raise SystemExit(f"resume error: {out} has metrics.jsonl but no checkpoint to continue from; "
                             f"use another out_dir or remove that folder")
        return latest
    path = Path(cfg.resume)
    if not (path / STATE_FILE).is_file():
        raise SystemExit(f"resume error: {path} is not a checkpoint folder (no {STATE_FILE})")
    return path


def truncate_log(path: Path, last_step: int) -> None:
    """Keep only log lines up to the checkpoint's step, so a resumed run's log has each step once."""
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
        path.write_text("".join(r + "\n" for r in rows))
