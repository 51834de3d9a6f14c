"""Every entry point ends the process group it starts, on every way out: a group left alive at exit lets gloo's and
NCCL's worker threads abort the interpreter's shutdown one time in a few (plumbing/accel.py, point 4). Each case runs on 2
processes under torchrun and reads, from the last moment of each process, whether a group was still alive."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from plumbing import accel
from plumbing.data import write_jsonl
from scripted_policy import say_problems
from tiny.model import build_tiny

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ends")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "say.jsonl", say_problems(4))
    write_jsonl(root / "sft.jsonl", [{"messages": [{"role": "user", "content": "Say 1."},
                                                   {"role": "assistant", "content": "</reason>\n1"}]}])
    return root


def on_two_ranks(tmp_path: Path, port: int, script: str, *args: str):
    probe = tmp_path / "probe"
    probe.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(ROOT / "tests" / "exit_probe.py"), script, *args]
    done = subprocess.run(command, cwd=ROOT, env={**ENV, "PROBE_DIR": str(probe)}, capture_output=True, text=True,
                          timeout=300)
    ranks = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    return done, ranks


def test_train_ends_the_group_when_it_stops_on_bad_input(tiny, tmp_path):
    # the data file is read after the Accelerator has set up the group: this SystemExit leaves from inside it
    done, ranks = on_two_ranks(tmp_path, 29661, "train.py", "configs/tiny/stage1.yaml", "data=[nope.jsonl]",
                               "eval_data=null", f"model_path={tiny / 'base'}", f"out_dir={tmp_path / 'out'}")
    assert done.returncode != 0 and "input error" in done.stderr
    assert [r["group_left_alive"] for r in ranks] == [False, False]
    assert all("input error" in r["exit"] for r in ranks)


def test_sft_ends_the_group_when_it_stops_after_setting_it_up(tiny, tmp_path):
    done, ranks = on_two_ranks(tmp_path, 29662, "sft.py", "configs/tiny/sft.yaml", f"data={tiny / 'sft.jsonl'}",
                               "max_seq_len=8", "micro_batch_size=4", f"model_path={tiny / 'base'}", f"out_dir={tmp_path / 'out'}")
    assert done.returncode != 0 and "longer than max_seq_len" in done.stderr
    assert [r["group_left_alive"] for r in ranks] == [False, False]


def test_eval_ends_the_group_after_a_finished_run(tiny, tmp_path):
    done, ranks = on_two_ranks(tmp_path, 29663, "eval.py", "configs/tiny/eval.yaml", f"benchmarks=[{tiny / 'say.jsonl'}]",
                               "samples=1", "limit=2", f"model_path={tiny / 'base'}", f"out_dir={tmp_path / 'out'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "results.json").exists()
    assert [r["group_left_alive"] for r in ranks] == [False, False] and [r["exit"] for r in ranks] == [None, None]


def test_the_accelerator_test_helper_ends_its_group(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done, ranks = on_two_ranks(tmp_path, 29664, "tests/run_accel.py", "policy", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "rank1.json").exists()
    assert [r["group_left_alive"] for r in ranks] == [False, False]


def test_process_group_ends_on_an_error_and_lets_the_error_through(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="boom"):
        with accel.process_group_ends():
            raise ValueError("boom")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with accel.process_group_ends():
        pass
    assert not dist.is_initialized()
    with accel.process_group_ends():  # no group: nothing to do
        pass
