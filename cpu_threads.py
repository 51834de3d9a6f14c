"""CPU threads for torch: one policy for sft.py, train.py and eval.py (their `torch_threads` config field).

Why a policy: torch's default is one intra-op thread per core, and its OpenMP threads spin while they wait for one
another. When another program takes a core, every parallel operation waits for the thread that lost it: the tiny
SFT with one busy process beside it on 2 cores ran 4-15x slower (`bench/contention.py` shows it side by side).

The policy (`torch_threads`, the same meaning in all three configs):
- N >= 1: exactly N threads. The tiny configs pin 1: this model's operations are small (a second thread gains
  little), one thread gives the same numbers on any machine, and the second core is left to the code tool's
  workers and to whatever else the machine runs, so another busy program costs a share, not a collapse.
- 0 (the default): OMP_NUM_THREADS when it is set; otherwise one thread fewer than the cores this process may run
  on (`os.sched_getaffinity`), split among the processes a launcher starts on this machine (LOCAL_WORLD_SIZE), and
  at least one. The core left over absorbs the tool's workers or one other busy program.
- Waiting threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE) unless the environment already chose a wait
  policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT for GNU OpenMP, which torch's Linux wheels bundle, or KMP_BLOCKTIME for
  Intel's and LLVM's): a sleeping thread gives its core back, so the scheduler can run a descheduled sibling there
  at once. The OpenMP runtime reads these variables once, when torch loads: the entry points import this module
  before torch, and a process that loaded torch earlier keeps the runtime's default.
"""
import os

WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
if not any(v in os.environ for v in WAIT_POLICY_VARIABLES):
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: taskset, cgroup cpusets), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_threads(requested: int, cores: int, local_processes: int = 1, env_threads: int | None = None) -> int:
    """The thread count for a `torch_threads` value: requested if >= 1; for 0, env_threads (OMP_NUM_THREADS) if
    given, else (cores - 1) // local_processes, at least 1."""
    if requested < 0:
        raise ValueError(f"torch_threads must be >= 0 (0: automatic), got {requested}")
    if requested:
        return requested
    if env_threads:
        return env_threads
    return max(1, (cores - 1) // max(1, local_processes))


def set_torch_threads(requested: int) -> int:
    """Apply the policy to this process (call it after any launcher set-up, which may set its own count);
    returns the number of threads torch now uses."""
    import torch
    env = os.environ.get("OMP_NUM_THREADS", "")
    n = resolve_threads(requested, usable_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
                        int(env) if env.isdigit() else None)
    torch.set_num_threads(n)
    return torch.get_num_threads()
