"""Where the tiny SFT's time goes, and what cuts it, side by side in one run.

    .venv/bin/python bench/sft_speed.py [--steps 60 --rounds 3 --threads 0 --data FILE --model DIR --quick]

The workload is make tiny's SFT step (configs/tiny/sft.yaml: its micro-batches of conversations of the tiny task,
grouped by length, AdamW, grad clip 1.0) on the tiny model (made once in a temporary folder with the tiny task's
SFT file, or `--data FILE --model DIR`). Every way below starts from the same weights and reads the same
micro-batches in the same order; the ways alternate, `--steps` optimizer steps each, for `--rounds` rounds, after a
warm-up (torch.compile's compilation happens there and is printed apart). Throughput counts the conversations'
tokens (not padding) per second of wall time; the result is each way's median ratio to the shipped loop over the
rounds, and how far its loss curve is from the shipped loop's (the largest difference at any step, over the same
data and steps: a way that changes what SFT learns shows here; the larger micro-batches see other batches).

1. Where a step's time goes (the shipped loop, timed phase by phase): making the batch, the forward pass, the
   loss, the backward pass, the gradient clip, AdamW's step, and Accelerate's part (the same step on the prepared
   model and optimizer, through `accumulate` / `backward` / `clip_grad_norm_`, against plain torch calls).
2. The ways: the padding mask (sft.py drops it: padding is on the right, so the causal mask already keeps it
   out, and attention takes its fast path); packing instead of padding (sft.pack: block-diagonal attention from
   position ids); AdamW's foreach and fused implementations (torch's default on the CPU is a loop over the
   parameters); micro-batches twice or half the config's (half or twice the steps for the same tokens: the same
   throughput question as a doubled or halved batch, not the same learning); torch.compile of the model (dynamic shapes, inductor's C++ backend).
"""
import argparse
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plumbing import cpu_threads  # noqa: E402,F401  (before torch: the shipped OpenMP wait policy)
import torch  # noqa: E402

from plumbing.config import load_config  # noqa: E402
from plumbing.data import load_conversations  # noqa: E402
from protocol import chat_format  # noqa: E402
from sft import (SFTConfig, LengthGroupedBatches, build_examples, collate, masked_lm_loss, pack,  # noqa: E402
                 stop_unless_finite)


def prepare(folder: Path, n_sft: int) -> tuple[Path, Path]:
    """The tiny base model and an SFT file of `n_sft` conversations from the tiny task."""
    for cmd in ([sys.executable, "-m", "tiny.model", str(folder / "base")],
                [sys.executable, "-m", "tiny.task", str(folder / "data"), "--n-sft", str(n_sft), "--n-train", "16",
                 "--n-test", "8"]):
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return folder / "base", folder / "data" / "sft.jsonl"


class Way:
    """One way of running the SFT step: its own model, optimizer and position in the shared micro-batch order."""

    def __init__(self, name: str, model_dir: Path, batches: list, cfg: SFTConfig, *, collate_fn=collate,
                 adamw: dict | None = None, compile_model: bool = False, accelerate: bool = False,
                 padding_mask: bool = False):
        from transformers import AutoModelForCausalLM
        self.name, self.cfg, self.accelerate, self.padding_mask = name, cfg, accelerate, padding_mask
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        model.train()
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=cfg.lr,
                                      betas=(cfg.adam_beta1, cfg.adam_beta2), **(adamw or {}))
        if accelerate:
            from accelerate import Accelerator
            self.acc = Accelerator(cpu=True)
            model, optimizer = self.acc.prepare(model, optimizer)
        self.model, self.optimizer = model, optimizer
        self.forward = torch.compile(model, dynamic=True) if compile_model else model
        self.batches = batches
        self.collate, self.next, self.losses = functools.partial(collate_fn, pad_id=0), 0, []
        self.seconds, self.tokens, self.cells, self.phases = 0.0, 0, 0, {}

    def _tick(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - start
        return now

    def run(self, steps: int, timed: bool = True) -> None:
        """`steps` optimizer steps, each one micro-batch (batch_size == micro_batch_size, as make tiny's SFT);
        timed=False: a warm-up or a profiled round, left out of the figures."""
        t0, kept = time.perf_counter(), dict(self.phases)
        for _ in range(steps):
            examples = self.batches[self.next % len(self.batches)]
            self.next += 1
            t = time.perf_counter()
            batch = self.collate(examples)
            t = self._tick("make the batch", t)
            drop = ("labels", "num_tokens") + (() if self.padding_mask else ("attention_mask",))
            inputs = {k: v for k, v in batch.items() if k not in drop}
            logits = self.forward(**inputs, use_cache=False).logits
            t = self._tick("forward", t)
            loss = masked_lm_loss(logits, batch["labels"])
            t = self._tick("loss", t)
            if self.accelerate:
                with self.acc.accumulate(self.model):
                    self.acc.backward(loss)
                    t = self._tick("backward", t)
                    norm = self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                    stop_unless_finite(self.acc, [loss.detach()], norm, self.next, Path("."))  # as sft.py does
                    t = self._tick("grad clip", t)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
                    t = self._tick("AdamW step", t)
            else:
                loss.backward()
                t = self._tick("backward", t)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                t = self._tick("grad clip", t)
                self.optimizer.step()
                self.optimizer.zero_grad()
                t = self._tick("AdamW step", t)
            self.losses.append(loss.item())
            if timed:
                self.tokens += sum(len(ids) for ids, _ in examples)
                self.cells += batch["input_ids"].numel()
        if timed:
            self.seconds += time.perf_counter() - t0
        else:
            self.phases = kept


def sft_command(model_dir: Path, data: Path, out: Path, steps: int, ranks: int) -> list[str]:
    """sft.py as make tiny runs it for `steps` steps; with ranks=2, torchrun's two processes of one thread each and
    micro-batches of 4 (the same batch of 8 per optimizer step)."""
    args = ["sft.py", "configs/tiny/sft.yaml", f"model_path={model_dir}", f"data={data}", f"out_dir={out}",
            f"max_steps={steps}", "log_every=10", "save_every=0", "resume=never"]
    if ranks == 1:
        return [sys.executable] + args
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            "29561"] + args + ["micro_batch_size=4", "torch_threads=1"]


def sft_rate(cmd: list[str], out: Path) -> float:
    """Tokens/s that sft.py logged after its first interval (start-up and warm-up left out)."""
    import json
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return sum(r["perf/tokens_per_s"] * r["perf/seconds"] for r in rows) / sum(r["perf/seconds"] for r in rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per way per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per way first (compilation too)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: plumbing/cpu_threads.py's choice)")
    parser.add_argument("--data", type=Path, help="an SFT file (default: the tiny task's, made here)")
    parser.add_argument("--model", type=Path, help="a base model folder (default: tiny/model.py's, made here)")
    parser.add_argument("--ways", default="all", help="comma-separated names of the ways to run (default all)")
    parser.add_argument("--no-processes", action="store_true", help="leave out the sft.py runs (one / two ranks)")
    parser.add_argument("--profile", action="store_true", help="print the shipped loop's top operators")
    parser.add_argument("--quick", action="store_true", help="a few steps of each way (the test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup = 3, 1, 1
    threads = cpu_threads.set_torch_threads(args.threads)
    cfg = load_config(SFTConfig, [ROOT / "configs/tiny/sft.yaml"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = args.model, args.data
        if model_dir is None or data is None:
            made = prepare(Path(tmp), 200 if args.quick else 2000)
            model_dir, data = model_dir or made[0], data or made[1]
        from transformers import AutoTokenizer
        chat = chat_format(cfg.system_prompt, cfg.user_instruction)
        examples, _ = build_examples(AutoTokenizer.from_pretrained(model_dir), load_conversations(data, chat), chat,
                                     cfg.max_seq_len)
        def micro_batches(size):  # sft.py's order for micro-batches of `size`, as long as the rounds need
            order = LengthGroupedBatches([len(ids) for ids, _ in examples], size, cfg.seed)
            batches = [[examples[i] for i in b] for b in order]
            return batches * ((args.warmup + args.steps * (args.rounds + 1)) // len(batches) + 1)
        make = functools.partial(Way, model_dir=model_dir, batches=micro_batches(cfg.micro_batch_size), cfg=cfg)
        ways = {
            "shipped: padded, no padding mask, Accelerate": lambda: make("shipped", accelerate=True),
            "the same in plain torch": lambda: make("plain"),
            "padded with the padding mask (before)": lambda: make("mask", accelerate=True, padding_mask=True),
            "packed": lambda: make("packed", accelerate=True, collate_fn=pack),
            "AdamW foreach": lambda: make("foreach", accelerate=True, adamw={"foreach": True}),
            "AdamW fused": lambda: make("fused", accelerate=True, adamw={"fused": True}),
            "micro-batches twice as large (half the steps)": lambda: make("batch2x", accelerate=True,
                                                                          batches=micro_batches(
                                                                              2 * cfg.micro_batch_size)),
            "micro-batches half as large (twice the steps)": lambda: make("batch_half", accelerate=True,
                                                                          batches=micro_batches(
                                                                              max(1, cfg.micro_batch_size // 2))),
            "torch.compile": lambda: make("compile", accelerate=True, compile_model=True),
        }
        if args.ways != "all":
            wanted = args.ways.split(",")
            ways = {k: v for k, v in ways.items() if any(k.startswith(w) for w in wanted)}
        built, compile_s = {}, {}
        for name, build in ways.items():
            start = time.perf_counter()
            built[name] = build()
            built[name].run(args.warmup, timed=False)
            compile_s[name] = time.perf_counter() - start
        rates = {name: [] for name in built}
        for _ in range(args.rounds):
            for name, way in built.items():
                tokens, seconds = way.tokens, way.seconds
                way.run(args.steps)
                rates[name].append((way.tokens - tokens) / (way.seconds - seconds))
        curve_steps = args.warmup + args.rounds * args.steps  # every way's steps so far (the profile adds more)
        processes = {}
        if not args.no_processes:  # sft.py itself: one process with the shipped threads, or two ranks of one
            for _ in range(args.rounds):
                for ranks in (1, 2):
                    out = Path(tmp) / f"sft-{ranks}"
                    processes.setdefault(ranks, []).append(
                        sft_rate(sft_command(model_dir, data, out, max(args.warmup + args.steps, 20), ranks), out))
        profile = None
        if args.profile:  # the shipped loop's operators, by their own CPU time
            from torch.profiler import ProfilerActivity, profile as torch_profile
            way = built[next(iter(built))]
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                way.run(args.steps, timed=False)
            profile = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    shipped = next(iter(rates))
    print(f"tiny SFT step, {threads} torch thread(s), {args.rounds} rounds x {args.steps} steps per way; "
          f"{len(examples)} conversations, micro-batches of {cfg.micro_batch_size}")
    print(f"\n{'way':<46}{'tok/s':>9}{'ratio (range)':>22}{'padded cells/token':>20}{'set-up+warm-up s':>18}"
          f"{'last loss':>11}{'max |loss - shipped|':>22}")
    reference = built[shipped].losses[:curve_steps]
    for name, way in built.items():
        ratios = [r / s for r, s in zip(rates[name], rates[shipped])]
        gap = max(abs(a - b) for a, b in zip(way.losses[:curve_steps], reference))
        print(f"{name:<46}{statistics.median(rates[name]):9,.0f}{statistics.median(ratios):>9.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}){way.cells / way.tokens:>20.3f}{compile_s[name]:>18.1f}"
              f"{way.losses[curve_steps - 1]:>11.4f}{gap:>22.2e}")
    if processes:
        print(f"\nsft.py itself, {max(args.warmup + args.steps, 20)} steps, tok/s after its first 10 (median of {args.rounds}):")
        one, two = (statistics.median(processes[r]) for r in (1, 2))
        print(f"  one process, torch_threads from the config  {one:9,.0f}")
        print(f"  two ranks of one thread (torchrun)          {two:9,.0f}  {two / one:.2f}x "
              f"({min(b / a for a, b in zip(processes[1], processes[2])):.2f}-"
              f"{max(b / a for a, b in zip(processes[1], processes[2])):.2f})")
    for name in list(built)[:2]:
        way = built[name]
        total = sum(way.phases.values())
        print(f"\nwhere a step's time goes: {name} ({1000 * way.seconds / (args.steps * args.rounds):.1f} ms per step)")
        for phase, seconds in way.phases.items():
            print(f"  {phase:<16}{1000 * seconds / (args.steps * args.rounds):8.2f} ms  {100 * seconds / total:5.1f}%")
    if profile:
        print("\nthe shipped loop's operators (torch.profiler, one round):\n" + profile)


if __name__ == "__main__":
    main()
