"""`torchrun --nproc_per_node 2 tests/late_release.py MODE OUT_DIR`: the abort at exit of plumbing/accel.py (point 4),
made to happen on every run, and the way the entry points end their processes, which leaves it no time to happen.

Each rank makes a gloo group and keeps it (as Accelerate's and FSDP2's state keep theirs), and all-reduces a gradient
from inside a backward, so the collective carries the backward's Python context. Rank 1 joins it 1 s late, and rank 0
does not wait for it: it holds the GIL in a 2 s computation meanwhile, as a busy main thread does while a worker thread
on a loaded machine is late. Rank 0's gloo worker finishes the collective and then waits for the GIL to release it.
MODE plain: the script ends; the interpreter shuts down and hands the worker the GIL while it frees an object (0.5 s):
the worker is ended mid-release and the process aborts. MODE entry: the same work through `accel.run_and_exit`.
Both modes clear the atexit handlers (torch's and logging's included): one that writes lets go of the GIL before the
shutdown, and a worker that takes it then is in time. Each rank writes OUT_DIR/rank{R}.json once its group is up."""
import atexit
import json
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
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                          int(os.environ["WORLD_SIZE"]), RANK == 0)
    group = dist.ProcessGroupGloo(store, RANK, int(os.environ["WORLD_SIZE"]), timedelta(seconds=60))
    GROUPS.append(group)
    group.barrier().wait()  # both ranks set up (outside a backward: this collective carries no Python context)
    (OUT / f"rank{RANK}.json").write_text(json.dumps({"pid": os.getpid()}))
    pending = []
    x = torch.ones(4, requires_grad=True)
    x.register_hook(lambda grad: pending.append(group.allreduce([grad.clone()])) or grad)
    if RANK == 1:
        time.sleep(1)
    (2 * x).sum().backward()
    if RANK == 1:
        pending[0].wait()
    pending.clear()  # rank 0: the worker thread now holds the collective's last reference
    sys.setswitchinterval(60)  # hold the GIL through the computation below
    start = time.perf_counter()
    while time.perf_counter() - start < 2:
        pass


held = SlowToFree()
atexit._clear()  # no handler at exit: one that writes lets go of the GIL before the shutdown (see above)
if sys.argv[1] == "entry":
    accel.run_and_exit(work)
work()
