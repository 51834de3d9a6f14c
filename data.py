"""Reading and writing the project's JSONL data files, with errors that name the file and the line.

Two kinds of file, one JSON object per line (blank lines are skipped):
- problems (RL and evaluation data): {"problem": str, "answer": str, ...}; extra fields (id, level, source) are kept.
  The RL data of the report has integer answers, and evaluation sets such as MATH-500 have LaTeX ones: both are
  strings here. An integer answer is accepted and turned into its decimal string.
- conversations (SFT data): {"messages": [...]} in the common chat format with tool calls, checked by rendering it
  through `protocol.ChatFormat.render_messages` (the same rendering SFT trains on).

A bad line raises ValueError("path:line: what is wrong") before the caller does any work. Nothing here knows about
models or tokenizers.
"""
import json
from pathlib import Path

from protocol import ChatFormat


def _read_jsonl(path):
    """Yield (line_number, object) for each non-blank line; ValueError names the file and line otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: data file not found")
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            yield number, row


def load_problems(path) -> list[dict]:
    """Problems from a JSONL file: each row a dict with non-empty string `problem` and `answer` (plus any extras)."""
    rows = []
    for number, row in _read_jsonl(path):
        for key in ("problem", "answer"):
            value = row.get(key)
            if key == "answer" and isinstance(value, int) and not isinstance(value, bool):
                row[key] = value = str(value)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{path}:{number}: '{key}' must be a non-empty string, got {value!r}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no problems in the file")
    return rows


def load_conversations(path, chat: ChatFormat | None = None) -> list[list[dict]]:
    """Conversations from a JSONL file of {"messages": [...]} rows; each is checked by rendering it with `chat`
    (any ChatFormat will do for the check: the replaceable texts do not change what is valid)."""
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


def check_model_path(path: str) -> None:
    """A model is a local folder with config.json, or a hub id `org/name` (fetched by transformers when online).
    Anything else is an input error, reported before any work instead of deep inside from_pretrained."""
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file():
        return
    if p.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(f"model_path {path!r} is not a model folder (no config.json there)")

