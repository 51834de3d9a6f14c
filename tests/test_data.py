"""plumbing/data.py: JSONL readers accept good rows and name the file and line of a bad one."""
import json

import pytest

from plumbing.data import check_model_path, load_conversations, load_problems, write_jsonl
from protocol import TOOL_NAME

pytestmark = pytest.mark.spec  # the one-minute tier: make test-fast

GOOD_CONVERSATION = [
    {"role": "user", "content": "Compute 12*34."},
    {"role": "assistant", "content": "Use Python.</reason>\n",
     "tool_calls": [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": "print(12*34)"}}}]},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "</reason>\n<answer>\\boxed{408}</answer>"},
]


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_write_then_load_problems_round_trips_and_keeps_extra_fields(tmp_path):
    rows = [{"problem": "Compute 1+1.", "answer": "2", "level": 1}, {"problem": "Cafe é?", "answer": "\\frac{1}{2}"}]
    path = write_jsonl(tmp_path / "sub" / "p.jsonl", rows)
    assert load_problems(path) == rows
    assert path.read_text(encoding="utf-8").count("\n") == 2


def test_load_problems_turns_integer_answer_into_string_and_skips_blank_lines(tmp_path):
    path = _write_lines(tmp_path / "p.jsonl", ['{"problem": "x", "answer": 25}', "", '{"problem": "y", "answer": "3"}'])
    assert [r["answer"] for r in load_problems(path)] == ["25", "3"]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"answer": "3"}', "'problem' must be a non-empty string"),
    ('{"problem": "x"}', "'answer' must be a non-empty string"),
    ('{"problem": "  ", "answer": "3"}', "'problem' must be a non-empty string"),
    ('{"problem": "x", "answer": ""}', "'answer' must be a non-empty string"),
    ('{"problem": "x", "answer": true}', "'answer' must be a non-empty string"),
])
def test_load_problems_names_file_and_line_of_a_bad_row(tmp_path, bad_line, message):
    path = _write_lines(tmp_path / "p.jsonl", ['{"problem": "ok", "answer": "1"}', "", bad_line])
    with pytest.raises(ValueError) as e:
        load_problems(path)
    assert f"{path}:3:" in str(e.value) and message in str(e.value)


def test_missing_and_empty_files_are_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_problems(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no problems"):
        load_problems(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="no conversations"):
        load_conversations(tmp_path / "empty.jsonl")


def test_load_conversations_accepts_a_tool_conversation(tmp_path):
    path = _write_lines(tmp_path / "c.jsonl", [json.dumps({"messages": GOOD_CONVERSATION, "kind": "tool"})])
    assert load_conversations(path) == [GOOD_CONVERSATION]


@pytest.mark.parametrize("messages, message", [
    ("not a list", "expected 'messages'"),
    (GOOD_CONVERSATION[:3], "must end with an assistant answer"),
    ([GOOD_CONVERSATION[1]] + GOOD_CONVERSATION, "expected a user message"),
    ([GOOD_CONVERSATION[0], {"role": "tool", "content": "1"}], "expected role 'assistant'"),
    (GOOD_CONVERSATION[:1] + [{**GOOD_CONVERSATION[1], "tool_calls": [{"function": {"name": "rm", "arguments": {}}}]}]
     + GOOD_CONVERSATION[2:], "tool call must name"),
    ([GOOD_CONVERSATION[0], {"role": "assistant", "content": 3}], "'content' must be a string"),
])
def test_load_conversations_names_line_of_a_bad_conversation(tmp_path, messages, message):
    lines = [json.dumps({"messages": GOOD_CONVERSATION}), json.dumps({"messages": messages})]
    path = _write_lines(tmp_path / "c.jsonl", lines)
    with pytest.raises(ValueError) as e:
        load_conversations(path)
    assert f"{path}:2:" in str(e.value) and message in str(e.value)


def test_check_model_path_accepts_a_model_folder_or_hub_id_only(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a whole model folder: config.json but no weights"):
        check_model_path(str(tmp_path / "model"))  # e.g. a copy cut short, or a stage's out_dir given for model/
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a whole model folder: no tokenizer"):
        check_model_path(str(tmp_path / "model"))  # transformers would build an empty one and encode text to []
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    check_model_path(str(tmp_path / "model"))
    check_model_path("Qwen/Qwen3-14B-Base")  # a hub id is left to transformers
    for bad in [str(tmp_path), str(tmp_path / "missing"), "", "no_such_run/tiny/base/", "./model", "name"]:
        with pytest.raises(ValueError, match="not a model folder"):
            check_model_path(bad)


def test_problem_rows_know_their_file_and_line(tmp_path):
    rows = ['{"problem": "a", "answer": "1"}', "", '{"problem": "b", "answer": "2"}']
    path = _write_lines(tmp_path / "p.jsonl", rows)
    rows = load_problems(path)
    assert [r.where for r in rows] == [f"{path}:1", f"{path}:3"]
    assert json.dumps(rows[1]) == '{"problem": "b", "answer": "2"}'  # the location is not part of the row


@pytest.mark.parametrize("raw, message", [
    ('{"problem": "caf\xe9", "answer": "1"}'.encode("latin-1"), "not UTF-8 text (byte 0xe9 at column 17)"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
    (b'{"problem": "x", "answer": ' + b"9" * 5000 + b"}", "not valid JSON (Exceeds the limit"),
])
def test_unreadable_lines_name_file_and_line(tmp_path, raw, message):
    path = tmp_path / "p.jsonl"
    for load, good in [(load_problems, '{"problem": "ok", "answer": "1"}'),
                       (load_conversations, json.dumps({"messages": GOOD_CONVERSATION}))]:
        path.write_bytes(good.encode() + b"\n\n" + raw + b"\n")
        with pytest.raises(ValueError) as e:
            load(path)
        assert str(e.value).startswith(f"{path}:3: {message}"), str(e.value)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"problem": "x", "answer": "1"}\n')
    assert load_problems(path) == [{"problem": "x", "answer": "1"}]


def test_answers_written_as_numbers_mean_their_text(tmp_path):
    path = _write_lines(tmp_path / "p.jsonl", [json.dumps({"problem": "x", "answer": a}) for a in
                                                [25, -3, 0.5, 2.50, 1e-07, 12345678901234567890]])
    assert [r["answer"] for r in load_problems(path)] == ["25", "-3", "0.5", "2.5", "1e-07", "12345678901234567890"]
    for bad in ["1e400", "NaN", "false", "[1]"]:
        _write_lines(path, ['{"problem": "x", "answer": %s}' % bad])
        with pytest.raises(ValueError, match=r"p.jsonl:1: 'answer' must be a non-empty string or a finite number"):
            load_problems(path)


def test_a_mistyped_local_model_folder_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "sft").mkdir(parents=True)
    (tmp_path / "runs" / "sft" / "config.json").write_text("{}")
    (tmp_path / "runs" / "sft" / "model.safetensors").write_bytes(b"")
    (tmp_path / "runs" / "sft" / "tokenizer.json").write_text("{}")
    check_model_path("runs/sft")
    with pytest.raises(ValueError, match=r"'runs/sft_typo' is not a model folder \(no such folder in runs/"):
        check_model_path("runs/sft_typo")
    check_model_path("Qwen/Qwen3-14B-Base")  # no folder Qwen/ here: a hub id


def test_offline_a_hub_id_must_be_in_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set and the hub id is not in the local cache"):
        check_model_path("Qwen/Qwen3-14B-Base")
