"""Qwen3-Base's tokenizer rebuilt from its BPE ranks (tools/qwen_vocab.py): the same ids as tiktoken on the same ranks,
the added tokens at Qwen3's ids, and random models saved the way a hub checkpoint arrives."""
import json
import random
import unicodedata

import pytest
import torch

from tools import qwen_vocab
from tools.qwen_vocab import ADDED_TOKENS, EMBEDDING_ROWS, EOS_ID, NUM_RANKS


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def mixed_texts(data_dir, n_random=1500):
    """The repository's own sources and benchmark problems, and random strings over ASCII, Latin, Greek, CJK,
    math symbols, emoji and whitespace. NFC-normalised (the tokenizer normalises, tiktoken does not), and without
    the added tokens' strings (the tokenizer matches them as added tokens, tiktoken's plain encoding does not)."""
    texts = [p.read_text() for p in sorted(qwen_vocab.ROOT.glob("*.py"))]
    texts += [json.loads(line)["problem"] for line in (data_dir / "math500.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    alphabet = [chr(c) for c in [*range(32, 127), *range(0xA0, 0x250), *range(0x391, 0x3C9), *range(0x4E00, 0x4E60),
                                 0x1F600, 0x1F914, 0x2200, 0x2211, 0x221E]] + ["\n", "\t", "\r", "  ", "\n\n"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(n_random)]
    texts += [bytes(rng.randrange(256) for _ in range(40)).decode("utf-8", errors="replace") for _ in range(200)]
    texts = [unicodedata.normalize("NFC", t) for t in texts]
    for added, _ in ADDED_TOKENS:
        texts = [t.replace(added, "") for t in texts]
    return texts


def test_same_ids_as_tiktoken_on_the_same_ranks(tokenizer, data_dir):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = qwen_vocab.read_ranks(qwen_vocab.RANKS_FILE)
    encoding = tiktoken.Encoding("qwen", pat_str=qwen_vocab.PRETOKENIZE_REGEX, mergeable_ranks=ranks,
                                 special_tokens={})
    texts = mixed_texts(data_dir)
    differ = [t for t in texts if encoding.encode_ordinary(t) != tokenizer.encode(t, add_special_tokens=False)]
    assert sum(len(encoding.encode_ordinary(t)) for t in texts) > 100_000  # a real sample, not a handful
    assert differ == []
    assert all(tokenizer.decode(tokenizer.encode(t)) == t for t in texts[:300])


def test_known_ids_and_special_settings(tokenizer):
    # Public facts of Qwen's vocabulary: "Hello" 9707, " world" 1879, "!" 0, each digit its own token.
    assert tokenizer.encode("Hello world!") == [9707, 1879, 0]
    assert tokenizer.encode("2024") == [17, 15, 17, 19]
    ids = {t: NUM_RANKS + i for i, (t, _) in enumerate(ADDED_TOKENS)}
    assert ids["<|endoftext|>"] == 151643 and ids["<|im_start|>"] == 151644 and ids["<|im_end|>"] == 151645
    assert ids["<tool_call>"] == 151657 and ids["</think>"] == 151668
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in ids} == ids
    assert len(tokenizer) == 151_669
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>" and tokenizer.bos_token is None
    assert tokenizer.encode("x") == [87]  # no BOS added
    special = set(tokenizer.all_special_tokens)
    assert "<|im_end|>" in special and "<tool_call>" not in special and "</tool_response>" not in special


def test_random_model_is_saved_like_a_hub_checkpoint(tmp_path, qwen_tokenizer_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    out = qwen_vocab.random_qwen3(tmp_path / "m", "rehearsal", seed=3)
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert config["vocab_size"] == EMBEDDING_ROWS and config["tie_word_embeddings"] is True
    assert GenerationConfig.from_pretrained(out).eos_token_id == EOS_ID
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|im_end|>") == 151645
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16  # what a bare from_pretrained gives a user
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    again = qwen_vocab.random_qwen3(tmp_path / "m2", "rehearsal", seed=3)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert AutoConfig.from_pretrained(out).eos_token_id == EOS_ID


def test_byte_map_is_a_bijection_onto_printable_characters():
    table = qwen_vocab.byte_characters()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120"  # GPT-2's "Ġ" for a space


def test_merges_follow_rank_order():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"bc": 3, b"ab": 4, b"abc": 5}
    # bc (3) before ab (4); abc can be made as a+bc or ab+c: both, by the parts' ranks
    assert qwen_vocab.merges_from_ranks(ranks) == [(b"b", b"c"), (b"a", b"b"), (b"a", b"bc"), (b"ab", b"c")]


def test_a_wrong_rank_file_is_refused_with_its_path(tmp_path):
    bad = tmp_path / "qwen.tiktoken"
    bad.write_text("IQ== 0\n")
    with pytest.raises(SystemExit, match=f"{bad}.*sha256"):
        qwen_vocab.fetch_ranks(bad)
