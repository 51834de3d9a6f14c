"""The LoRA hand-off on vLLM's CPU build: merged layers into the engine (what train.py does, plumbing/lora.py) against
vLLM's own LoRA path (the engine built with enable_lora, the adapter read from disk by a LoRARequest), side by side
in one run.

    .venv-vllm/bin/python bench/lora_handoff.py [--hidden 512 --layers 8 --rank 16 --rounds 3]

One random Qwen3 of the tiny tokenizer's vocabulary (tiny/model.py, at the size given), one adapter on every linear
layer of attention and MLP with a random B (a trained one's size). Per round and way:
- hand-off: merged layers (the adapted layers merged and those vLLM fuses with them, `update_weights(...,
  partial=True)`) against the adapter saved in PEFT's format and loaded by the engine at its next request (a new
  LoRARequest id each round, as each training step would need);
- decoding: the same prompts, greedy, a fixed number of tokens, through each engine: tokens per second;
- the log-probs each engine scores a probe with, against the trainer's (PEFT's model in fp32).
Both engines run fp32 and eager, with the same KV cache. A CPU measures the work, not a GPU's kernels (vLLM's LoRA
path runs its punica kernels on GPUs); the ratios are what this machine says.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from plumbing import lora  # noqa: E402
from plumbing.handoff import sequence_logprobs  # noqa: E402
from protocol import chat_format  # noqa: E402
from samplers.vllm_engine import VLLMSampler  # noqa: E402
from tiny.model import build_tiny  # noqa: E402

ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "seed": 0}


def adapted_model(path: Path, rank: int):
    """The model at `path` with an adapter whose B is random (as after training), in fp32."""
    model = lora.add_adapter(AutoModelForCausalLM.from_pretrained(path), rank, 2.0 * rank, lora.DEFAULT_TARGETS,
                             0.0, seed=0)
    with torch.no_grad():
        for layer in lora.adapted_modules(model).values():
            layer.lora_B[lora.ADAPTER].weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return model


def decode(sampler, prompts, tokens: int, **kw) -> float:
    """Tokens per second of greedy decoding `tokens` tokens for each prompt (no stop: ignore_eos)."""
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    out = sampler.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kw)
    return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - start)


def score(llm, probe, **kw) -> torch.Tensor:
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": probe}], params, use_tqdm=False, **kw)[0]
    return torch.tensor([step[t].logprob for t, step in zip(probe[1:], out.prompt_logprobs[1:])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    from vllm.lora.request import LoRARequest
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="lora_handoff_"))
    path = build_tiny(work / "model", hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                      intermediate=4 * args.hidden)
    tok = AutoTokenizer.from_pretrained(path)
    fmt = chat_format("compact", "")
    prompts = [tok.encode(fmt.prompt(f"Compute {a}*{a + 7}."), add_special_tokens=False)
               for a in range(11, 11 + args.prompts)]
    model = adapted_model(path, args.rank)
    trainer = sequence_logprobs(model, prompts[0])
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    print(f"model: {params / 1e6:.1f}M parameters ({args.layers} layers, hidden {args.hidden}); adapter rank "
          f"{args.rank}: {lora.trainable_count(model) / 1e6:.2f}M; {args.prompts} prompts x {args.tokens} tokens, "
          f"greedy; torch threads 1")
    merged_engine = VLLMSampler(str(path), tok, **ENGINE)
    lora_engine = VLLMSampler(str(path), tok, enable_lora=True, max_lora_rank=args.rank, max_loras=1, **ENGINE)
    handoff, speed = {"merged": [], "vllm_lora": []}, {"merged": [], "vllm_lora": [], "plain": []}
    for r in range(args.rounds):
        start = time.perf_counter()
        merged_engine.update_weights(lora.merged_weights(model, merged_engine.dtype), partial=True)
        handoff["merged"].append(time.perf_counter() - start)
        start = time.perf_counter()
        folder = work / f"adapter{r}"
        lora.save_adapter(model, model.state_dict(), folder)
        request = LoRARequest(f"step{r}", r + 1, str(folder))
        score(lora_engine.llm, prompts[0][:2], lora_request=request)  # the engine reads the adapter here
        handoff["vllm_lora"].append(time.perf_counter() - start)
        speed["merged"].append(decode(merged_engine, prompts, args.tokens))
        speed["vllm_lora"].append(decode(lora_engine, prompts, args.tokens, lora_request=request))
        speed["plain"].append(decode(lora_engine, prompts, args.tokens))  # the LoRA engine without an adapter
    gaps = {"merged": (score(merged_engine.llm, prompts[0]) - trainer).abs().mean().item(),
            "vllm_lora": (score(lora_engine.llm, prompts[0], lora_request=request) - trainer).abs().mean().item()}
    print(f"{'way':<12}{'hand-off s':>12}{'decode tok/s':>14}{'gap to trainer':>16}")
    for way in ("merged", "vllm_lora"):
        print(f"{way:<12}{statistics.median(handoff[way]):>12.3f}{statistics.median(speed[way]):>14.0f}"
              f"{gaps[way]:>16.2e}")
    print(f"{'(no adapter)':<12}{'':>12}{statistics.median(speed['plain']):>14.0f}   the LoRA engine, no request")
    ratio = statistics.median(speed["merged"]) / statistics.median(speed["vllm_lora"])
    print(f"medians of {args.rounds} rounds; merged layers decode {ratio:.2f}x as fast as vLLM's LoRA path, their "
          f"hand-off takes {statistics.median(handoff['merged']) / statistics.median(handoff['vllm_lora']):.2f}x "
          "its time")
    merged_engine.close()
    lora_engine.close()


if __name__ == "__main__":
    main()
