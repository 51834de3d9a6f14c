"""Benchmark of the answer reward (reward.py) against the plain alternatives, side by side in one run.

    .venv/bin/python bench/reward.py          # 3 to 5 minutes on 2 cores

Three checkers, each given the same extracted answers:
- ours: reward.check (in-process fast path, pre-screen, Math-Verify in a pool of spawned workers, TIMEOUT_S bound);
- Math-Verify as-is: math_verify.parse + verify on the raw answers, in-process, with its own signal.alarm timeouts
  (5 s defaults); what one gets by calling the library directly;
- hand sympy: the alternative we did not choose, written here: a string clean-up, latex2sympy2_extended's LaTeX
  parser, tuple/list splitting, then sympy `simplify(a - b) == 0` with a 30-digit numeric fallback.

Printed: checks per second on integer answers and on MATH-500 answers; agreement with the intended verdicts of
tests/test_reward.py::EQUIV_CASES; every gold of data/ written back (must score 1) and altered (must score
0); the slowest single check among hostile inputs (the alternatives run in killable workers capped at HOSTILE_CAP_S,
the two at once to save time). Reads the data from data/ in the repo.
"""
import importlib.util
import json
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before `import reward`, so the module, not this file, is found

import reward  # noqa: E402

HOSTILE_CAP_S = 8.0  # alternatives get this long per hostile check before their worker is killed
N_INT_OURS, N_INT_OTHERS = 20_000, 1_000  # integer pairs timed per checker (the alternatives are slow)


def _load_tests():
    spec = importlib.util.spec_from_file_location("test_reward", ROOT / "tests" / "test_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the alternatives ---------------------------------------------------------------------------------------------
def math_verify_as_is(pred: str, gold: str) -> bool:
    """The library called directly on the raw answers, with its default (signal.alarm) timeouts."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return bool(verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}")))


def _plain_clean(s: str) -> str:
    s = s.strip().replace("\\$", "").replace("$", "")
    for old, new in [("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\!", ""),
                     ("\\,", ""), ("{,}", ","), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("\\fbox", "")]:
        s = s.replace(old, new)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm|boxed)\{\s*([^{}]*?)\s*\}", r"\1", s)  # \text{x} -> x
    s = re.sub(r"(?<=\d)\s*[a-zA-Z ]{2,}(\^[23])?$", "", s)  # trailing unit words: 5.4 cents -> 5.4
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # x = 3 -> 3
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s.strip()


def _plain_split(s: str) -> tuple[list[str], str]:
    """Top-level comma-separated items, and the enclosing brackets ("" for a bare list or a set: unordered)."""
    brackets, inner = "", s
    if s[:1] in "([" and s[-1:] in ")]":
        depth = 0
        for i, c in enumerate(s):
            depth += (c in "([{") - (c in ")]}")
            if depth == 0 and i < len(s) - 1:
                break
        else:
            brackets, inner = s[0] + s[-1], s[1:-1]
    elif s.startswith("\\{") and s.endswith("\\}"):
        inner = s[2:-2]
    items, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            items.append(inner[start:i])
            start = i + 1
    return [x.strip() for x in items + [inner[start:]]], brackets


def _plain_expr_equal(x: str, y: str) -> bool:
    import sympy
    from latex2sympy2_extended import latex2sympy

    a, b = latex2sympy(x), latex2sympy(y)
    if a == b:
        return True
    diff = a - b
    if isinstance(diff, sympy.MatrixBase):
        return bool(diff.applyfunc(sympy.simplify).is_zero_matrix)
    if sympy.simplify(diff) == 0:
        return True
    return abs(complex(sympy.N(diff, 30))) < 1e-12


def hand_sympy_equal(pred: str, gold: str) -> bool:
    """The alternative not chosen: our own clean-up and structure, latex2sympy2_extended to parse, sympy to compare."""
    p, g = _plain_clean(pred), _plain_clean(gold)
    if p == g:
        return True
    (p_items, p_brackets), (g_items, g_brackets) = _plain_split(p), _plain_split(g)
    if len(p_items) != len(g_items) or p_brackets != g_brackets:
        return False
    if p_brackets:  # tuple or interval: in order
        return all(_plain_expr_equal(x, y) for x, y in zip(p_items, g_items))
    remaining = list(g_items)  # a list or set of answers: any order
    for x in p_items:
        match = next((y for y in remaining if _plain_expr_equal(x, y)), None)
        if match is None:
            return False
        remaining.remove(match)
    return True


def _safe(fn):
    def wrapped(pred, gold):
        try:
            return bool(fn(pred, gold))
        except Exception:  # includes math-verify's TimeoutException
            return False
    return wrapped


# --- measurements -------------------------------------------------------------------------------------------------
def integer_pairs(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """Answers as a model writes integers: mostly plain, some wrapped or formatted, about a third wrong."""
    formats = ["{}", " {} ", "\\text{{{}}}", "{}.0", "0{}", "${}$", "{}^\\circ", "x = {}", "{} \\text{{ ways}}"]
    pairs = []
    for _ in range(n):
        gold = rng.randrange(0, 100_000)
        pred = gold if rng.random() < 0.66 else gold + rng.choice([-1, 1, 10, 1000])
        text = f"{pred:,}" if rng.random() < 0.05 else rng.choice(formats[:1] * 6 + formats).format(pred)
        pairs.append((text, str(gold)))
    return pairs


def rate(fn, pairs) -> float:
    start = time.perf_counter()
    for pred, gold in pairs:
        fn(pred, gold)
    return len(pairs) / (time.perf_counter() - start)


def score_cases(fn, cases) -> tuple[int, int, int]:
    """(agree, false accepts, false rejects) against the intended verdicts."""
    got = [fn(p, g) for p, g, _ in cases]
    agree = sum(v == e for v, (_, _, e) in zip(got, cases))
    false_accepts = sum(v and not e for v, (_, _, e) in zip(got, cases))
    return agree, false_accepts, len(cases) - agree - false_accepts


def hostile_times(fn, answers) -> dict[str, float]:
    """Seconds each hostile answer (checked against gold 204) took."""
    times = {}
    for name, answer in answers.items():
        start = time.perf_counter()
        fn(answer, "204")
        times[name] = time.perf_counter() - start
    return times


def main():
    tests = _load_tests()
    rng = random.Random(0)
    data = Path(__file__).resolve().parents[1] / "data"
    golds = [json.loads(line)["answer"] for name in ["aime24", "aime25", "hmmt25", "math500"]
             for line in (data / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    math500 = [json.loads(line)["answer"] for line in (data / "math500.jsonl").read_text().splitlines() if line.strip()]
    math500_pairs = [(g, g) for g in math500] + [(tests._altered(g), g) for g in math500]

    pool = reward.CheckPool()
    pool.run("1", "1")  # start the workers outside the timings
    ours = lambda p, g: reward.check(p, g, pool).correct  # noqa: E731
    capped = {name: reward.CheckPool(workers=2, timeout_s=HOSTILE_CAP_S, equal_fn=fn)
              for name, fn in [("mv", math_verify_as_is), ("hand", hand_sympy_equal)]}
    in_pool = {name: (lambda p, g, c=c: c.run(p, g)[0]) for name, c in capped.items()}
    checkers = {"ours": ours, "mv": _safe(math_verify_as_is), "hand": _safe(hand_sympy_equal)}
    rows = {}

    ints = integer_pairs(N_INT_OURS, rng)
    rows["integer checks/s"] = [rate(ours, ints)] + [rate(checkers[k], ints[:N_INT_OTHERS]) for k in ("mv", "hand")]
    responses = [(f"<reason>{'work ' * 400}</reason><answer>\\boxed{{{p}}}</answer>", g) for p, g in ints[:5000]]
    reward_rate = rate(lambda r, g: reward.compute_reward(r, g, pool), responses)
    rows["MATH-500 checks/s (1000 pairs)"] = [rate(checkers[k], math500_pairs) for k in ("ours", "mv", "hand")]
    start = time.perf_counter()
    reward.check_many([p for p, _ in math500_pairs], [g for _, g in math500_pairs], pool)
    many_rate = len(math500_pairs) / (time.perf_counter() - start)

    cases = tests.EQUIV_CASES
    scored = [score_cases(ours, cases)] + [score_cases(in_pool[k], cases) for k in ("mv", "hand")]
    rows[f"intended verdict, {len(cases)} cases: agree"] = [s[0] for s in scored]
    rows["  false accepts"] = [s[1] for s in scored]
    rows["  false rejects"] = [s[2] for s in scored]
    written = [(reward.extract_answer(f"<answer>\\boxed{{{g}}}</answer>"), g) for g in golds]
    altered = [(tests._altered(g), g) for g in golds]
    for label, pairs, want in [(f"{len(golds)} golds scoring 1", written, True),
                               (f"{len(golds)} altered golds scoring 0", altered, False)]:
        rows[label] = [sum(fn(p, g) == want for p, g in pairs) for fn in (ours, in_pool["mv"], in_pool["hand"])]

    hostile = dict(tests.HOSTILE, **{"simplify runs for minutes": r"\frac{(x+y+z)^{60}}{(x+y)^{59}}",
                                     "nested sin": r"\sin(\sin(\sin(\sin(\sin(\sin(x+1))))))^{99}",
                                     "product of 3000 factors": r"\prod_{k=1}^{3000} (x+k)"})
    times = [hostile_times(ours, hostile)]
    with ThreadPoolExecutor(2) as threads:  # the two capped alternatives side by side, one core each
        times += list(threads.map(lambda k: hostile_times(in_pool[k], hostile), ["mv", "hand"]))
    worst = [max((t, name) for name, t in ts.items()) for ts in times]
    rows["slowest hostile check (s)"] = [w[0] for w in worst]
    rows[f"hostile checks over {reward.TIMEOUT_S + 0.2:.1f} s (of {len(hostile)})"] = [
        sum(t > reward.TIMEOUT_S + 0.2 for t in ts.values()) for ts in times]

    print(f"reward check benchmark: TIMEOUT_S = {reward.TIMEOUT_S}, workers = {pool.workers}, "
          f"alternatives capped at {HOSTILE_CAP_S} s on hostile input\n")
    print(f"{'':42} {'ours':>12} {'Math-Verify':>12} {'hand sympy':>12}")
    for label, values in rows.items():
        print(f"{label:42} " + " ".join(f"{v:>12,.1f}" if isinstance(v, float) else f"{v:>12}" for v in values))
    print(f"\nours, compute_reward on 2 KB responses: {reward_rate:,.0f}/s; check_many on MATH-500: {many_rate:,.0f}/s")
    print("slowest hostile input: " + "; ".join(f"{k}: {w[1]} ({w[0]:.2f} s)" for k, w in zip(checkers, worst)))
    print(f"ours: slowest hostile check {worst[0][0]:.2f} s vs bound {reward.TIMEOUT_S} s + 0.2 s: "
          f"{'OK' if worst[0][0] <= reward.TIMEOUT_S + 0.2 else 'OVER'}; "
          f"integer rate {rows['integer checks/s'][0]:,.0f}/s against a floor of 5,000/s: "
          f"{'OK' if rows['integer checks/s'][0] >= 5000 else 'UNDER'}")
    for p in [pool, *capped.values()]:
        p.close()


if __name__ == "__main__":
    main()
