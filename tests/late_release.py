"""`torchrun --nproc_per_node 2 tests/late_release.py MODE OUT_DIR`: the abort at exit of plumbing/accel.py (point 4),
set up on purpose, and the way the entry points end their processes, which leaves it no time to happen.

Each rank makes a gloo group and keeps it (as Accelerate's and FSDP2's state keep theirs), and all-reduces a gradient
from inside a backward, so the collective carries the backward's Python context. Rank 1 joins it only once rank 0 has
let go of its reference to it, and rank 0 does not wait for it: it holds the GIL in a computation meanwhile (until
rank 1 says the all-reduce is done, and 1 s more), as a busy main thread does while a worker thread on a loaded
machine is late. Rank 0's gloo worker finishes the collective and then waits for the GIL to release it.
MODE plain: the script ends; the interpreter shuts down and hands the worker the GIL while it frees an object (0.5 s):
the worker is ended mid-release and the process aborts (10 runs of 10 on a quiet 2-core VM; about 2 in 3 beside a
full test run, where the worker is sometimes still not waiting when the shutdown begins). MODE entry: the same work
through `accel.run_and_exit`. Both modes clear the atexit handlers (torch's and logging's included): one that writes
lets go of the GIL before the shutdown, and a worker that takes it then is in time. Each rank writes
OUT_DIR/rank{R}.json once its group is up.
"""
import atexit
import json
import mmap
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from plumbing import accel  # noqa: E402

RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[2])
GROUPS = []  # alive to the end of the process, as the groups an Accelerator's state refers to


class SlowToFree:
    """Freed in the interpreter's shutdown, slowly (as a large model can be), with the GIL let go meanwhile."""
    def __del__(self):
        time.sleep(0.5)


def work() -> None:
    sys.setswitchinterval(60)  # from here on rank 0 lets go of the GIL only when it blocks
    flag_path = OUT / "joined"
    if RANK == 0:
        flag_path.write_bytes(b"\0\0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                          int(os.environ["WORLD_SIZE"]), RANK == 0)
    group = dist.ProcessGroupGloo(store, RANK, int(os.environ["WORLD_SIZE"]), timedelta(seconds=60))
    GROUPS.append(group)
    group.barrier().wait()  # both ranks set up (outside a backward: this collective carries no Python context)
    (OUT / f"rank{RANK}.json").write_text(json.dumps({"pid": os.getpid()}))
    with open(flag_path, "r+b") as f:
        flags = mmap.mmap(f.fileno(), 2)  # [0]: rank 1's all-reduce is done; [1]: rank 0 has let go of its own
    pending = []
    x = torch.ones(4, requires_grad=True)
    x.register_hook(lambda grad: pending.append(group.allreduce([grad.clone()])) or grad)
    if RANK == 1:
        while flags[1] == 0:
            time.sleep(0.01)
    (2 * x).sum().backward()
    if RANK == 1:
        pending[0].wait()
        flags[0] = 1
        return
    pending.clear()  # the worker thread now holds the collective's last reference
    flags[1] = 1
    start = time.perf_counter()  # hold the GIL until the all-reduce is done and 1 s more (reading memory keeps it)
    while flags[0] == 0 and time.perf_counter() - start < 60:
        pass
    start = time.perf_counter()
    while time.perf_counter() - start < 1:
        pass


held = SlowToFree()
atexit._clear()  # no handler at exit: one that writes lets go of the GIL before the shutdown (see above)
if sys.argv[1] == "entry":
    accel.run_and_exit(work)
work()
