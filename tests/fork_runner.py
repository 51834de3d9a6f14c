"""`python tests/fork_runner.py`: start sft.py, train.py and eval.py runs, many times, cheaply, for kill tests.

A kill test restarts an entry point a dozen times; a fresh interpreter spends about 2 s of CPU importing torch,
transformers and accelerate each time. This process imports them once and forks a child per run: the child runs the
entry point's main exactly as `python sft.py ARGS` would (its own process, its own output file, nothing shared with
earlier runs but the files on disk), so SIGKILL hits it with no chance to clean up, as it would hit `python sft.py`.
The parent never runs torch code before forking (no thread pools to inherit).

Protocol, one JSON line per run on stdin: ["sft" | "train" | "eval", [ARGS...], OUTPUT_FILE]. The answer is a line
"pid N" when the child starts and "exit S" when it ends (S: the wait status, -9 after SIGKILL). "train" uses the
scripted policy whose answers come from the global torch RNG (tests/scripted_policy.py), so an exact resume needs
the RNG restored.
"""
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import eval as ev  # noqa: E402
import sft  # noqa: E402
import train  # noqa: E402
from plumbing import rl_stage  # noqa: E402
from scripted_policy import ScriptedSampler  # noqa: E402
# transformers imports a model's code on first use (seconds): import what the tiny model uses here, once
from tiny.model import Qwen3ForCausalLM, PreTrainedTokenizerFast  # noqa: E402, F401
from accelerate import Accelerator  # noqa: E402, F401


def entry_point(name: str, args: list[str]) -> None:
    if name == "sft":
        sft.train(sft.parse_cli(sft.SFTConfig, args))
    elif name == "train":
        rl_stage.make_sampler = lambda cfg, model, tokenizer: ScriptedSampler(model, tokenizer, use_rng=True)
        train.main(args)
    else:  # the same scripted answers (integers: no slow answer checks, whose time limit a loaded machine can hit)
        from transformers import AutoTokenizer
        ev.load_model = lambda cfg: (ScriptedSampler(None, tok := AutoTokenizer.from_pretrained(cfg.model_path),
                                                     use_rng=True), tok)
        ev.main(args)


def child(name: str, args: list[str], output: str) -> int:
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        entry_point(name, args)
        return 0
    except SystemExit as e:  # what the interpreter would print and return
        if e.code not in (None, 0):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    for line in sys.stdin:
        name, args, output = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(child(name, args, output))
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
