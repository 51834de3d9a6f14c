"""plumbing/checkpoint.py on its own (no model): pruning order, durability order, the metrics log after a power cut."""
import json
import os
from pathlib import Path

import pytest

from plumbing import checkpoint
from plumbing.checkpoint import latest_checkpoint, save_checkpoint, truncate_log

pytestmark = pytest.mark.spec  # the one-minute tier: make test-fast


class FakeAccelerator:
    """What save_checkpoint uses of Accelerate's Accelerator: one process whose state is one file."""
    is_main_process = True
    num_processes = 1

    def wait_for_everyone(self):
        pass

    def save_state(self, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"weights")
        (Path(folder) / "optimizer.bin").write_bytes(b"moments")


def steps(run: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in run.glob("checkpoint-*") if p.name[11:].isdigit()}


def test_pruning_follows_the_order_of_writing_and_keeps_what_latest_names(tmp_path):
    acc = FakeAccelerator()
    for step in (3, 10):  # a run that saved steps 3 and 10 ...
        save_checkpoint(acc, tmp_path, step, {}, keep_last=2)
    # ... resumed from checkpoint-3 with keep_checkpoints=1: the new checkpoint-4 is the newest, though 10 > 4.
    save_checkpoint(acc, tmp_path, 4, {}, keep_last=1)
    assert latest_checkpoint(tmp_path).name == "checkpoint-4"
    assert steps(tmp_path) == {4}
    # keep_last=2 after a resume from an early checkpoint: the two written last survive, not the two largest steps.
    for step in (5, 10):
        save_checkpoint(acc, tmp_path / "b", step, {}, keep_last=2)
    for step in (6, 7):
        save_checkpoint(acc, tmp_path / "b", step, {}, keep_last=2)
    assert steps(tmp_path / "b") == {6, 7} and latest_checkpoint(tmp_path / "b").name == "checkpoint-7"


def test_pruning_removes_nothing_while_fewer_than_keep_last_exist(tmp_path):
    """keep_last above the number written (before: a negative slice end removed all but the newest)."""
    for step in (1, 2, 3):
        save_checkpoint(FakeAccelerator(), tmp_path, step, {}, keep_last=4)
        assert steps(tmp_path) == set(range(1, step + 1))


def test_checkpoint_files_and_folders_are_durable_before_latest_moves(tmp_path, monkeypatch):
    """A power cut after `latest` moves must find a complete checkpoint: every file and folder fsynced first."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    save_checkpoint(FakeAccelerator(), tmp_path, 1, {}, keep_last=2)
    moved = events.index(("replace", str(tmp_path / "latest")))
    synced = {path for kind, path in events[:moved] if kind == "fsync"}
    folder = tmp_path / "checkpoint-1"
    for name in ("model.safetensors", "optimizer.bin", "trainer_state.json"):
        # the files were fsynced in the .tmp folder, before its rename to checkpoint-1
        assert str(tmp_path / "checkpoint-1.tmp" / name) in synced or str(folder / name) in synced, name
    assert str(tmp_path / "checkpoint-1.tmp") in synced  # the folder's entries
    assert str(tmp_path) in synced  # the rename of checkpoint-1.tmp to checkpoint-1
    assert str(tmp_path / "metrics.jsonl") in synced  # the log is at least as new as the checkpoint
    assert ("fsync", str(tmp_path)) in events[moved:]  # and the pointer's own rename


@pytest.mark.parametrize("tail", [b'{"step": 5, "loss": 0.2', b"\n\n", b"\0" * 64, b'{"step": 5, "lo\0\0\0\n\n'])
def test_truncate_log_survives_what_a_power_cut_leaves_and_replaces_the_file(tmp_path, tail):
    log = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "sft/loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    log.write_bytes(("\n".join(lines) + "\n").encode() + tail)
    before = log.stat().st_ino
    truncate_log(log, 3)
    assert log.read_text() == "\n".join(lines[:3]) + "\n"  # the kept lines byte for byte, the damage gone
    after = log.stat().st_ino
    assert after != before  # a new file renamed into place, never a rewrite in place
    truncate_log(log, 9)  # nothing to drop: the file is left alone
    assert log.read_text() == "\n".join(lines[:3]) + "\n" and log.stat().st_ino == after


def test_atomic_write_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    target.write_text("old")

    def fail(fd):
        raise OSError("disk full")
    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        checkpoint.atomic_write_text(target, "new")
    assert target.read_text() == "old"
