"""Tests for reward.py: extraction, equivalence (fast path and Math-Verify path), hostile input, the worker pool,
and every gold answer of the evaluation sets in data/ (written as the model would, and altered).

    .venv/bin/pytest tests/test_reward.py -q

EQUIV_CASES is also what bench/reward.py scores both checkers on.
"""
import json
from concurrent.futures import ThreadPoolExecutor
import os
import re
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import reward  # noqa: E402
from reward import (CheckPool, Verdict, check, check_many, compute_reward, extract_answer, is_equivalent,  # noqa: E402
                    score_trajectories)

# (prediction, gold, intended verdict): what mathematics says, not what any grader says.
EQUIV_CASES = [
    # integers as training data has them
    ("204", "204", True), (" 204 ", "204", True), ("204.0", "204", True), ("0204", "204", True),
    (r"\text{204}", "204", True), ("$204$", "204", True), (r"204^\circ", "204", True), (r"204^{\circ}", "204", True),
    ("1,000", "1000", True), ("1000", "1,000", True), (r"1{,}000", "1000", True), (r"10,\!080", "10080", True),
    (r"\textbf{204}", "204", True), (r"\mathbf{204}", "204", True), ("+204", "204", True), ("x = 204", "204", True),
    (r"204 \text{ ways}", "204", True), (r"\frac{408}{2}", "204", True), ("-984", "-984", True),
    ("2040", "204", False), ("20.4", "204", False), (r"\frac{204}{2}", "204", False), ("204.5", "204", False),
    ("-204", "204", False), ("984", "-984", False), ("205", "204", False),
    # false accepts of lenient graders (percent scaling, relative tolerance, unit stripping, pi ~ 3.14)
    ("1000", "10", False), ("0.1", "10", False), ("123456", "123457", False), (r"3 \text{ or } 5", "3", False),
    ("6.28", r"2\pi", False), ("3.14", r"\pi", False), ("0.67", r"\frac23", False), (r"10\%", "1000", False),
    # scientific notation
    ("3e8", "300000000", True), ("3e8", r"3\times 10^8", True), (r"3 \times 10^{8}", "300000000", True),
    ("6.02e23", r"6.02\times 10^{23}", True), ("1.5e-3", "0.0015", True), (r"1.25\times10^{-3}", "0.00125", True),
    (r"6.72\times10^{-5}", ".0000672", True), ("3e9", "300000000", False),
    # fractions and decimals
    (r"\dfrac{1}{2}", r"\frac12", True), (r"\tfrac{3}{4}", "0.75", True), ("0.5", r"\frac{1}{2}", True),
    ("1/2", r"\frac{1}{2}", True), (r"\frac{2}{4}", r"\frac{1}{2}", True), (r"\frac 34", r"\frac{3}{4}", True),
    (r"-\frac{3}{8}", r"\frac{-3}{8}", True), (r"\frac{3}{2}", "1.5", True), ("1.50", r"\frac32", True),
    (r"\frac{9}{5}", r"1\frac{4}{5}", True), ("137.5", r"137 \frac{1}{2}", True), ("0.15", ".15", True),
    (r"\frac{1}{3}", r"\frac{1}{2}", False), (r"\frac{3}{8}", r"-\frac{3}{8}", False),
    (r"\frac{4}{5}", r"1\frac{4}{5}", False),
    # roots, pi, negatives
    (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}", True), (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", True),
    (r"\sqrt{20}", r"2\sqrt{5}", True), (r"3 \sqrt 5", r"3\sqrt{5}", True), (r"-\sqrt{3}", r"-\sqrt3", True),
    (r"\frac{\sqrt{570}}{12}", r"\sqrt{\frac{95}{24}}", True),
    (r"\frac{9}{\sqrt{23}}", r"\frac{9 \sqrt{23}}{23}", True),
    (r"\frac{\pi-2}{\pi}", r"1-\frac{2}{\pi}", True), (r"\frac{\pi}{2}", r"\pi/2", True),
    (r"\sqrt{3}", r"\sqrt{2}", False), (r"\sqrt{3}", r"-\sqrt{3}", False), (r"2\pi", r"\pi", False),
    # tuples, intervals, sets and lists
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi/2)", True),
    (r"(3,\frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(\frac{\pi}{2}, 3)", r"\left( 3, \frac{\pi}{2} \right)", False), ("(1,-2)", "(-2,1)", False),
    ("(-\\infty, 0]", r"(-\infty,0]", True), (r"(-\infty,0)", r"(-\infty, 0]", False),
    (r"(3,\infty)\cup(-\infty,2)", r"(-\infty, 2) \cup (3, \infty)", True),
    (r"\left(\frac{3}{5},\frac{8}{3}\right]", r"(0.6, 8/3]", True), (r"[\frac35, \frac83]", r"(0.6, 8/3]", False),
    ("[-2,7]", r"x \in [-2,7]", True), ("(1, -16, -4, 43)", "(1,-16,-4,43)", True),
    ("(1,-16,-4,42)", "(1,-16,-4,43)", False),
    ("7, 5, 3", "3, 5, 7", True), ("3, 5", "3, 5, 7", False), ("1", "1,-2", False), ("-2, 1", "1,-2", True),
    (r"-2, 1+\sqrt5, 1-\sqrt5", r"\{1\pm\sqrt{5},-2\}", True), (r"1+\sqrt{19}, 1-\sqrt{19}", r"1 \pm \sqrt{19}", True),
    (r"\frac{-1-\sqrt{17}}{2}, \frac{-1+\sqrt{17}}{2}", r"\frac{-1+\sqrt{17}}{2}, \frac{-1-\sqrt{17}}{2}", True),
    (r"\frac{-1+\sqrt{17}}{2}", r"\frac{-1+\sqrt{17}}{2}, \frac{-1-\sqrt{17}}{2}", False),
    (r"2 \text{ or } 3", "2,3", True), ("3", r"3\text{ and }5", False),
    # equations and expressions
    ("x = 3", "3", True), ("3", "x=3", True), ("x=4", "x=5", False), ("y = 2x+3", "y = 2x + 3", True),
    ("y = 3x + 2", "y = 2x + 3", False), (r"3x + x^3 - 6", r"x^3+3x-6", True), ("2k+2", "2(k+1)", True),
    ("2k+1", "2k+2", False), ("q-p", "p - q", False), (r"\frac{\cos x}{\sin x}", r"\cot x", True),
    # units, text, money, percent, degrees, bases
    (r"5.4 \text{ cents}", "5.4", True), ("5.4", r"5.4 \text{ cents}", True), ("864", r"864 \mbox{ inches}^2", True),
    (r"\$18.90", "18.90", True), ("18.9", r"\$18.90", True), (r"\$32,\!348", "32348", True),
    (r"\text{(B)}", "B", True), ("(C)", r"\text{(B)}", False), (r"\text{Evelyn}", r"\text{Evelyn}", True),
    (r"\text{Navin}", r"\text{Evelyn}", False), (r"10\%", "10", True), (r"25\%", "0.25", True),
    (r"50\%", r"\frac{1}{2}", True), (r"30^\circ", "30", True), ("30", r"30^\circ", True),
    (r"\frac{270}{7}", r"\frac{270}7\text{ degrees}", True), (r"36^\circ", "63", False),
    (r"4210_5", r"4210_{5}", True), (r"4211_{5}", r"4210_{5}", False),
    # matrices, infinity, complex numbers, big exact values
    (r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", r"\begin{pmatrix}-1&0\\0&-1\end{pmatrix}", True),
    (r"\begin{bmatrix} -1 & 0 \\ 0 & -1 \end{bmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", True),
    (r"\begin{pmatrix} \frac15 \\ -\frac{18}5 \end{pmatrix}", r"\begin{pmatrix} 1/5 \\ -18/5 \end{pmatrix}", True),
    (r"\begin{pmatrix} 1 & 0 \\ 0 & -1 \end{pmatrix}", r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", False),
    (r"\begin{pmatrix} -7 \\ 16 \\ 6 \end{pmatrix}", r"\begin{pmatrix} -7 \\ 16 \\ 5 \end{pmatrix}", False),
    (r"+\infty", r"\infty", True), (r"-\infty", r"\infty", False), ("7i-2", "-2 + 7i", True),
    ("-2 - 7i", "-2+7i", False), (r"26! \cdot 2^{25}", r"2^{25} \cdot 26!", True),
    ("13532215908553332190020108288000000", r"2^{25} \cdot 26!", True),
    ("13532215908553332190020108288000001", r"2^{25} \cdot 26!", False), (r"4^{1012}", r"2^{2024}", True),
    (r"\text{Evelyn}", "Evelyn", True),
]


def _sleepy_equal(pred: str, gold: str) -> bool:
    """A stand-in slow path for pool tests (module level, so spawn workers can import it)."""
    if pred == "hang":
        time.sleep(120)
    if pred == "die":
        os._exit(3)
    return pred == gold


@pytest.fixture(scope="module")
def pool():
    p = CheckPool(workers=2)
    yield p
    p.close()


# ---------------------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.spec
@pytest.mark.parametrize("text, expected", [
    (r"<answer>\boxed{204}</answer>", "204"),
    (r"first \boxed{1}, on second thought \boxed{2}", "2"),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
    (r"\fbox{3}", "3"),
    (r"\boxed {5}.", "5"),
    (r"<reason>maybe \boxed{5}</reason><answer>so \boxed{7}</answer>", "7"),
    (r"<answer>\boxed{7}</answer> wait, \boxed{8}", "7"),  # the final answer block wins over later text
    (r"<answer>\boxed{1}</answer><answer>\boxed{2}</answer>", "2"),
    (r"<answer>\boxed{3}</answer><answer>\boxed{4", "3"),  # truncated second block: the last complete one
    (r"<reason>\boxed{5}</reason><answer>7</answer>", None),  # the answer block has no box
    (r"<reason>\boxed{5}</reason> truncated before any answer", "5"),
    (r"\boxed{\frac{1}{2}", None),  # unbalanced
    (r"\boxed{3} and then \boxed{4", None),  # the last box is broken: no answer, not the earlier one
    (r"\boxed{}", None),
    ("no box here: 204", None),
    ("", None),
    (None, None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.spec
def test_extract_answer_is_fast_on_huge_hostile_text():
    cases = ["<answer>" * 20_000 + r"\boxed{1}", "{" * 100_000 + r"\boxed{2}", r"\boxed{" + "{" * 100_000,
             "x" * 100_000 + r"<answer>\boxed{3}</answer>"]
    start = time.perf_counter()
    results = [extract_answer(c) for c in cases]
    assert time.perf_counter() - start < 1.0
    assert results == ["1", "2", None, "3"]


# ---------------------------------------------------------------------------------------------------------------
# Equivalence
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pred, gold, expected", EQUIV_CASES)
def test_equivalence(pool, pred, gold, expected):
    verdict = check(pred, gold, pool)
    assert verdict.correct is expected, verdict
    assert not verdict.timed_out


class _NoPool:
    workers = 1

    def run(self, pred, gold):
        raise AssertionError(f"slow path used for {pred!r} vs {gold!r}")


class _FalsePool:
    workers = 1

    def run(self, pred, gold):
        return False, "slow"


@pytest.mark.spec
@pytest.mark.parametrize("pred, gold, expected", [
    ("204", "204", True), (" 204 ", "204", True), ("204.0", "204", True), ("0204", "204", True),
    (r"\text{204}", "204", True), ("$204$", "204", True), (r"204^\circ", "204", True), ("1,000", "1000", True),
    (r"\boxed{204}", "204", True), ("x=204", "204", True), (r"204\text{ apples}", "204", True),
    ("3e8", "300000000", True), (r"11,\! 111,\! 111,\! 100", "11111111100", True),
    ("2040", "204", False), ("20.4", "204", False), ("-204", "204", False), ("1000", "10", False),
    ("123456", "123457", False), ("0.1", "10", False),
])
def test_integer_fast_path_never_reaches_the_pool(pred, gold, expected):
    verdict = check(pred, gold, _NoPool())
    assert verdict == Verdict(expected, "fast")


@pytest.mark.spec
def test_integer_fast_path_speed():
    pairs = [(f"\\text{{{n}}}", str(n)) for n in range(2000)] + [(str(n + 1), str(n)) for n in range(2000)]
    start = time.perf_counter()
    verdicts = [check(p, g, _NoPool()) for p, g in pairs]
    per_second = len(pairs) / (time.perf_counter() - start)
    assert [v.correct for v in verdicts] == [True] * 2000 + [False] * 2000
    assert per_second > 500, per_second  # catches a parser on this path; bench/reward.py measures the rate


def test_compute_reward_reads_only_the_final_answer(pool):
    response = r"<reason>the tool printed \boxed{12}; I think \boxed{11}</reason><answer>\boxed{\dfrac{24}{2}}</answer>"
    assert compute_reward(response, "12", pool) == 1.0
    assert compute_reward(response, "11", pool) == 0.0
    assert compute_reward("<answer>12</answer>", "12", pool) == 0.0  # no box
    assert is_equivalent(r"\frac{24}{2}", "12", pool) is True


def test_check_many_matches_check(pool):
    preds = ["204", r"\frac{1}{2}", None, r"9^{9^{9^{9}}}", "0.5", r"\sqrt{8}"]
    golds = ["204", "0.5", "1", "204", r"\frac12", r"2\sqrt{2}"]
    assert check_many(preds, golds, pool) == [check(p, g, pool) for p, g in zip(preds, golds)]
    assert [v.decided_by for v in check_many(preds, golds, pool)] == [
        "fast", "slow", "no_answer", "screened", "slow", "slow"]


def test_score_trajectories_sets_each_reward_from_the_rollout_s_own_final_answer(pool):
    """The one scoring of rollouts against their golds (training, evaluation, the held-out evaluation)."""
    from types import SimpleNamespace
    texts = [r"<answer>\boxed{12}</answer>", r"the tool printed \boxed{12}<answer>\boxed{11}</answer>",
             "no box", r"<answer>\boxed{\frac{24}{2}}</answer>"]
    trajs = [SimpleNamespace(text=t, reward=None) for t in texts]
    verdicts = score_trajectories(trajs, ["12"] * 4, pool)
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 1.0]
    assert verdicts == check_many([extract_answer(t) for t in texts], ["12"] * 4, pool)


@pytest.mark.spec
def test_reward_metrics():
    verdicts = [Verdict(True, "fast"), Verdict(False, "timeout"), Verdict(False, "screened"),
                Verdict(False, "no_answer"), Verdict(True, "slow"), Verdict(False, "timeout")]
    assert reward.reward_metrics(verdicts) == {
        "reward/timeouts": 2.0, "reward/screened": 1.0, "reward/no_answer_frac": 1 / 6, "reward/slow_frac": 3 / 6}
    assert Verdict(False, "timeout").timed_out and not Verdict(False, "slow").timed_out


# ---------------------------------------------------------------------------------------------------------------
# Hostile input: 0 quickly, never raises, never hangs
# ---------------------------------------------------------------------------------------------------------------
HOSTILE = {
    "unbalanced open": r"\frac{1}{2",
    "unbalanced close": r"2}{",
    "100 KB numeral": "1" * 100_000,
    "100 KB latex": r"\frac{1}{2}+" * 9_000,
    "tower of 9s": r"9^{9^{9^{9}}}",
    "factorial of a tower": r"10^{10^{10}}!",
    "2003^2002^2001": r"2003^{2002^{2001}}",
    "tower of e": r"e^{e^{e^{e^{e}}}}",
    "negative tower": r"10^{-10^{10}}",
    "2^(2^30)": r"2^{2^{30}}",
    "huge literal exponent": r"2^{1000000000}",
    "factorial of a power": r"(10^{6})!",
    "huge factorial": "1000000!",
    "nested fractions": "\\frac{1}{1+" * 200 + "1" + "}" * 200,
    "nested parentheses": "(" * 500 + "1" + ")" * 500,
    "sum to a billion": r"\sum_{k=1}^{10^{9}} k",
}


@pytest.mark.spec
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_answers_are_screened_in_process(name):
    start = time.perf_counter()
    verdict = check(HOSTILE[name], "204", _NoPool())
    assert verdict == Verdict(False, "screened")
    assert time.perf_counter() - start < 0.2
    assert compute_reward(r"<answer>\boxed{" + HOSTILE[name] + "}</answer>", "204", _NoPool()) == 0.0


@pytest.mark.spec
@pytest.mark.parametrize("answer", [r"2^{25} \cdot 26!", r"2^{2024}", r"e^{-x^2}", r"2^{2^{3}}", "2025!",
                                    r"\left(\frac{1}{2}\right)^{10}", r"10^{100000}", r"\{1, 2\}", "(3,4]"])
def test_screen_lets_honest_answers_through(answer):
    assert not reward.is_explosive(reward.normalize(answer))


@pytest.mark.parametrize("junk", [None, True, [204], "", "   ", "\x00\x01", "\\", "{}", "$$", "}" * 1000, "\\boxed{"])
def test_junk_never_raises(pool, junk):
    assert check(junk, "204", pool).correct is False
    assert compute_reward(junk, "204", pool) == 0.0


@pytest.mark.spec
def test_random_latex_soup_never_raises():
    import random

    rng = random.Random(0)
    pieces = ["{", "}", "(", ")", "[", "]", "^", "_", "!", ",", ".", "-", "+", "=", "\\", " ", "1", "0", "9", "e", "x",
              "\\frac", "\\sqrt", "\\text{", "\\left(", "\\right)", "\\{", "\\}", "\\!", "\\circ", "\\%", "$", "٣",
              "²", "<answer>", "</answer>", "\\boxed{", "\\fbox{", "\\times10^{"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        verdict = check(text, rng.choice(["204", text]), _FalsePool())
        assert isinstance(verdict, Verdict)
        assert extract_answer(text) is None or isinstance(extract_answer(text), str)


def test_sympy_hang_times_out_and_is_counted():
    p = CheckPool(workers=2, timeout_s=1.0)
    try:
        with ThreadPoolExecutor(2) as pool:  # two checks at once: both workers have finished their imports
            warm = list(pool.map(lambda _: check(r"\frac12", "0.5", p), range(2)))
        assert warm == [Verdict(True, "slow")] * 2
        start = time.perf_counter()
        verdict = check(r"\frac{(x+y+z)^{60}}{(x+y)^{59}}", "204", p)  # sympy runs for minutes on this one
        elapsed = time.perf_counter() - start
        assert verdict == Verdict(False, "timeout") and verdict.timed_out
        assert elapsed < 1.0 + 0.5, elapsed
        assert check(r"\frac{1}{3}", r"\frac{2}{6}", p) == Verdict(True, "slow")  # the pool still works
    finally:
        p.close()


def test_pool_kills_and_replaces_hung_and_crashed_workers():
    p = CheckPool(workers=2, timeout_s=1.0, equal_fn=_sleepy_equal)
    try:
        assert p.run("a", "a") == (True, "slow")
        start = time.perf_counter()
        assert p.run("hang", "a") == (False, "timeout")
        assert time.perf_counter() - start < 1.0 + 0.5
        assert p.run("die", "a") == (False, "crash")
        for _ in range(4):  # replacements answer (after their start-up, which the bound does not charge)
            assert p.run("b", "b") == (True, "slow")
    finally:
        p.close()


def test_check_works_off_the_main_thread(pool):
    results = []
    thread = threading.Thread(target=lambda: results.append(check(r"\frac{\sqrt2}{2}", r"\frac{1}{\sqrt2}", pool)))
    thread.start()
    thread.join(timeout=30)
    assert results == [Verdict(True, "slow")]


def test_close_stops_every_worker_and_a_later_run_restarts():
    p = CheckPool(workers=2, equal_fn=_sleepy_equal)
    assert p.run("a", "a") == (True, "slow")
    processes = [w.process for w in p._live]
    assert len(processes) == 2 and all(proc.poll() is None for proc in processes)
    p.close()
    assert not any(proc.poll() is None for proc in processes)
    assert p.run("a", "b") == (False, "slow")
    p.close()


def test_import_starts_no_process_and_no_sympy():
    code = ("import sys, reward; reward.check('204', '204.0'); "
            "assert reward._default_pool is None; assert 'sympy' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_close_while_a_timed_out_worker_is_being_replaced_stops_it_once(monkeypatch):
    """A timed-out worker is stopped in a background thread. close() must not stop it a second time: closing its
    pipe twice from two threads closes a file descriptor that may by then belong to another file (or fails with
    EBADF). The background close is held until close() has returned, so the overlap happens on every run."""
    from multiprocessing.connection import Connection
    real_close, closed, errors = Connection._close, [], []
    release, finished = threading.Event(), threading.Event()

    def recorded_close(conn):
        closed.append(conn)  # the objects themselves: ids of freed objects are reused
        if threading.current_thread() is threading.main_thread():
            return real_close(conn)
        release.wait(10)  # a background stop: wait until close() is over
        try:
            return real_close(conn)
        finally:
            finished.set()

    monkeypatch.setattr(Connection, "_close", recorded_close)
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    p = CheckPool(workers=2, timeout_s=0.5, equal_fn=_sleepy_equal)
    try:
        assert p.run("a", "a") == (True, "slow")
        assert p.run("hang", "a") == (False, "timeout")
    finally:
        p.close()
        release.set()
    assert finished.wait(10)  # the background stop ran
    assert errors == []
    twice = [c for c in closed if sum(x is c for x in closed) > 1]
    assert twice == []


@pytest.mark.parametrize("how", ["file", "stdin", "-c"])
def test_a_script_without_main_guard_can_check_answers(tmp_path, how):
    """Workers never run the caller's script again: a guard-less script (or one read from stdin or -c) that calls
    compute_reward on answers past the integer fast path gets the right rewards, not a RuntimeError."""
    cases = [(p, g, e) for p, g, e in EQUIV_CASES if reward.as_number(reward.normalize(p)) is None][:24]
    script = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom reward import compute_reward\n"
              f"cases = {cases!r}\n"
              "rewards = [compute_reward('<answer>\\\\boxed{' + p + '}</answer>', g) for p, g, _ in cases]\n"
              "print(''.join(str(int(r)) for r in rewards))\n")
    if how == "file":
        (tmp_path / "check_answers.py").write_text(script)
        command, stdin = [sys.executable, "check_answers.py"], None
    else:
        command, stdin = ([sys.executable, "-"], script) if how == "stdin" else ([sys.executable, "-c", script], None)
    out = subprocess.run(command, cwd=tmp_path, input=stdin, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "".join(str(int(e)) for _, _, e in cases)


def test_reward_pasted_into_a_script_needs_the_guard_and_says_so(tmp_path):
    """Code that lives in the script itself can only be loaded from it: with a guard that works; without one the
    worker refuses to start workers of its own (no process explosion) and the error says what to do."""
    source = (ROOT / "reward.py").read_text().split('\nif __name__ == "__main__":')[0]  # without its demo
    call = "print(compute_reward('<answer>\\\\boxed{\\\\frac12}</answer>', '0.5'))\n"
    (tmp_path / "guarded.py").write_text(source + "\nif __name__ == '__main__':\n    " + call)
    (tmp_path / "unguarded.py").write_text(source + "\n" + call)
    good = subprocess.run([sys.executable, "guarded.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert good.returncode == 0 and good.stdout.strip() == "1.0", good.stderr[-2000:]
    bad = subprocess.run([sys.executable, "unguarded.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "did not start" in bad.stderr and "__name__" in bad.stderr


# ---------------------------------------------------------------------------------------------------------------
# Numbers as answers
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pred, gold, expected", [
    ("204", 204, True), (204, "204.0", True), (204, 204, True), ("205", 204, False), ("-7", -7, True),
    ("0.5", 0.5, True), ("0.1", 0.1, True), (r"\frac{1}{2}", 0.5, True), ("2.5", 2.50, True), ("1e-7", 1e-7, True),
    ("0.3", 0.1 + 0.2, False),  # a float means its repr, 0.30000000000000004, not the number a person meant
    ("10000000000000000", 1e16, True), (r"-\frac{3}{8}", Fraction(-3, 8), True), ("-0.375", Fraction(-3, 8), True),
    ("2", Fraction(4, 2), True), (r"\frac{3}{8}", Fraction(-3, 8), False), (0.5, Fraction(1, 2), True),
])
def test_numbers_mean_what_their_text_means(pool, pred, gold, expected):
    assert check(pred, gold, pool).correct is expected
    assert check_many([pred], [gold], pool)[0].correct is expected


@pytest.mark.spec
def test_bools_nan_and_other_types_are_not_numbers():
    for gold in [True, False, float("nan"), float("inf"), [204], None, 10 ** 5000]:
        assert check("1", gold) == Verdict(False, "no_answer"), gold
    assert compute_reward("<answer>\\boxed{204}</answer>", 204) == 1.0


# ---------------------------------------------------------------------------------------------------------------
# Every gold answer of the evaluation sets: as the model writes it -> 1; altered -> 0
# ---------------------------------------------------------------------------------------------------------------
def _altered(gold: str) -> str:
    """A wrong answer close to `gold`: the first number plus one (a different integer, a changed numerator), else
    the first letter of a \\text{} answer shifted by one, else `gold + 1`."""
    if m := re.search(r"\d+", gold):
        return gold[: m.start()] + str(int(m.group()) + 1) + gold[m.end():]
    if m := re.search(r"\\text\{\(?([A-Za-y])", gold):
        return gold[: m.start(1)] + chr(ord(m.group(1)) + 1) + gold[m.end(1):]
    return gold + " + 1"


@pytest.mark.parametrize("name", ["aime24", "aime25", "hmmt25", "math500"])
def test_every_gold_answer_scores_1_and_an_altered_one_0(pool, name, data_dir):
    records = [json.loads(line) for line in (data_dir / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    golds = [r["answer"] for r in records]
    assert len(golds) == {"aime24": 30, "aime25": 30, "hmmt25": 30, "math500": 500}[name]
    written = [rf"<reason>A first try gave \boxed{{0}}.</reason><answer>The answer is \boxed{{{g}}}</answer>"
               for g in golds]
    right = check_many([extract_answer(w) for w in written], golds, pool)
    wrong = check_many([_altered(g) for g in golds], golds, pool)
    assert [g for g, v in zip(golds, right) if not v.correct] == []
    assert [g for g, v in zip(golds, wrong) if v.correct] == []
    assert [v for v in right + wrong if v.decided_by not in ("fast", "slow")] == []  # none screened or timed out
    # Identical texts are accepted without sympy, so also ask Math-Verify itself to accept each non-numeric gold.
    latex = [reward.normalize(g) for g in golds if reward.as_number(reward.normalize(g)) is None]
    assert [g for g in latex if pool.run(g, g) != (True, "slow")] == []


def test_a_worker_slow_to_start_is_waited_for_and_a_stalled_one_is_named():
    """Imports on a loaded machine can take minutes: a live worker is waited for up to startup_s, and one that is
    still importing after that is reported as such (not as a missing install)."""
    p = CheckPool(workers=1, timeout_s=5.0, startup_s=0.5)
    try:
        p.start()
        worker = p._idle.queue[0]
        worker.process.send_signal(signal.SIGSTOP)  # a worker that cannot finish its imports in time
        with pytest.raises(RuntimeError, match="did not start: still importing after 0.5 s"):
            check(r"\frac12", "0.5", p)
    finally:
        p.close()
