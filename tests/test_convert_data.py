"""tools/convert_data.py on small local fixtures in the public sets' layouts (no network): the DAPO prompt stripped, the
repeated block and conflicting answers handled, MATH's boxed answers, decontamination against data/."""
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import errors as hub_errors

from tools import convert_data
from tools.convert_data import DAPO_PREFIX, DAPO_SUFFIX, last_boxed
from plumbing.data import load_conversations, load_problems


def dapo(problem, answer, index):
    """A row as DAPO-Math-17k's parquet file holds it (pyarrow's to_pylist gives these dicts)."""
    return {"data_source": "math_dapo", "prompt": [{"content": DAPO_PREFIX + problem + DAPO_SUFFIX, "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dapo_rows_become_unique_problems_with_integer_answers(tmp_path, capsys, data_dir):
    aime = load_problems(data_dir / "aime24.jsonl")[0]
    block = [dapo("Find $1+1$.", "2", "a"), dapo("How many  primes\nare below 10?", "4", "b"),
             dapo("Compute $x$.", "5", "c"), dapo(aime["problem"], aime["answer"], "d"),
             dapo("Compute $x$.", "6", "e")]  # the same text with another answer: ambiguous, dropped
    block.append(dapo("How many primes are below 10?", "4", "f"))  # the same problem, other whitespace
    src = write(tmp_path / "dapo.jsonl", block * 3)  # the released file repeats its block (100 times)
    out = tmp_path / "out.jsonl"
    convert_data.main(["dapo", str(src), str(out), "--decontaminate", str(data_dir / "aime24.jsonl")])
    rows = load_problems(out)
    assert [(r["problem"], r["answer"], r["id"]) for r in rows] == [("Find $1+1$.", "2", "a"),
                                                                   ("How many  primes\nare below 10?", "4", "b")]
    assert rows[0]["source"] == "dapo.jsonl:a"
    assert capsys.readouterr().out.strip().endswith(
        "2 problems from 18 rows; dropped no answer 0, repeats 14, conflicting 1, not integer 0, in eval sets 1")


def test_open_r1_processed_layout_is_read_too(tmp_path):
    src = write(tmp_path / "p.jsonl", [{"prompt": "Find $2+3$.", "solution": "5", "data_source": "x"}])
    out = tmp_path / "out.jsonl"
    convert_data.main(["dapo", str(src), str(out), "--decontaminate"])
    assert [(r["problem"], r["answer"]) for r in load_problems(out)] == [("Find $2+3$.", "5")]


def test_math_release_folder_answers_from_the_last_box(tmp_path):
    train = tmp_path / "MATH" / "train"
    for name, problem, solution in [
            ("algebra/1.json", "What is $3 \\cdot 4$?", "It is $\\boxed{12}$."),
            ("algebra/2.json", "Half of 1?", "First $\\boxed{2}$, no: $\\boxed{\\frac{1}{2}}$."),
            ("geometry/3.json", "No box here.", "The answer is 7.")]:
        (train / name).parent.mkdir(parents=True, exist_ok=True)
        (train / name).write_text(json.dumps({"problem": problem, "level": "Level 1", "type": "x",
                                              "solution": solution}))
    out = tmp_path / "out.jsonl"
    convert_data.main(["math", str(train), str(out), "--decontaminate"])
    assert [(r["problem"], r["answer"], r["id"]) for r in load_problems(out)] == [
        ("What is $3 \\cdot 4$?", "12", "algebra/1.json")]  # 1/2 is not an integer; no box: no answer
    convert_data.main(["math", str(train), str(out), "--decontaminate", "--all-answers"])
    assert [r["answer"] for r in load_problems(out)] == ["12", "\\frac{1}{2}"]


def test_last_boxed_balances_braces():
    assert last_boxed("so \\boxed{\\frac{a}{b^{2}}} done") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed{1} then \\fbox{x}") == "x"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="not found"):
        convert_data.main(["dapo", str(tmp_path / "missing.parquet"), str(tmp_path / "o.jsonl")])
    src = write(tmp_path / "m.jsonl", [{"problem": "x"}])
    with pytest.raises(SystemExit, match=r"m.jsonl: not a math file \(KeyError"):
        convert_data.main(["math", str(src), str(tmp_path / "o.jsonl"), "--decontaminate"])
    with pytest.raises(SystemExit, match="hub. downloads DAPO-Math-17k only"):
        convert_data.main(["math", "hub", str(tmp_path / "o.jsonl")])


HUB_MESSAGE = ("convert_data: the Hugging Face hub could not be reached ({}); download data/dapo-math-17k.parquet "
               "from https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k and give its path: "
               "python -m tools.convert_data dapo dapo-math-17k.parquet {}")


def test_hub_offline_is_one_line_saying_how_to_give_the_file(tmp_path):
    """The real download under HF_HUB_OFFLINE=1 (no wait on retries): one line on stderr, no traceback."""
    root = Path(convert_data.__file__).parents[1]
    out = tmp_path / "dapo.jsonl"
    done = subprocess.run([sys.executable, "-m", "tools.convert_data", "dapo", "hub", str(out)], cwd=root, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
                               "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == HUB_MESSAGE.format("LocalEntryNotFoundError, HF_HUB_OFFLINE is set", out) + "\n"
    assert not out.exists()


@pytest.mark.parametrize("error", ["LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError"])
def test_hub_unreachable_is_one_line_whichever_error_the_hub_client_raises(tmp_path, monkeypatch, error):
    """What huggingface_hub raises for no connection (after its retries), offline mode, or a connection lost
    mid-download; any other error is not taken for one of these."""
    made = {"LocalEntryNotFoundError": lambda: hub_errors.LocalEntryNotFoundError("no connection"),
            "OfflineModeIsEnabled": lambda: hub_errors.OfflineModeIsEnabled("offline"),
            "ConnectError": lambda: httpx2.ConnectError("[Errno -3] Temporary failure in name resolution")}[error]

    def download(*args, **kwargs):
        raise made()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(SystemExit) as stop:
        convert_data.main(["dapo", "hub", str(tmp_path / "o.jsonl")])
    assert str(stop.value) == HUB_MESSAGE.format(error, tmp_path / "o.jsonl")
    made = lambda: hub_errors.EntryNotFoundError("no such file in the dataset")  # noqa: E731
    with pytest.raises(hub_errors.EntryNotFoundError):
        convert_data.main(["dapo", "hub", str(tmp_path / "o.jsonl")])


def tir_row(problem, solution):
    """A row as NuminaMath-TIR's parquet file holds it: the solution also as a two-message conversation."""
    return {"problem": problem, "solution": solution,
            "messages": [{"content": problem, "role": "user"}, {"content": solution, "role": "assistant"}]}


def test_tir_solutions_become_tool_calling_conversations_with_the_tool_s_own_replies(tmp_path, capsys):
    solution = ("Let us count with Python.\n\n```python\nprint(sum(range(5)))\n```\n```output\n10\n```\n"
                "So the sum is $10$; check it:\n```python\nx = 10\nx * 2\n```\n```output\n20\n```\n"
                "The answer is $\\boxed{10}$.")
    rows = [tir_row("Sum 0..4.", solution),
            tir_row("Wrong record.", "```python\nprint(1 + 1)\n```\n```output\n3\n```\n$\\boxed{3}$"),
            tir_row("Fails here.", "```python\nprint(1 / 0)\n```\n```output\ninf\n```\n$\\boxed{0}$"),
            tir_row("No box.", "```python\nprint(2)\n```\n```output\n2\n```\nSo 2."),
            tir_row("Sum 0..4.", solution)]
    src, out = write(tmp_path / "tir.jsonl", rows), tmp_path / "sft.jsonl"
    convert_data.main(["tir", str(src), str(out), "--decontaminate", "--tool-workers", "1"])
    (conversation,) = load_conversations(out)  # renders in our protocol
    def call(code):
        return [{"function": {"name": "execute_python_code_with_standard_io", "arguments": {"code": code}}}]
    assert conversation == [
        {"role": "user", "content": "Sum 0..4."},
        {"role": "assistant", "content": "Let us count with Python.</reason>\n",
         "tool_calls": call("print(sum(range(5)))")},
        {"role": "tool", "content": "ok\n10\n"},  # ToolResult.render(), as a rollout shows it
        {"role": "assistant", "content": "So the sum is $10$; check it:</reason>\n",
         "tool_calls": call("x = 10\nx * 2")},
        {"role": "tool", "content": "ok\n20\n"},  # the tool's echo of a last expression
        {"role": "assistant", "content": "The answer is $\\boxed{10}$.</reason>\n<answer>\\boxed{10}</answer>"}]
    assert capsys.readouterr().out.strip().endswith(
        "1 conversations from 5 rows; dropped repeats 1, no usable code 1, tool output differs 2, in eval sets 0")


def test_converted_tir_tool_turns_are_what_a_rollout_appends_token_for_token(tmp_path, qwen_tokenizer_dir):
    """NuminaMath-TIR rows (parquet, the set's own layout) through tools/convert_data.py, on Qwen3-Base's vocabulary: for
    every tool turn of every converted conversation, the ids SFT trains around equal the ids a rollout appends after
    running the same call through the code tool (before: 0 of them did; the dataset's bare output is not what the
    tool shows)."""
    import rehearsal
    from code_tool import CodeTool
    from protocol import ToolCall, chat_format
    from rollout import Trajectory, append_tool_response
    from sft import build_labels
    from transformers import AutoTokenizer
    src = rehearsal.write_parquet(tmp_path / "train-00000-of-00001.parquet", rehearsal.tir_rows())
    out = tmp_path / "sft.jsonl"
    convert_data.main(["tir", str(src), str(out), "--decontaminate", "--tool-workers", "1"])
    tok, fmt = AutoTokenizer.from_pretrained(qwen_tokenizer_dir), chat_format("default")
    same, total = 0, 0
    with CodeTool(workers=1, max_output_chars=1000) as tool:  # the settings of the Qwen3 RL configs
        for messages in load_conversations(out):
            segments = fmt.render_messages(messages)
            for k, message in enumerate(messages):
                if message.get("tool_calls"):
                    code = message["tool_calls"][0]["function"]["arguments"]["code"]
                    traj = Trajectory("p", [0])
                    append_tool_response(traj, ToolCall(code=code), tool.run(code), tok, 100_000, fmt)
                    sft_turn = build_labels(tok, segments[k + 1:k + 2])[0]  # the segment after the call
                    same += traj.response_ids == sft_turn
                    total += 1
    assert total == 3 and same == total
