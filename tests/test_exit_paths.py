"""How an entry point ends when something is left running or a rank fails (plumbing/accel.py, point 4): a live
thread pool does not keep the process alive after `main()`; a failed rank, and a watchdog that names a silent one,
abort a group that runs NCCL, however the group was started; and on an error path the sampler's own shutdown (vLLM's
destroys the launcher's group gracefully) does not run before the group is ended. The multi-process ones run on 2 CPU
processes under torchrun."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plumbing.data import write_jsonl
from ports import free_port
from scripted_policy import say_problems
from tiny.model import build_tiny

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}

IDLE_POOL = """
import concurrent.futures, sys
from plumbing import accel
pool = concurrent.futures.ThreadPoolExecutor(1)  # referenced to the end, as an engine's or a tokenizer's would be

def main():
    print(pool.submit(sum, [1, 2]).result())  # its worker now waits for more work
    if sys.argv[1] == "code":
        raise SystemExit(3)
    if sys.argv[1] == "error":
        raise ValueError("boom")

accel.run_and_exit(main)
"""


@pytest.mark.parametrize("mode, code", [("return", 0), ("code", 3), ("error", 1)])
def test_exit_ends_promptly_with_an_idle_thread_pool_left(tmp_path, mode, code):
    script = tmp_path / "entry.py"
    script.write_text(IDLE_POOL)
    try:
        done = subprocess.run([sys.executable, str(script), mode], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode}: still running 30 s after main() ended (an idle ThreadPoolExecutor worker joined)")
    assert (done.returncode, done.stdout) == (code, "3\n")
    assert mode != "error" or "ValueError: boom" in done.stderr


NCCL_GROUP = """
import atexit, json, os, sys
import torch
import torch.distributed as dist
from plumbing import accel
c10d, out = dist.distributed_c10d, sys.argv[1]
seen = {"aborted": False}
atexit.register(lambda: open(f"{out}/rank{os.environ['RANK']}.json", "w").write(json.dumps(seen)))

accel.start_process_group(60)
# The backends torch records for this group on a GPU machine: its BackendConfig built as torch builds it there
# (the accelerator it detects is CUDA); the collectives still run over gloo, which is all a CPU has.
on_cpu = torch._C._get_accelerator
torch._C._get_accelerator = lambda: torch.device("cuda")
c10d._world.pg_backend_config[c10d._get_default_group()] = str(c10d.BackendConfig(dist.get_backend()))
torch._C._get_accelerator = on_cpu
seen["backend"], seen["backends"] = dist.get_backend(), dist.get_backend_config()

def abort(group=None):  # NCCL's abort, recorded; the CPU group is then destroyed
    seen["aborted"] = True
    dist.destroy_process_group()

c10d._abort_process_group = abort

def main():
    dist.all_reduce(torch.ones(1))
    raise RuntimeError("a failed step")

accel.run_and_exit(main)
"""


def test_a_failed_rank_of_an_nccl_group_takes_the_abort(tmp_path):
    script, out = tmp_path / "entry.py", tmp_path / "out"
    script.write_text(NCCL_GROUP)
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script), str(out)]
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "RuntimeError: a failed step" in done.stderr, done.stderr[-2000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    # started without naming a backend, as start_process_group does: "undefined", with NCCL for CUDA under it
    assert ranks == [{"aborted": True, "backend": "undefined", "backends": "cuda:nccl"}] * 2


WATCHED_NCCL_GROUP = """
import os, sys, time
import torch
import torch.distributed as dist
from plumbing import accel
c10d, out, rank = dist.distributed_c10d, sys.argv[1], int(os.environ["RANK"])

accel.start_process_group(60)
on_cpu = torch._C._get_accelerator  # the backends torch records on a GPU machine, as in NCCL_GROUP above
torch._C._get_accelerator = lambda: torch.device("cuda")
c10d._world.pg_backend_config[c10d._get_default_group()] = str(c10d.BackendConfig(dist.get_backend()))
torch._C._get_accelerator = on_cpu

def abort(group=None):  # NCCL's abort, recorded at once: the watchdog ends the process with os._exit
    open(f"{out}/aborted{rank}", "w").write(dist.get_backend())

c10d._abort_process_group = abort
if rank == 1:  # rank 1 runs no watchdog: to rank 0 it is silent from the start
    accel.Peers.watch = lambda self, store=None, abort=None: None
accel.peers(2, "t")
time.sleep(60)  # as if blocked in a collective: only rank 0's watchdog can end it
"""


def test_the_watchdog_aborts_an_nccl_group_started_without_naming_a_backend(tmp_path):
    script, out = tmp_path / "entry.py", tmp_path / "out"
    script.write_text(WATCHED_NCCL_GROUP)
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script), str(out)]
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "t: set-up: rank 1 made no progress for 2 s" in done.stderr, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["aborted0"]  # rank 0's watchdog took NCCL's abort
    assert (out / "aborted0").read_text() == "undefined"  # though get_backend() says nothing of NCCL


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("teardown")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "say.jsonl", say_problems(4))
    return root


def on_two_ranks(tmp_path: Path, entry: str, args: list[str], crash: bool):
    probe = tmp_path / "probe"
    probe.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "--monitor-interval", "3", str(ROOT / "tests" / "run_teardown.py"), entry, *args]
    done = subprocess.run(command, cwd=ROOT, env={**ENV, "PROBE_DIR": str(probe), "CRASH": "1" if crash else "0"},
                          capture_output=True, text=True, timeout=300)
    return done, [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]


def train_args(tiny: Path, out: Path) -> list[str]:
    return ["configs/tiny/stage1.yaml", f"model_path={tiny / 'base'}", f"data=[{tiny / 'say.jsonl'}]",
            "eval_data=null", f"out_dir={out}", "prompts_per_step=2", "rollouts_per_prompt=4", "group_size=4",
            "steps=1", "max_response_tokens=32", "torch_threads=1", "tool_workers=1",
            "schedule=static"]  # each rank rolls out its own share, so each meets the error


def eval_args(tiny: Path, out: Path) -> list[str]:
    return ["configs/tiny/eval.yaml", f"benchmarks=[{tiny / 'say.jsonl'}]", "samples=1", "limit=2",
            f"model_path={tiny / 'base'}", f"out_dir={out}"]


@pytest.mark.parametrize("entry, args", [("train", train_args), ("eval", eval_args)])
def test_an_error_skips_the_sampler_s_graceful_teardown(tiny, tmp_path, entry, args):
    done, ranks = on_two_ranks(tmp_path, entry, args(tiny, tmp_path / "out"), crash=True)
    assert done.returncode != 0 and "scripted crash in a rollout" in done.stderr, done.stderr[-2000:]
    # the group was still up when it ended as failed (eval.py and run_and_exit each end it), and nothing closed it
    assert [r[0] for r in ranks] == ["end failed=True group_up=True"] * 2 and not any("close" in r for r in ranks)


def test_a_clean_eval_keeps_the_teardown_order(tiny, tmp_path):
    # the engine closes after the last collective and before the group ends (the group is gone when it does)
    done, ranks = on_two_ranks(tmp_path, "eval", eval_args(tiny, tmp_path / "out"), crash=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r[:2] for r in ranks] == [["close", "end failed=False group_up=False"]] * 2
