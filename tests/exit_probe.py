"""`python tests/exit_probe.py SCRIPT ARGS...` (under torchrun): runs SCRIPT as its command line would and, as the
very last thing before the interpreter shuts down, writes $PROBE_DIR/rank{RANK}.json: whether a process group was
still alive then (one left alive can abort the exit: plumbing/accel.py, point 4) and how the script ended."""
import atexit
import json
import os
import runpy
import sys
from pathlib import Path

ended = {"exit": None}


def record() -> None:
    import torch.distributed as dist
    left = dist.is_available() and dist.is_initialized()
    path = Path(os.environ["PROBE_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps({"group_left_alive": left, **ended}))


if __name__ == "__main__":
    atexit.register(record)  # registered first, so it runs after every handler registered later
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        ended["exit"] = str(e.code)
        raise
