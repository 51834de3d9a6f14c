"""tools/report.py on a recorded evaluation (tests/data/eval_recorded, written by rollout.trajectory_record:
2 benchmarks, 4 problems x 2 samples, every tool-call status, a model answer holding <script>):
the page's data, escaping, the comparison of two evaluations, bad input; then the pages in
headless Chromium (tools/browser.py), and the browser check failing on broken pages."""
import json
import re
import shutil
from pathlib import Path

import pytest

from tools import browser
import eval as ev
from tools import report
from rollout import ToolCallRecord, Trajectory

RECORDED = Path(__file__).resolve().parent / "data" / "eval_recorded"
HOSTILE = '</script><script>window.PWNED=1</script><img src=x onerror="window.PWNED=2">'


def page_data(page: str) -> dict:
    """The JSON the page embeds, read back as the page's JSON.parse reads it."""
    match = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


def recorded_page() -> str:
    results, records, model_path = report.load_eval(RECORDED)
    return report.render_report(results, records, "recorded", f"model: {model_path}")


def samples(data: dict, bench: int) -> list[dict]:
    return [s for p in data["benchmarks"][bench]["problems"] for s in p["samples"]]


# ------------------------------------------------------------------------------ the page's content
def test_recorded_fixture_is_in_the_format_eval_writes():
    traj = Trajectory("p", [0], response_ids=[1], loss_mask=[1], turns=["x"],
                      tool_calls=[ToolCallRecord("c", "", "ok\n", "ok")], end_reason="answer")
    expected = ev.trajectory_record("b", {"problem": "p", "answer": "1"}, 0, 0, traj)
    for line in (RECORDED / "trajectories.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert set(record) == set(expected)
        assert all(set(c) == set(expected["tool_calls"][0]) for c in record["tool_calls"])


def test_report_of_recorded_eval_counts_statuses_and_filter_flags():
    page = recorded_page()
    data = page_data(page)
    assert data["kind"] == "report"
    assert [b["name"] for b in data["benchmarks"]] == ["arith", "algebra"]  # results.json's order
    arith, algebra = data["benchmarks"]
    assert [(p["index"], p["id"], p["correct"], len(p["samples"])) for p in arith["problems"]] == [
        (0, "a0", 2, 2), (1, "a1", 0, 2), (2, "a2", 1, 2)]
    assert [(p["answer"], p["correct"]) for p in algebra["problems"]] == [("2", 1)]
    # Each arith sample's call statuses and filter flags, worked out from the fixture by hand.
    assert [s["statuses"] for s in samples(data, 0)] == [
        ["ok"], ["error", "ok"], ["parse_error", "timeout"], ["ok"], ["memory", "ok"],
        ["output_limit"]]
    assert [s["flags"] for s in samples(data, 0)] == [
        [], ["tool_error", "correct_erroneous"], ["wrong", "tool_error"], ["wrong"],
        ["tool_error", "correct_erroneous"], ["wrong", "tool_error"]]
    assert [len(s["turns"]) for s in samples(data, 0)] == [2, 3, 3, 2, 3, 2]
    assert report.flag_counts(arith["problems"]) == {"samples": 6, "wrong": 3, "tool_error": 4,
                                                     "correct_erroneous": 2}
    # The results table: results.json's metrics, and counts linking to the filtered rollouts.
    row = "<td>3 × 2</td><td>0.500</td><td>0.289</td><td>0.667</td><td>0.667</td><td>1.50</td>"
    assert row in page
    assert '<a href="#b=0&amp;show=wrong">3</a>' in page
    assert '<a href="#b=0&amp;show=correct_erroneous">2</a>' in page
    assert '<a href="#b=1&amp;show=wrong">1</a>' in page
    assert "<td>-</td>" in page  # algebra's se and error rates are None
    assert "model: runs/recorded/model" in page


def test_turns_pair_with_the_calls_they_made():
    s = samples(page_data(recorded_page()), 0)
    # A syntax error, then its fix: each turn with its own call, code and response.
    fixed = s[1]["turns"]
    assert [t["call"]["status"] for t in fixed[:2]] == ["error", "ok"]
    assert (fixed[1]["call"]["code"], fixed[1]["call"]["response"]) == ("print(12*34)", "ok\n408\n")
    assert fixed[0]["text"] == "Let me compute.\n" and "call" not in fixed[2]
    assert "\\boxed{408}" in fixed[2]["text"] and fixed[2]["after"] == ""
    # A call that did not parse keeps what the model wrote; one in the last allowed turn never ran.
    assert s[2]["turns"][1]["call"]["status"] == "parse_error"
    assert '"print(7**20 % 13)"' in s[2]["turns"][1]["call_text"]
    assert s[5]["end"] == "max_turns" and "call" not in s[5]["turns"][1]
    assert "print(2**10)" in s[5]["turns"][1]["call_text"]
    # A turn cut by the budget inside its call: the unfinished call is text, not a call.
    cut = samples(page_data(recorded_page()), 1)[1]
    assert cut["end"] == "length" and cut["calls"] == 0
    assert cut["turns"][0]["call_text"].startswith("<tool_call>")
    call = "<tool_call>x</tool_call>"
    assert report.split_turn(f"a{call}b") == ("a", call, "b")
    assert report.split_turn("no call") == ("no call", "", "")


def test_page_keeps_untrusted_text_as_text():
    page = recorded_page()
    # Only the page's own two script blocks: the model's "</script><script>" neither closed one
    # nor opened a third.
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert "<img" not in page and "onerror" in page  # there as data only
    hostile = samples(page_data(page), 0)[3]
    assert HOSTILE in hostile["turns"][0]["text"]
    assert HOSTILE in hostile["turns"][0]["call"]["response"]
    assert hostile["pred"] == "<script>window.PWNED=3</script>"
    # Names that go into the HTML itself are escaped.
    named = report.render_report({"<b>x</b>": {"problems": 0, "samples": 1}}, [], "<i>t</i>")
    assert "&lt;b&gt;x&lt;/b&gt;" in named and "<b>x" not in named
    assert "<title>&lt;i&gt;t&lt;/i&gt;</title>" in named


# ------------------------------------------------------------------------------ comparison
def test_changed_problems_by_hand():
    def problem(index, rewards):
        return {"index": index, "id": None, "problem": f"p{index}", "answer": "1",
                "correct": sum(rewards),
                "samples": [{"sample": j, "reward": r} for j, r in enumerate(rewards)]}
    a = [problem(0, [0, 0, 0, 0]), problem(1, [1, 1, 1, 1]), problem(2, [1, 0, 0, 0]),
         problem(3, [1, 1, 0, 0])]
    b = [problem(0, [0, 1, 0, 1]), problem(1, [1, 1, 0, 1]), problem(2, [0, 0, 0, 0]),
         problem(3, [0, 1, 1, 0])]
    rows = report.changed_problems(a, b)
    # +0.5 first, then the two -0.25 in index order; problem 3 is 2 of 4 both times.
    assert [(r["index"], r["delta"], r["flags"]) for r in rows] == [
        (0, 0.5, ["better"]), (1, -0.25, ["worse"]), (2, -0.25, ["worse"])]
    # a gain shows a wrong sample of A and a right one of B; a loss the other way round
    assert [(r["samples"][0]["sample"], r["samples"][1]["sample"]) for r in rows] == [
        (0, 1), (0, 2), (0, 0)]
    b[1]["problem"] = "another problem"
    with pytest.raises(ValueError, match="problem 1 differs"):
        report.changed_problems(a, b)


def flipped_copy(tmp_path) -> Path:
    """The recorded evaluation with arith problem 0 lost and problem 1 solved by its sample 1."""
    out = tmp_path / "later"
    out.mkdir()
    shutil.copy(RECORDED / "results.json", out)
    records = [json.loads(x) for x in (RECORDED / "trajectories.jsonl").read_text().splitlines()]
    for r in records:
        if r["benchmark"] == "arith" and (r["problem_index"], r["sample"]) == (1, 1):
            r["reward"] = 1.0
        if r["benchmark"] == "arith" and r["problem_index"] == 0:
            r["reward"] = 0.0
    (out / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def test_compare_lists_the_problems_that_changed(tmp_path):
    out = report.write_compare(RECORDED, flipped_copy(tmp_path), tmp_path / "c" / "compare.html")
    page = out.read_text()
    data = page_data(page)
    assert data["kind"] == "compare" and data["labels"] == ["eval_recorded", "later"]
    arith, algebra = data["benchmarks"]
    assert [(p["index"], p["correct"], p["delta"]) for p in arith["problems"]] == [
        (0, [2, 0], -1.0), (1, [0, 1], 0.5)]
    assert algebra["problems"] == []
    lost, gained = arith["problems"]
    assert [s["reward"] for s in lost["samples"]] == [1.0, 0.0]
    assert [s["reward"] for s in gained["samples"]] == [0.0, 1.0]
    assert gained["samples"][1]["sample"] == 1  # B's sample that solved it
    assert '<a href="#b=0&amp;show=better">1</a>' in page
    assert '<a href="#b=0&amp;show=worse">1</a>' in page


def test_bad_input_is_one_line_naming_file_line_and_key(tmp_path):
    shutil.copy(RECORDED / "results.json", tmp_path)
    lines = (RECORDED / "trajectories.jsonl").read_text().splitlines()
    broken = json.loads(lines[2])
    del broken["turns"]
    (tmp_path / "trajectories.jsonl").write_text("\n".join(lines[:2] + [json.dumps(broken)]) + "\n")
    with pytest.raises(SystemExit, match=r"trajectories.jsonl:3: missing key 'turns'$"):
        report.main([str(tmp_path)])
    with pytest.raises(SystemExit, match=r"results.json: not found"):
        report.main([str(tmp_path / "nowhere")])
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text(json.dumps({"benchmarks": {"zzz": {}}}))
    (other / "trajectories.jsonl").write_text(lines[0] + "\n")
    with pytest.raises(SystemExit, match="share no benchmark"):
        report.main(["compare", str(RECORDED), str(other), str(tmp_path / "c.html")])


# ------------------------------------------------------------------------------ in a real browser
def have_chromium() -> bool:
    try:
        return bool(browser.find_chromium())
    except FileNotFoundError:
        return False


browser_test = pytest.mark.skipif(not have_chromium(),
                                  reason="needs Chromium (Debian: apt-get install chromium)")

# The problems shown after a reader picks a filter (the select's change event).
VISIBLE_AFTER = """(name, value) => {
  const box = document.querySelector("select[name=" + name + "]");
  box.value = value;
  box.dispatchEvent(new Event("change"));
  return document.querySelectorAll("details.problem:not(.hidden)").length;
}"""
# Follow a link of the results table; then the filter's value and the problems shown.
FOLLOW_LINK = """location.hash = "b=1&show=wrong";
new Promise(done => setTimeout(() => done(document.querySelector("select[name=show]").value + " " +
  document.querySelectorAll("details.problem:not(.hidden)").length), 50))"""


def choose(name: str, value: str) -> str:
    return f"({VISIBLE_AFTER})({json.dumps(name)}, {json.dumps(value)})"


@browser_test
def test_report_in_chromium_renders_filters_and_keeps_scripts_inert(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(recorded_page())
    result = browser.open_page(f"{page}#b=0&open=1", expressions=(
        "document.querySelectorAll('details.problem').length",
        "document.querySelectorAll('.call').length",  # problem 1 is open: 2 + 1 calls
        "[...document.querySelectorAll('.call .status')].map(e => e.textContent).join(' ')",
        "window.PWNED === undefined && document.images.length === 0",
        f"document.body.innerText.includes({json.dumps(HOSTILE)})",  # shown, as text
        "window.scrollY > 0",  # the link scrolled to the problem it opened
        choose("show", "wrong"), choose("show", "correct_erroneous"), choose("show", "tool_error"),
        choose("show", ""), choose("status", "timeout"), choose("status", ""),
        choose("turns", "3"), FOLLOW_LINK))
    assert result.errors == [] and not result.blank
    assert result.requests == [page.resolve().as_uri()]  # nothing fetched from anywhere else
    assert result.values[:6] == [4, 3, "timeout parse_error ok", True, True, True]
    # wrong: arith 1, 2 and algebra 0; correct with a failed call: arith 0, 2; failed call:
    # arith 0, 1, 2; a timeout: arith 1; 3 turns: arith 0, 1, 2
    assert result.values[6:13] == [3, 2, 3, 4, 1, 4, 3]
    assert result.values[13] == "wrong 3"
    assert result.facts["rendered_ms"] is not None and result.facts["load_ms"] > 0


@browser_test
def test_compare_page_in_chromium(tmp_path):
    out = report.write_compare(RECORDED, flipped_copy(tmp_path), tmp_path / "compare.html")
    result = browser.open_page(f"{out}#b=0&open=first", expressions=(
        "document.querySelectorAll('.side .sample').length",
        choose("show", "better"), choose("show", "worse")))
    assert result.errors == [] and not result.blank
    assert result.values == [2, 1, 1]


@browser_test
def test_browser_check_fails_on_a_script_error_a_blank_page_and_a_fetch(tmp_path):
    broken = tmp_path / "broken.html"  # the report with invalid JSON in its data block
    broken.write_text(recorded_page().replace('"kind":"report"', '"kind":"report",'))
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body><div id='main'></div></body></html>")
    fetching = tmp_path / "fetching.html"
    fetching.write_text("<p>text</p><script src='http://127.0.0.1:9/x.js'></script>")
    bad = browser.open_page(str(broken))
    assert any("SyntaxError" in e for e in bad.errors) and bad.facts["rendered_ms"] is None
    with pytest.raises(SystemExit, match="page check failed: errors"):
        browser.main(["check", str(broken)])
    with pytest.raises(SystemExit, match="page check failed: a blank page"):
        browser.main(["screenshot", str(blank), str(tmp_path / "blank.png")])
    assert not (tmp_path / "blank.png").exists()
    fetched = browser.open_page(str(fetching))
    assert "http://127.0.0.1:9/x.js" in fetched.requests and fetched.errors  # a failed load


@browser_test
def test_screenshot_command_writes_the_png(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(recorded_page())
    browser.main(["screenshot", f"{page}#open=first", str(tmp_path / "shot.png"), "800", "600"])
    png = (tmp_path / "shot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == 800 and int.from_bytes(png[20:24], "big") == 600


def training_rollouts(tmp_path) -> Path:
    """The recorded evaluation as a training step's rollout file: sample 0 of every problem kept by RoC (advantage
    +0.5 when right, -0.5 when wrong, mini-batch = problem index), sample 1 not trained on."""
    records = [json.loads(x) for x in (RECORDED / "trajectories.jsonl").read_text().splitlines()]
    path = tmp_path / "run" / "rollouts" / "step_000007.jsonl"
    path.parent.mkdir(parents=True)
    rows = [{**r, "benchmark": "step 7", "problem_index": i // 2, "sample": i % 2, "step": 7, "penalty": 0.25 * i,
             "kept": i % 2 == 0, "advantage": (0.5 if r["reward"] == 1 else -0.5) if i % 2 == 0 else None,
             "minibatch": i // 2 if i % 2 == 0 else None} for i, r in enumerate(records)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_training_rollouts_page_marks_what_roc_kept_and_refuses_an_evaluation_file(tmp_path):
    path = training_rollouts(tmp_path)
    out = report.write_rollouts_report(path)
    assert out == path.with_suffix(".html")
    data = page_data(out.read_text())
    shown = samples(data, 0)
    assert [s["roc"]["kept"] for s in shown] == [True, False] * 4
    assert [s["roc"]["advantage"] for s in shown[::2]] == [0.5 if s["reward"] == 1 else -0.5 for s in shown[::2]]
    assert all(("kept" in s["flags"]) != ("dropped" in s["flags"]) for s in shown)
    results = report.rollout_results(report.load_rollouts(path))
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert results["step 7"]["pass@1"] == pytest.approx(sum(r["reward"] for r in records) / 8)
    assert results["step 7"]["problems"] == 4 and results["step 7"]["samples"] == 2
    assert '<a href="#b=0&amp;show=kept">4</a>' in out.read_text()
    with pytest.raises(SystemExit, match=r"trajectories.jsonl:1: missing key 'step'"):
        report.main([str(RECORDED / "trajectories.jsonl")])


@browser_test
def test_training_rollouts_page_in_chromium(tmp_path):
    out = report.write_rollouts_report(training_rollouts(tmp_path))
    result = browser.open_page(f"{out}#b=0&open=0", expressions=(
        "[...document.querySelectorAll('.roc')].map(e => e.className + ': ' + e.textContent).join(' | ')",
        "document.querySelectorAll('.chip.faded').length",
        choose("show", "kept"), choose("show", "dropped"),
        "document.querySelectorAll('details.problem[open] .sample').length"))
    assert result.errors == [] and not result.blank
    assert result.values[0] == ("roc kept: kept by RoC · advantage +0.500 · mini-batch 0 · penalty 0 | roc dropped: "
                                "not trained on (RoC left it out, or its group's rewards were equal) · penalty 0.25")
    assert result.values[1:] == [4, 4, 4, 1]  # faded chips; problems with a kept / a dropped sample; one shown
