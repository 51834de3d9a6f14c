"""Crash-safe checkpoints for sft.py and train.py, the rules for continuing a run, atomic file writes, and reading
another run's optimizer state (train.py's `optimizer_from`).

A checkpoint is a folder `checkpoint-{step}` in the run folder holding what Accelerate's `save_state` writes
(model, optimizer, scheduler, and every process's RNG states: python, numpy, torch, device) plus our
`trainer_state.json` (step, data position, the run's config and data digests, the order it was written in).

Written so that a kill or a power cut at any moment leaves a loadable checkpoint:
1. everything is written into `checkpoint-{step}.tmp` (a half-written folder is never read);
2. every file in it and the folder itself are fsynced, and so is the run's metrics.jsonl (the log on disk is then
   at least as new as the checkpoint);
3. the main process renames it to `checkpoint-{step}` (atomic on one filesystem) and fsyncs the run folder;
4. then it replaces the one-line file `latest` (write, fsync, rename, fsync the folder): what resume reads;
5. only then are older checkpoints removed, in the order they were written (`written` in trainer_state.json,
   not the step number: a run resumed from an early checkpoint writes smaller steps later), keeping the newest
   `keep_last` and always the one `latest` names.
A kill before 4 leaves `latest` on the previous complete checkpoint.

Continuing a run (`resume_point`, then `begin_run` on the main process):
- resume=auto: from the checkpoint `latest` names. A folder with a log but no checkpoint (a run stopped before its
  first save) starts over; its log and config are kept in `stopped-{n}/`. A folder with `model/` and no checkpoint
  (a finished run that saved none) is refused.
- resume=never: a folder that holds a run is refused.
- resume=PATH: from that checkpoint. Refused when out_dir holds another run: the resumed run would cut that run's
  metrics.jsonl back to PATH's step. In PATH's own folder, `latest` moves back to PATH and the log is cut there.
- The checkpoint records the run's config and the sha256 of its data files; a resume whose config or data differ
  is refused with the list of differences, except for the keys the entry point declares free (logging, checkpoint
  cadence, threads: they change no number the run computes) and the keys named in `resume_allow_changes`.

A run's output, `model/` (`save_model`), is written in the dtype its input checkpoint came in (`input_dtype`): both
entry points train fp32 master weights, but a stage that read a bf16 Qwen3-Base hands the next stage bf16 (half the
bytes every engine of the next stage reads), with `dtype` in config.json saying so. Checkpoints keep the fp32 masters.
"""
import copy
import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

STATE_FILE = "trainer_state.json"
LOG_FILE = "metrics.jsonl"


# ============================================================================ durable files and folders
def fsync_dir(path) -> None:
    """Make a folder's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder, deepest first."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync_file(os.path.join(root, name))
        fsync_dir(root)


def atomic_write_text(path, text: str) -> None:
    """Replace `path` with `text` so that a kill or power cut leaves either the old file or the new one, whole."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def staging_dir(final) -> Path:
    """An empty folder `final.tmp` beside `final`, to write into before `replace_dir` (leftovers of a kill go)."""
    tmp = Path(final).with_name(Path(final).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def replace_dir(tmp, final) -> None:
    """Make the complete folder `tmp` appear as `final`, fsynced first. An existing `final` is renamed to
    `final.old` and removed afterwards (a folder cannot be renamed over a non-empty one)."""
    tmp, final = Path(tmp), Path(final)
    _fsync_tree(tmp)
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


# ============================================================================ the run's output model
def input_dtype(model_path):
    """The torch dtype a checkpoint folder or hub id was saved in: config.json's `dtype` (`torch_dtype` before
    transformers 5), float32 where it names none."""
    import torch
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def save_model(accelerator, model, tokenizer, out, dtype) -> None:
    """`out` = save_pretrained of the whole model with its floating-point weights cast to `dtype` (config.json's
    `dtype` says so), and the tokenizer; every rank calls it (under FSDP the weights are gathered to the main
    process). With a LoRA adapter, `out` holds the merged model and `adapter/` beside it the adapter in PEFT's
    format (plumbing/lora.py). Written into `out.tmp` and renamed, so `out` is whole or absent."""
    from plumbing import lora
    accelerator.wait_for_everyone()
    state = accelerator.get_state_dict(model)  # under FSDP: the full weights on the main process (all ranks join)
    if accelerator.is_main_process:
        policy = accelerator.unwrap_model(model)
        if lora.is_lora(policy):  # the adapter as PEFT saves it, then the merged model
            adapter = staging_dir(Path(out).with_name("adapter"))
            lora.save_adapter(policy, state, adapter)
            replace_dir(adapter, Path(out).with_name("adapter"))
            state, policy = lora.merged_state_dict(state, lora.scalings(policy), dtype), policy.get_base_model()
        tmp = staging_dir(out)
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        policy.save_pretrained(tmp, state_dict=state)
        config = copy.deepcopy(policy.config)  # the live model keeps its own
        config.dtype = str(dtype).removeprefix("torch.")  # save_pretrained wrote the parameters' dtype (fp32)
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, out)
    accelerator.wait_for_everyone()


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _parse_line(raw: bytes) -> tuple[str, dict] | None:
    """(text, object) of one line of an append-only JSONL log, or None for what a kill or power cut can leave (a
    partial line, a blank one, NUL bytes) and anything else that is not a JSON object."""
    try:
        line = raw.replace(b"\0", b"").decode("utf-8").strip()
        row = json.loads(line) if line else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return (line, row) if isinstance(row, dict) else None


def read_jsonl_rows(path):
    """Yield (text, object) for each good line of a JSONL log (see _parse_line), reading one line at a time."""
    with open(path, "rb") as f:
        for raw in f:
            if (parsed := _parse_line(raw)) is not None:
                yield parsed


def filter_jsonl(path, keep) -> None:
    """Keep only the good lines of `path` whose object satisfies `keep`. When anything goes, the file is replaced
    atomically (new file, fsync, rename); otherwise it is left alone."""
    path = Path(path)
    if not path.is_file():
        return

    def lines():
        with open(path, "rb") as f:
            for raw in f:
                parsed = _parse_line(raw)
                yield raw, (parsed[0] if parsed is not None and keep(parsed[1]) else None)
    if all(line is not None and raw == (line + "\n").encode() for raw, line in lines()):
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for _, line in lines() if line is not None)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ============================================================================ checkpoints
def latest_checkpoint(run_dir) -> Path | None:
    """The checkpoint `latest` points to, or None when the run folder has none."""
    pointer = Path(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = Path(run_dir) / pointer.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise RuntimeError(f"{pointer} points to {path}, which is not a complete checkpoint")
    return path


def _checkpoints(run_dir: Path) -> list[tuple[int, int, Path]]:
    """(written, step, folder) of every complete checkpoint in the run folder, oldest write first."""
    found = []
    for p in run_dir.glob("checkpoint-*"):
        if p.name[len("checkpoint-"):].isdigit() and (p / STATE_FILE).is_file():
            state = json.loads((p / STATE_FILE).read_text())
            found.append((state.get("written", 0), state["step"], p))
    return sorted(found)


def _point_latest(run_dir: Path, checkpoint: Path) -> None:
    atomic_write_text(run_dir / "latest", checkpoint.name + "\n")


def save_checkpoint(accelerator, run_dir, step: int, state: dict, keep_last: int = 2) -> Path:
    """Save model/optimizer/scheduler/RNG (via Accelerate) and `state` (JSON) as checkpoint-{step}; all ranks call.
    keep_last: checkpoints kept (at least 1: the newest, which `latest` names)."""
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
        written = 1 + max((w for w, _, _ in _checkpoints(run_dir)), default=0)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "written": written,
                                                  "world_size": accelerator.num_processes, **state}, indent=1))
        if (run_dir / LOG_FILE).is_file():
            _fsync_file(run_dir / LOG_FILE)
        replace_dir(tmp, final)
        _point_latest(run_dir, final)
        prune(run_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def prune(run_dir, keep_last: int) -> None:
    """Remove all but the `keep_last` (>= 1) most recently written checkpoints; never the one `latest` names.
    Half-written `.tmp` folders of earlier kills go too (they are never read)."""
    run_dir = Path(run_dir)
    latest = latest_checkpoint(run_dir)
    found = _checkpoints(run_dir)
    for _, _, folder in found[:max(len(found) - max(keep_last, 1), 0)]:  # none while fewer than keep_last exist
        if latest is None or folder.name != latest.name:
            shutil.rmtree(folder, ignore_errors=True)
    for partial in run_dir.glob("checkpoint-*.tmp"):
        shutil.rmtree(partial, ignore_errors=True)


def load_checkpoint(accelerator, path) -> dict:
    """Restore what save_checkpoint saved into the prepared objects; returns the trainer state dict.
    Another number of processes than the run that wrote it is fine: the model and optimizer are whole (DDP) or
    resharded on load (FSDP's sharded checkpoints), and the trainer state holds no per-rank position. What does not
    carry over is each rank's RNG stream, which drives only sampling (a rank without a saved one keeps its seed's).
    A checkpoint of the other layout (whole vs FSDP-sharded) is refused with one line."""
    from accelerate.utils import DistributedType
    sharded = any(Path(path).glob("pytorch_model_fsdp*"))
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if sharded != fsdp:
        written, now = ("an FSDP", "without FSDP") if sharded else ("a non-FSDP", "under FSDP")
        raise SystemExit(f"resume error: {path} was written by {written} launch and this one runs {now}; resume "
                         f"it with the launch config it was written with (any number of processes), or start over "
                         f"from its model/ in another out_dir")
    state = json.loads((Path(path) / STATE_FILE).read_text())
    saved_world = state.get("world_size", accelerator.num_processes)
    if saved_world != accelerator.num_processes:
        accelerator.print(f"resuming {path}, written by {saved_world} process(es), on {accelerator.num_processes}: "
                          f"weights, optimizer, learning rate and data position carry over; sampling RNG streams "
                          f"are per rank and do not")
    accelerator.load_state(str(path))
    return state


OPTIMIZER_FILES = ("optimizer.bin", "optimizer_0")  # Accelerate's save_state: whole, or sharded (FSDP's DCP folder)


def optimizer_file(path: str) -> Path:
    """The AdamW state of a checkpoint folder, or of a run folder's latest checkpoint (OPTIMIZER_FILES)."""
    folder = Path(path)
    if not any((folder / f).exists() for f in OPTIMIZER_FILES) and (folder / "latest").is_file():
        folder = latest_checkpoint(folder)
    for name in OPTIMIZER_FILES:
        if (folder / name).exists():
            return folder / name
    raise SystemExit(f"input error: optimizer_from={path}: no optimizer.bin or optimizer_0/ there or in its "
                     "latest checkpoint")


def load_optimizer(accelerator, model, optimizer, file: Path) -> None:
    """Another run's AdamW state into the prepared optimizer: under FSDP through Accelerate's loader (each rank
    reads its shard of a sharded checkpoint), else optimizer.bin."""
    from accelerate.utils import DistributedType, load_fsdp_optimizer
    if accelerator.distributed_type == DistributedType.FSDP:
        load_fsdp_optimizer(accelerator.state.fsdp_plugin, accelerator, optimizer, model, str(file.parent))
    elif file.name != "optimizer.bin":
        raise SystemExit(f"input error: optimizer_from: {file} is a sharded FSDP checkpoint; launch with an FSDP "
                         "Accelerate config to read it")
    else:
        import torch
        optimizer.load_state_dict(torch.load(file, weights_only=False))


# ============================================================================ continuing a run
def run_identity(cfg, data_files) -> dict:
    """What a checkpoint records of the run that wrote it: the resolved config and the sha256 of each data file."""
    config = json.loads(json.dumps(dataclasses.asdict(cfg)))
    return {"config": config, "data_sha256": {str(f): file_sha256(f) for f in data_files}}


def config_changes(saved: dict, now: dict, free) -> dict[str, str]:
    """{key: "old -> new"} where `now` (run_identity) differs from `saved`, leaving out the keys in `free` ("data"
    also covers the files' contents). Keys the saved config does not have (fields added since) are not compared."""
    changes = {}
    for key, value in now["config"].items():
        if key not in free and key in saved["config"] and saved["config"][key] != value:
            changes[key] = f"{saved['config'][key]!r} -> {value!r}"
    if "data" not in free:
        for path, digest in now["data_sha256"].items():
            before = saved.get("data_sha256", {}).get(path)
            if before is not None and before != digest:
                changes["data"] = f"the content of {path} changed (sha256 {before[:12]}... -> {digest[:12]}...)"
    return changes


def _holds_run(out: Path) -> bool:
    return ((out / "latest").is_file() or (out / "model").is_dir() or any(_checkpoints(out))
            or ((out / LOG_FILE).is_file() and (out / LOG_FILE).stat().st_size > 0))


def resume_point(cfg, out, identity: dict, free) -> Path | None:
    """Which checkpoint to continue from (None: start at step 0); refuses, with one line saying why, what would
    lose or rewrite a run's history. No side effects (every rank calls it); `begin_run` acts on the answer.
    cfg needs `resume` and `resume_allow_changes`; identity: `run_identity` of this invocation; free: config keys
    that may change on resume without being named in resume_allow_changes."""
    out = Path(out)
    latest = latest_checkpoint(out)
    if cfg.resume == "never":
        if _holds_run(out):
            raise SystemExit(f"resume error: {out} already holds a run; use another out_dir or resume=auto")
        return None
    if cfg.resume == "auto":
        if latest is None and (out / "model").is_dir():
            raise SystemExit(f"resume error: {out} holds a finished run (model/) and no checkpoint to continue from; "
                             f"use another out_dir or remove that folder")
        start = latest
    else:
        start = Path(cfg.resume)
        if not (start / STATE_FILE).is_file():
            raise SystemExit(f"resume error: {start} is not a checkpoint folder (no {STATE_FILE})")
        if start.resolve().parent != out.resolve() and _holds_run(out):
            raise SystemExit(f"resume error: resume={start} continues the run in {start.parent}, but out_dir={out} "
                             f"holds another run, whose metrics.jsonl would be cut back to step "
                             f"{json.loads((start / STATE_FILE).read_text())['step']}; use an empty out_dir "
                             f"(or resume=auto to continue the run in {out})")
    if start is not None:
        saved = json.loads((start / STATE_FILE).read_text()).get("identity")
        changes = config_changes(saved, identity, set(free) | set(cfg.resume_allow_changes)) if saved else {}
        if changes:
            raise SystemExit(f"resume error: {start} was written with another config: "
                             + "; ".join(f"{k}: {v}" for k, v in changes.items())
                             + f". To continue it with the new values pass resume_allow_changes=[{','.join(changes)}];"
                             f" to start over use another out_dir")
    return start


def begin_run(out, start: Path | None) -> None:
    """Main process, after resume_point and every input check: make the folder agree with the starting point.
    Starting over: a log left by a run stopped before its first checkpoint (and its config.yaml, and any checkpoint
    written without `latest`) moves to stopped-{n}/, never overwritten. Continuing: `latest` names the start and
    metrics.jsonl is cut back to its step."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / LOG_FILE
    if start is None:
        stale = [p for p in [log, out / "config.yaml"] + sorted(out.glob("checkpoint-*")) if p.exists()]
        if log.is_file() and log.stat().st_size > 0:
            n = 1
            while (out / f"stopped-{n}").exists():
                n += 1
            aside = out / f"stopped-{n}"
            aside.mkdir()
            for p in stale:
                if p.name.endswith(".tmp"):
                    shutil.rmtree(p, ignore_errors=True)  # half-written: never read
                else:
                    os.replace(p, aside / p.name)
            fsync_dir(out)
            print(f"{out} held a run stopped before its first checkpoint: starting over, its log kept in {aside}")
        return
    latest = latest_checkpoint(out)
    if start.resolve().parent == out.resolve() and (latest is None or latest.resolve() != start.resolve()):
        _point_latest(out, start)  # resumed from an earlier checkpoint of this run: the later ones are abandoned
    truncate_log(log, json.loads((start / STATE_FILE).read_text())["step"])


def truncate_log(path, last_step: int) -> None:
    """Keep only log lines up to the checkpoint's step, so a resumed run's log has each step once. Damaged lines
    (see _parse_line) are dropped; the log is replaced atomically."""
    filter_jsonl(path, lambda row: isinstance(row.get("step"), int) and row["step"] <= last_step)
