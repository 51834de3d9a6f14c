"""CPU threads for torch: one policy for sft.py, train.py and eval.py (their `torch_threads` config field).

Why a policy: torch's default is one intra-op thread per core, and its OpenMP threads spin while they wait for one
another. When another program takes a core, every parallel operation waits for the thread that lost it: the tiny
SFT with one busy process beside it on 2 cores ran 4-15x slower (`bench/contention.py` shows it side by side).

The policy (`torch_threads`, the same meaning in all three configs):
- N >= 1: exactly N threads. The tiny RL and evaluation configs pin 1: the code tool's workers and, in
  `make tiny`, an evaluation beside the training use the other core.
- 0 (the default; the tiny SFT config): OMP_NUM_THREADS when it is set; otherwise as many threads as there are
  free cores when the process starts: the cores it may run on (`os.sched_getaffinity`) minus those other programs
  kept busy over a quarter of a second (/proc/stat), at least one, split among the processes a launcher starts on
  this machine (LOCAL_WORLD_SIZE; with several, nothing is subtracted: they are all starting up at once). So a
  busy program already running costs its core, not a collapse; the tiny model's results do not depend on the
  count (its SFT weights are the same with one thread and with two).
- Waiting threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE) unless the environment already chose a wait
  policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT for GNU OpenMP, which torch's Linux wheels bundle, or KMP_BLOCKTIME for
  Intel's and LLVM's): a sleeping thread gives its core back, so the scheduler can run a descheduled sibling there
  at once, which limits the damage of a program that starts later. The OpenMP runtime reads these variables once,
  when torch loads: the entry points import this module before torch, and a process that loaded torch earlier
  keeps the runtime's default.
"""
import os
import time

WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
if not any(v in os.environ for v in WAIT_POLICY_VARIABLES):
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
BUSY_WINDOW_S = 0.25  # how long `torch_threads: 0` watches the machine's cores before choosing


def usable_cores() -> set[int]:
    """The cores this process may run on (its affinity mask: taskset, cgroup cpusets)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))


def _core_times() -> dict[int, tuple[int, int]]:
    """Per core, from /proc/stat: (all ticks, idle ticks): user nice system idle iowait irq softirq steal."""
    times = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                ticks = [int(x) for x in fields[:8]]
                times[int(name[3:])] = (sum(ticks), ticks[3] + ticks[4])
    return times


def busy_cores(cores: set[int], seconds: float = BUSY_WINDOW_S) -> float:
    """How many of `cores` were busy over the next `seconds` (this process sleeps meanwhile, so it is other
    programs); 0.0 where /proc/stat cannot be read."""
    try:
        before = _core_times()
        time.sleep(seconds)
        after = _core_times()
    except OSError:
        return 0.0
    busy = 0.0
    for c in cores & before.keys() & after.keys():
        total, idle = after[c][0] - before[c][0], after[c][1] - before[c][1]
        busy += (total - idle) / total if total > 0 else 0.0
    return busy


def resolve_threads(requested: int, cores: int, local_processes: int = 1, env_threads: int | None = None,
                    busy: float = 0.0) -> int:
    """The thread count for a `torch_threads` value: requested if >= 1; for 0, env_threads (OMP_NUM_THREADS) if
    given, else (cores - round(busy)) // local_processes, at least 1."""
    if requested < 0:
        raise ValueError(f"torch_threads must be >= 0 (0: automatic), got {requested}")
    if requested:
        return requested
    if env_threads:
        return env_threads
    return max(1, (cores - round(busy)) // max(1, local_processes))


def set_torch_threads(requested: int) -> int:
    """Apply the policy to this process (call it after any launcher set-up, which may set its own count);
    returns the number of threads torch now uses."""
    import torch
    env = os.environ.get("OMP_NUM_THREADS", "")
    env_threads = int(env) if env.isdigit() else None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    cores = usable_cores()
    busy = busy_cores(cores) if requested == 0 and env_threads is None and local == 1 else 0.0
    torch.set_num_threads(resolve_threads(requested, len(cores), local, env_threads, busy))
    return torch.get_num_threads()
