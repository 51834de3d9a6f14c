"""Reading and writing the project's JSONL data files, with errors that name the file and the line.

Two kinds of file, one JSON object per line (blank lines are skipped):
- problems (RL and evaluation data): {"problem": str, "answer": str, ...}; extra fields (id, level, source) are kept.
  The RL data of the report has integer answers, and evaluation sets such as MATH-500 have LaTeX ones: both are
  strings here. An answer written as a JSON number is turned into the text of that number (`reward.answer_text`:
  25 -> "25", 0.5 -> "0.5"). Each row is a `Problem`: a dict that also knows its `where` ("file:line").
- conversations (SFT data): {"messages": [...]} in the common chat format with tool calls, checked by rendering it
  through `protocol.ChatFormat.render_messages` (the same rendering SFT trains on).

A bad line raises ValueError("path:line: what is wrong") before the caller does any work: bad JSON, JSON nested too
deeply for Python's parser, text that is not UTF-8 (a UTF-8 byte-order mark is accepted). Models: `check_model_path`
looks at folders before any work; `load_pretrained` turns whatever a transformers loader then fails with (the hub
unreachable, no such repository, a file missing) into one line saying what was looked for and where.
"""
import json
import re
from pathlib import Path

from protocol import ChatFormat
from reward import answer_text


class Problem(dict):
    """One problem row: the JSON object as read (problem, answer and any extra fields) and, as an attribute, where
    it came from ("file:line") for error messages. To json.dumps and == it is the plain dict."""

    def __init__(self, row: dict, where: str):
        super().__init__(row)
        self.where = where


def _read_jsonl(path):
    """Yield (line_number, object) for each non-blank line; ValueError names the file and line otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: data file not found")
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise ValueError(f"{path}:{number}: JSON nested too deeply to read") from None
            except ValueError as e:  # e.g. an integer of more digits than Python converts
                raise ValueError(f"{path}:{number}: not valid JSON ({str(e)[:80]})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            yield number, row


def load_problems(path) -> list[Problem]:
    """Problems from a JSONL file: each row has a non-empty string `problem` and an `answer` that is a non-empty
    string or a JSON number (turned into its text), plus any extras; `Problem.where` is "file:line"."""
    rows = []
    for number, row in _read_jsonl(path):
        answer = row.get("answer")
        if not isinstance(answer, str) and answer_text(answer) is not None:
            row["answer"] = answer_text(answer)
        for key in ("problem", "answer"):
            value = row.get(key)
            if not isinstance(value, str) or not value.strip():
                kind = "a non-empty string" + (" or a finite number" if key == "answer" else "")
                raise ValueError(f"{path}:{number}: '{key}' must be {kind}, got {value!r}")
        rows.append(Problem(row, f"{path}:{number}"))
    if not rows:
        raise ValueError(f"{path}: no problems in the file")
    return rows


def load_conversations(path, chat: ChatFormat | None = None) -> list[list[dict]]:
    """Conversations from a JSONL file of {"messages": [...]} rows; each is checked by rendering it with `chat`
    (the texts do not change what is valid; the tool name does: every call must name the format's tool)."""
    chat = chat or ChatFormat()
    conversations = []
    for number, row in _read_jsonl(path):
        messages = row.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{path}:{number}: expected 'messages': a list of message objects")
        try:
            chat.render_messages(messages)
        except (ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"{path}:{number}: {e}") from None
        conversations.append(messages)
    if not conversations:
        raise ValueError(f"{path}: no conversations in the file")
    return conversations


def write_jsonl(path, rows) -> Path:
    """Write one JSON object per line (UTF-8, keys in insertion order, so output is deterministic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


# What save_pretrained writes for the weights: one file, or an index of shards.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# What save_pretrained writes for a tokenizer (one of them suffices). Without any, transformers builds an empty
# tokenizer from config.json's model type, and every text encodes to no tokens.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name, as the Hugging Face Hub spells ids


def check_model_path(path: str) -> None:
    """A model is a local folder with config.json, or a hub id `org/name` (fetched by transformers when online).
    Anything else is an input error, reported before any work instead of deep inside from_pretrained. `org/name`
    whose `org` is a folder here (runs/sft_typo) is a mistyped local path, not a hub id; offline
    (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1), a hub id must be in the local cache."""
    if not path:
        raise ValueError("model_path '' is not a model folder (give a folder with config.json or a hub id org/name)")
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        if not any((p / name).is_file() for name in WEIGHT_FILES):
            raise ValueError(f"model_path {path!r} is not a whole model folder: config.json but no weights "
                             f"(model.safetensors, pytorch_model.bin or a shard index) in {p.resolve()}")
        if not any((p / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"model_path {path!r} is not a whole model folder: no tokenizer (tokenizer.json or "
                             f"tokenizer_config.json) in {p.resolve()}")
        return
    if p.exists():
        raise ValueError(f"model_path {path!r} is not a model folder (no config.json there)")
    if path.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(path):
        raise ValueError(f"model_path {path!r} is not a model folder (no such folder)")
    org = path.split("/")[0]
    if Path(org).is_dir():
        raise ValueError(f"model_path {path!r} is not a model folder (no such folder in {org}/; a hub id's "
                         f"organisation would not be a folder here)")
    from huggingface_hub import constants, try_to_load_from_cache
    if constants.HF_HUB_OFFLINE:  # set by HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1, as transformers reads it
        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise ValueError(f"model_path {path!r}: no such folder, and HF_HUB_OFFLINE is set and the hub id is not "
                             f"in the local cache")


def load_pretrained(loader, path: str, **kwargs):
    """`loader.from_pretrained(path, **kwargs)` for a transformers Auto class, where whatever the loader fails with
    (no connection to the hub, no such repository, a file missing from a folder) is one ValueError line saying what
    was looked for and where, with the loader's own first line."""
    try:
        return loader.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        said = (str(e).strip().splitlines() or [type(e).__name__])[0][:240]
        if Path(path).is_dir():
            where = f"the folder {Path(path).resolve()}"
        else:
            from huggingface_hub import constants
            where = f"no folder {Path(path).resolve()}, then the hub repository {path!r} at {constants.ENDPOINT}"
        raise ValueError(f"model_path {path!r}: {loader.__name__} could not load it (looked in {where}): {said}") \
            from None
