"""A tokenizer's side of protocol.encode: which of its added tokens are control tokens, and how text from outside
the protocol is encoded so that a control string inside it stays ordinary text (protocol.py's `Plain`)."""
import re

_TAG = re.compile(r"<[^<>\s]+>")


def control_tokens(tokenizer) -> dict[str, int]:
    """A tokenizer's control tokens, {text: id}: its special tokens and each added token written as a tag (`<...>`):
    ChatML's `<|im_start|>` / `<|im_end|>`, Qwen3's `<tool_call>`, `<tool_response>`, `<think>` and fill-in-the-middle
    markers (added but not special there), the tiny tokenizer's markers. Other added tokens (the tiny tokenizer's
    multi-character phrases, its one-token tool name) are pieces of ordinary text."""
    special = set(tokenizer.all_special_tokens)
    return {t: i for t, i in tokenizer.get_added_vocab().items() if t in special or _TAG.fullmatch(t)}


def ordinary_ids(tokenizer, text: str, split: re.Pattern) -> list[int]:
    """Ordinary text: `tokenizer.encode` between control strings; each control string in it (it came from Plain
    text) goes through the tokenizer's normalizer, pre-tokenizer and model alone, which know no added tokens."""
    ids = []
    for i, piece in enumerate(split.split(text)):
        if i % 2:
            backend = tokenizer.backend_tokenizer
            piece = backend.normalizer.normalize_str(piece) if backend.normalizer else piece
            words = backend.pre_tokenizer.pre_tokenize_str(piece) if backend.pre_tokenizer else [(piece, None)]
            ids += [t.id for word, _ in words for t in backend.model.tokenize(word)]
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids
