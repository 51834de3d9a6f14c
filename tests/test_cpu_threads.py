"""The torch thread policy (plumbing/cpu_threads.py): the count each `torch_threads` value gives, the wait policy set before
torch loads in every entry point, and a user's own environment left alone."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plumbing.cpu_threads import busy_cores, resolve_threads

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.spec
@pytest.mark.parametrize("requested, cores, local, env, busy, expected", [
    (1, 16, 1, None, 0.0, 1),    # an explicit count is used as given
    (3, 2, 1, 8, 2.0, 3),        # ... even over OMP_NUM_THREADS and busy cores
    (0, 2, 1, None, 0.0, 2),     # automatic: the free cores
    (0, 2, 1, None, 0.9, 1),     # one of two busy
    (0, 2, 1, None, 0.4, 2),     # a core busy less than half the time still counts as free
    (0, 2, 1, None, 2.0, 1),     # at least one
    (0, 16, 1, None, 3.2, 13),
    (0, 16, 4, None, 0.0, 4),    # split among the processes a launcher started on this machine
    (0, 16, 32, None, 0.0, 1),
    (0, 16, 1, 4, 0.0, 4),       # OMP_NUM_THREADS is the user's choice
])
def test_resolve_threads(requested, cores, local, env, busy, expected):
    assert resolve_threads(requested, cores, local, env, busy) == expected


@pytest.mark.spec
def test_resolve_threads_refuses_a_negative_count():
    with pytest.raises(ValueError, match="torch_threads must be >= 0"):
        resolve_threads(-1, 4)


def run_python(code: str, **env_changes) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
                                                           "OMP_NUM_THREADS")}
    env.update(env_changes)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


# Records OMP_WAIT_POLICY at the moment torch starts loading (the OpenMP runtime reads it then).
WATCH_TORCH = """
import importlib.abc, os, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and "seen" not in globals():
            globals()["seen"] = os.environ.get("OMP_WAIT_POLICY")
        return None
sys.meta_path.insert(0, Watch())
import {module}
import torch  # eval.py loads torch only when it loads a model
print(seen)
"""


@pytest.mark.parametrize("module", ["sft", "train", "eval"])
def test_entry_points_choose_passive_waiting_before_torch_loads(module):
    assert run_python(WATCH_TORCH.format(module=module)) == "PASSIVE"


def test_a_wait_policy_in_the_environment_is_left_alone():
    code = "import os; from plumbing import cpu_threads; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert run_python(code, GOMP_SPINCOUNT="10000") == "None"
    assert run_python(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_busy_cores_sees_a_busy_loop():
    """A loop pinned to core 0 keeps that core busy; busy_cores counts it (other programs may add to it)."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    try:
        time.sleep(0.5)  # started and spinning
        assert busy_cores({0}, 0.5) >= 0.8
    finally:
        loop.kill()
        loop.wait()


def test_set_torch_threads_applies_the_policy():
    one_core = "import os; os.sched_setaffinity(0, {0}); "
    code = "from plumbing import cpu_threads; import torch; print(cpu_threads.set_torch_threads({}), torch.get_num_threads())"
    assert run_python(one_core + code.format(0)) == "1 1"  # one usable core: one thread
    assert run_python(code.format(2)) == "2 2"
    assert run_python(code.format(0), OMP_NUM_THREADS="3") == "3 3"
