"""tiny/task.py: deterministic, disjoint splits with correct answers; SFT traces that render and show real tool text."""
import json
import random
import re

import pytest

from code_tool import CodeTool
from plumbing.data import load_conversations, load_problems
from protocol import chat_format
from tiny.task import buggy_code, draw_problem, main, near_miss, trace_kinds, write_task

SIZES = {"n_train": 40, "n_test": 15, "n_sft": 60, "n_val": 10}
MIX = {"direct": 0.4, "tool": 0.2, "sloppy": 0.2, "fix": 0.2}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("task"), seed=3, mix=MIX, **SIZES)


def _solve(text: str) -> int:
    """An independent solver for the five problem templates (regex on the text, no generator code)."""
    if m := re.fullmatch(r"Compute (\d+)\+(\d+)\*(\d+)\.", text):
        return int(m[1]) + int(m[2]) * int(m[3])
    if m := re.fullmatch(r"Compute (\d+)\*(\d+)\.", text):
        return int(m[1]) * int(m[2])
    if m := re.fullmatch(r"Compute (\d+)\*(\d+) mod (\d+)\.", text):
        return int(m[1]) * int(m[2]) % int(m[3])
    if m := re.fullmatch(r"Digit sum of (\d+)\*\*(\d+)\.", text):
        return sum(int(d) for d in str(int(m[1]) ** int(m[2])))
    if m := re.fullmatch(r"Count n in 1\.\.(\d+) with n%(\d+)==(\d+)\.", text):
        return len([n for n in range(1, int(m[1]) + 1) if n % int(m[2]) == int(m[3])])
    raise AssertionError(f"unknown template: {text!r}")


def _sft(task):
    return [json.loads(line) for line in task["sft"].read_text().splitlines()]


def test_same_seed_same_files_and_cli_matches(task, tmp_path):
    main([str(tmp_path / "cli"), "--seed", "3", "--n-train", "40", "--n-test", "15", "--n-sft", "60", "--n-val", "10",
          "--direct", "0.4", "--tool", "0.2", "--sloppy", "0.2", "--fix", "0.2"])
    for split, path in task.items():
        assert (tmp_path / "cli" / path.name).read_bytes() == path.read_bytes(), split
    other = write_task(tmp_path / "seed4", seed=4, mix=MIX, **SIZES)
    assert other["test"].read_bytes() != task["test"].read_bytes()


@pytest.mark.spec
def test_splits_have_their_sizes_and_levels_and_are_disjoint(task):
    test, train1, train2, val = (load_problems(task[k]) for k in ("test", "train_level1", "train_level2", "val"))
    assert [p["level"] for p in test] == [1] * 15 + [2] * 15 and [p["level"] for p in val] == [1] * 10 + [2] * 10
    assert len(train1) == len(train2) == 40 and {p["level"] for p in train1} == {1} and {p["level"] for p in train2} == {2}
    sft_problems = [row["messages"][0]["content"] for row in _sft(task)]
    splits = [[p["problem"] for p in s] for s in (test, train1, train2, val)] + [sft_problems]
    texts = [t for s in splits for t in s]
    assert len(texts) == len(set(texts)) == 30 + 80 + 20 + 60
    assert {"code"}.isdisjoint(test[0])  # the generator's solution is not shipped with the problems


@pytest.mark.spec
def test_answers_are_correct_integers(task):
    rows = [p for k in ("test", "train_level1", "train_level2") for p in load_problems(task[k])]
    rows += [{"problem": r["messages"][0]["content"], "answer": r["answer"]} for r in _sft(task)]
    for p in rows:
        assert p["answer"] == str(_solve(p["problem"])), p
    level2 = {re.sub(r"\d+", "#", p["problem"]) for p in load_problems(task["train_level2"])}
    assert level2 == {"Compute #*# mod #.", "Digit sum of #**#.", "Count n in #..# with n%#==#."}


@pytest.mark.spec
def test_sft_conversations_render_and_follow_their_trace_kind(task):
    rows = _sft(task)
    conversations = load_conversations(task["sft"], chat_format("compact", ""))
    assert conversations == [r["messages"] for r in rows]
    for row in rows:
        msgs, answer = row["messages"], row["answer"]
        roles = [m["role"] for m in msgs]
        final = msgs[-1]["content"]
        numbers = set(re.findall(r"\d+", msgs[0]["content"]))
        thought = msgs[1]["content"].split("</reason>")[0]  # decision word, then the problem's numbers restated
        assert thought.split(":")[0] == {"direct": "Guess", "tool": "Tool", "sloppy": "Tool", "fix": "Tool"}[row["kind"]]
        assert numbers - {"1"} <= set(re.findall(r"\d+", thought)) <= numbers  # ("1" of "1..N" is not restated)
        assert final.endswith("</answer>") and "</reason>\n<answer>\\boxed{" in final
        if row["kind"] == "direct":
            assert roles == ["user", "assistant"]
        elif row["kind"] == "tool":
            assert roles == ["user", "assistant", "tool", "assistant"] and final.endswith(f"{{{answer}}}</answer>")
            assert msgs[2]["content"] == f"ok\n{answer}\n"
        elif row["kind"] == "sloppy":  # the result is printed, then the leftover line fails; the answer is right
            assert roles == ["user", "assistant", "tool", "assistant"] and final.endswith(f"{{{answer}}}</answer>")
            assert msgs[2]["content"].startswith(f"error\n{answer}\nTraceback") and "NameError" in msgs[2]["content"]
        else:
            assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
            assert msgs[2]["content"].startswith("error\n") and msgs[4]["content"] == f"ok\n{answer}\n"
            first, fixed = (msgs[i]["tool_calls"][0]["function"]["arguments"]["code"] for i in (1, 3))
            assert first != fixed and final.endswith(f"{{{answer}}}</answer>")


def test_tool_responses_are_exactly_what_code_tool_renders(task):
    calls, shown = [], []
    for row in _sft(task):
        msgs = row["messages"]
        for call_msg, tool_msg in zip(msgs[1::2], msgs[2::2]):
            calls.append((call_msg["tool_calls"][0]["function"]["arguments"]["code"], ""))
            shown.append(tool_msg["content"])
    assert len(calls) > 20
    with CodeTool(workers=2) as tool:
        assert [r.render() for r in tool.run_batch(calls)] == shown


@pytest.mark.spec
def test_trace_mix_and_direct_answers_follow_the_settings(task):
    rows = _sft(task)
    kinds = [r["kind"] for r in rows]
    assert {k: kinds.count(k) for k in MIX} == {"direct": 24, "tool": 12, "sloppy": 12, "fix": 12}
    counts = trace_kinds(1000, {"direct": 0.45, "tool": 0.35, "fix": 0.2}, random.Random(0))
    assert abs(counts.count("tool") - 350) <= 1 and abs(counts.count("fix") - 200) <= 1
    guesses = [(r["messages"][1]["content"], r["answer"]) for r in rows if r["kind"] == "direct"]
    right = sum(f"\\boxed{{{a}}}" in text for text, a in guesses)
    assert 0 < right < len(guesses) / 2  # default direct_correct = 0.2: mostly wrong, sometimes right


def test_near_miss_and_buggy_code_are_plausible_but_wrong():
    rng = random.Random(0)
    for answer in ["7", "10", "30883", "100000"]:
        for _ in range(50):
            miss = near_miss(answer, rng)
            assert miss != answer and len(miss) == len(answer) and (len(miss) == 1 or miss[0] != "0")
            assert sum(a != b for a, b in zip(miss, answer)) == 1
    codes = ["print(347*89)", "print(sum(map(int,str(37**12))))", "print(sum(n%7==3 for n in range(1,501)))"]
    bugs = [buggy_code(code, rng) for code in codes for _ in range(8)]
    with CodeTool(workers=2) as tool:
        assert all(r.status == "error" for r in tool.run_batch([(b, "") for b in bugs]))
    assert len(set(bugs)) >= 6


def test_error_format_and_sloppy_line_reach_the_sft_tool_text(tmp_path):
    paths = write_task(tmp_path / "short", seed=3, mix=MIX, error_format="last_line", sloppy_line="exit(1)", **SIZES)
    default = write_task(tmp_path / "default", seed=3, mix=MIX, **SIZES)
    for split in ("test", "train_level1", "train_level2"):  # the problems do not depend on the tool's rendering
        assert paths[split].read_text() == default[split].read_text()
    rows = _sft(paths)
    sloppy = [r for r in rows if r["kind"] == "sloppy"]
    fix = [r for r in rows if r["kind"] == "fix"]
    assert sloppy and fix
    for r in sloppy:
        assert r["messages"][1]["tool_calls"][0]["function"]["arguments"]["code"].endswith("\nexit(1)")
        assert r["messages"][2]["content"] == f"error\n{r['answer']}\nSystemExit: 1\n"
    for r in fix:  # one line: the exception, no traceback
        shown = r["messages"][2]["content"]
        assert shown.startswith("error\n") and shown.count("\n") == 2 and "Traceback" not in shown
        assert re.search(r"^error\n(SyntaxError|NameError|TypeError): ", shown)


def test_the_validation_split_is_drawn_last_and_leaves_the_other_splits_as_they_were(task, tmp_path):
    without = write_task(tmp_path / "no_val", seed=3, mix=MIX, **{**SIZES, "n_val": 0})
    for split in ("test", "sft", "train_level1", "train_level2"):
        assert without[split].read_bytes() == task[split].read_bytes(), split
    assert without["val"].read_text() == "" and len(load_problems(task["val"])) == 20


@pytest.mark.spec
def test_the_level2_kinds_keep_equal_shares_in_the_last_split_drawn():
    # The default task's level-2 draws in its order: test 100, SFT ~1,600 (40% of 4,000), RL 2,000, validation 100.
    rng, seen = random.Random(0), set()
    drawn = [re.sub(r"\d+", "#", draw_problem(rng, 2, seen)["problem"]) for _ in range(3800)]
    for part in (drawn[:100], drawn[1700:3700]):  # test, then RL's train_level2
        shares = {kind: part.count(kind) / len(part) for kind in set(drawn)}
        assert len(shares) == 3 and all(0.25 < v < 0.42 for v in shares.values()), shares
