"""The update's log-prob memory at Qwen3's vocabulary (V = 151,936): the direct log-softmax against plumbing/logprobs.py's
chunked way, side by side in one run.

    python bench/logprob_memory.py [--tokens 1024] [--hidden 1024]

Each variant runs in a fresh process: one forward and backward of sum_t A_t * log pi(x_t) through an output layer
(hidden states (T, hidden) -> logits (T, V), a fixed weight), the step train.py's update takes per micro-batch, with
the logits as each launch hands them over:
- fp32: fp32 logits (mixed_precision: no);
- fsdp2-bf16: bf16 logits from bf16 weights, as FSDP2's mixed precision policy computes (the real configs);
- ddp-bf16: the output layer under bf16 autocast, then the fp32 copy Accelerate makes of the model's outputs
  (convert_outputs_to_fp32), as one process or DDP runs mixed_precision: bf16.
The two ways: "direct", the log-softmax batches.token_logprobs took before (fp32 copy, divided by the temperature,
log_softmax over the vocabulary, gather), and "chunked", logprobs.sampled_logprobs.

Peak memory, measured two ways, because torch's CPU allocator keeps no peak counter:
- tensors: torch.profiler with profile_memory=True records every tensor allocation and free; the largest running
  sum over the step, above what was allocated before it;
- RSS: the process's peak resident set (getrusage ru_maxrss) above its resident set just before the step (glibc
  maps allocations of 32 MB and more separately and returns them when freed, so the peak RSS follows the tensors).
Printed per token and per (token x vocabulary entry), the ratio chunked / direct, and the largest differences of the
log-probs and of the gradient reaching the hidden states between the two ways (in fp32 they must agree to 1e-5;
with bf16 logits the gradient is rounded to bf16 by both ways, so theirs differ by that rounding at most).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
V = 151_936
TEMPERATURE = 0.8
COMPUTES = ("fp32", "fsdp2-bf16", "ddp-bf16")


def direct_logprobs(logits, targets, temperature):
    """The way batches.token_logprobs computed it before plumbing/logprobs.py: the whole fp32 log-softmax."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def variant(way: str, compute: str, tokens: int, hidden: int, out: Path) -> dict:
    """One forward and backward in this process; returns the two peaks (bytes) and writes the values to `out`."""
    from plumbing.logprobs import sampled_logprobs
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g)).requires_grad_()
    weight = torch.randn(V, hidden, generator=g) * hidden ** -0.5  # logits of unit scale
    targets = torch.randint(V, (tokens,), generator=g)
    advantages = torch.randn(tokens, generator=g)
    logprobs = {"direct": direct_logprobs, "chunked": sampled_logprobs}[way]

    weight_bf16 = weight.bfloat16()

    def step():
        if compute == "ddp-bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = h @ weight.T
            logits = logits.float()  # Accelerate's convert_outputs_to_fp32 on the model's outputs
        elif compute == "fsdp2-bf16":
            logits = h.bfloat16() @ weight_bf16.T  # the parameters FSDP2 all-gathers in bf16
        else:
            logits = h @ weight.T
        logp = logprobs(logits, targets, TEMPERATURE)
        (logp * advantages).sum().backward()
        return logp.detach()

    rss_before = current_rss()
    logp = step()
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    torch.save({"logp": logp, "grad": h.grad}, out)
    h.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    running, peak = 0, 0
    # every allocation and free, in time order (the raw "[memory]" records: prof.events() folds those made
    # inside an op into it, and its children's again into each parent)
    records = prof.profiler.kineto_results.events()
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in records if e.name() == "[memory]"):
        running += nbytes
        peak = max(peak, running)
    return {"tensors": peak, "rss": rss_peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="positions in the micro-batch (T)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (Qwen3-0.6B: 1024)")
    p.add_argument("--variant", nargs=3, metavar=("WAY", "COMPUTE", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:
        way, compute, out = a.variant
        print(json.dumps(variant(way, compute, a.tokens, a.hidden, Path(out))))
        return
    print(f"log-prob memory of one micro-batch: T = {a.tokens} tokens, V = {V:,}, hidden {a.hidden}, "
          f"temperature {TEMPERATURE}; each variant in a fresh process")
    print(f"{'logits':11} {'way':8} {'tensors MB/token':>17} {'B/(token*V)':>12} {'RSS MB/token':>13} "
          f"{'B/(token*V)':>12}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for compute in COMPUTES:
            for way in ("direct", "chunked"):
                out = Path(tmp) / f"{compute}-{way}.pt"
                done = subprocess.run([sys.executable, __file__, "--tokens", str(a.tokens), "--hidden", str(a.hidden),
                                       "--variant", way, compute, str(out)], capture_output=True, text=True,
                                      check=True)
                peak = json.loads(done.stdout.strip().splitlines()[-1])
                rows[compute, way] = peak, torch.load(out)
                t, r = peak["tensors"] / a.tokens, peak["rss"] / a.tokens
                print(f"{compute:11} {way:8} {t / 1e6:17.2f} {t / V:12.2f} {r / 1e6:13.2f} {r / V:12.2f}")
    for compute in COMPUTES:
        (direct, d), (chunked, c) = rows[compute, "direct"], rows[compute, "chunked"]
        print(f"{compute}: chunked / direct peak = {chunked['tensors'] / direct['tensors']:.2f} (tensors), "
              f"{chunked['rss'] / direct['rss']:.2f} (RSS); largest difference: log-probs "
              f"{(d['logp'] - c['logp']).abs().max().item():.1e}, gradient {(d['grad'] - c['grad']).abs().max().item():.1e}")


if __name__ == "__main__":
    import torch
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    main()
