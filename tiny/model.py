"""A tiny character-level tokenizer and Qwen3 causal LM that exist without any download.

The tiny CPU pipeline needs a policy it can build from nothing. This module writes one
to a folder with `save_pretrained`, so every later step loads it with `AutoTokenizer.from_pretrained` and
`AutoModelForCausalLM.from_pretrained`, exactly as it would load a real checkpoint such as Qwen3-14B-Base.

Tokenizer (a `PreTrainedTokenizerFast` built with the `tokenizers` library):
- one token per character for printable ASCII (space to tilde), newline and tab;
- every markup string of `protocol.SPECIAL_TOKENS` (ChatML markers, `<reason>`, `<tool_call>`, the tool name, ...)
  is one token. `<|im_start|>`, `<|im_end|>` and the pad/unk tokens are special tokens; the other markers are plain
  added tokens (as in Qwen's tokenizer), so `decode(..., skip_special_tokens=True)` keeps `<answer>` and friends;
- the fixed pieces of a tool call's JSON and `\\boxed{` (PHRASES) are one token each;
- eos = `<|im_end|>` (a turn ends there), pad = `<|pad|>`, and any other character (e.g. "é") becomes `<|unk|>`:
  only ASCII text round-trips exactly. Decoding concatenates tokens (no spaces inserted, no clean-up).

Model: `Qwen3ForCausalLM` (the report's base family) with tied embeddings. Not Qwen2: transformers 5 loads any
`model_type: qwen2` folder with its own Qwen2 BPE tokenizer class, whatever tokenizer.json says, which would break
this character tokenizer; for `qwen3` it honours the saved tokenizer. Qwen3 differs from Qwen2 only by RMSNorm on
queries and keys (and no attention biases). Defaults (hidden 128, 4 layers, 4 heads, MLP 512) give about 1.05M
parameters; the design notes measured about 4,400 generated tokens/s at this size on 2 CPU cores, and about
1,300 tokens/s at about 6M parameters, so keep it small (this Qwen3 build: about 2,900 tokens/s generating 200
tokens for a batch of 64 on ONE torch thread). Random initialisation, seeded.

Run:  .venv/bin/python -m tiny.model OUT_DIR [--hidden 128 --layers 4 --heads 4 --kv-heads 4 --intermediate 512
                                              --max-positions 2048 --seed 0]
Left out: byte fallback and any real pre-training; the tiny pipeline teaches the format with SFT.
"""
import argparse
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from protocol import IM_END, IM_START, SPECIAL_TOKENS

PAD, UNK = "<|pad|>", "<|unk|>"
# Fixed pieces of the tool-call JSON and of the answer, one token each (as a BPE merge would make them). They halve
# the distance between the numbers in the problem and where the code copies them, which a 1M-parameter model from
# scratch otherwise learns slowly. The text is unchanged: the same characters, fewer tokens.
PHRASES = ["assistant\n", '{"name": "', '", "arguments": {"code": "', '", "input": ""}}', "print(", "\\boxed{"]
# Printable ASCII (space .. tilde) plus newline and tab: one token each.
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
assert set(string.printable) - set(CHARS) <= {"\r", "\x0b", "\x0c"}


def build_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """The character-level tokenizer. Ids: pad 0, unk 1, the protocol markers, then the characters; with
    `vocab_size`, unused tokens <|unused0|>, ... fill the vocabulary up to that size (a random model of a real
    model's vocabulary size; text never encodes to them, but a random model samples them)."""
    markers = [PAD, UNK] + list(SPECIAL_TOKENS) + PHRASES
    fillers = [f"<|unused{i}|>" for i in range(max((vocab_size or 0) - len(markers) - len(CHARS), 0))]
    vocab = {tok: i for i, tok in enumerate(markers + CHARS + fillers)}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Each character is its own pre-token ([\s\S] also matches newline); markers are matched before this step.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate tokens as they are
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=IM_END,
                                  clean_up_tokenization_spaces=False, padding_side="left")
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tok.add_tokens([m for m in SPECIAL_TOKENS + PHRASES if m not in (IM_START, IM_END)])
    assert len(tok) == len(vocab), "every marker must already be in the vocabulary"
    return tok


def build_model(tokenizer, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int | None = None,
                intermediate: int | None = None, max_positions: int = 2048, seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 causal LM for `tokenizer` (the global torch RNG is left untouched)."""
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads, head_dim=hidden // heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def build_tiny(out_dir, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int | None = None,
               intermediate: int | None = None, max_positions: int = 2048, seed: int = 0) -> Path:
    """Write the tokenizer and a fresh model to `out_dir` (loadable with Auto*.from_pretrained); return the path."""
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, hidden, layers, heads, kv_heads, intermediate, max_positions, seed)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 * hidden)")
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = build_tiny(a.out_dir, a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.max_positions, a.seed)
    n = sum(t.numel() for t in Qwen3ForCausalLM.from_pretrained(out).parameters())
    print(f"wrote {out}: {n / 1e6:.2f}M parameters, vocabulary {len(build_tokenizer())}")


if __name__ == "__main__":
    main()
