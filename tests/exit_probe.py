"""`python tests/exit_probe.py SCRIPT ARGS...` (under torchrun): runs SCRIPT as its command line would and, as the
last thing before the process ends (the last atexit handler, which `accel.run_and_exit` runs too), writes
$PROBE_DIR/rank{RANK}.json: whether a process group was still alive then (plumbing/accel.py, point 4)."""
import atexit
import json
import os
import runpy
import sys
from pathlib import Path

def record() -> None:
    import torch.distributed as dist
    left = dist.is_available() and dist.is_initialized()
    path = Path(os.environ["PROBE_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps({"group_left_alive": left}))


if __name__ == "__main__":
    atexit.register(record)  # registered first, so it runs after every handler registered later
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
