"""The 0/1 answer reward: extract the model's final boxed answer and check it against the ground truth.

Implements the outcome-only reward of the rStar2-Agent report (§2): r = 1 if the final answer is equivalent to the ground truth, else 0;
no format, tool or length terms. Used by training (integer answers) and evaluation (MATH-500, HMMT LaTeX answers).

    extract_answer(text)          last \\boxed{...} or \\fbox{...} (nested braces matched) in the final complete
                                  <answer>...</answer> block; in the whole text when there is no such block
    check(pred, gold) -> Verdict  .correct, .timed_out, .decided_by ("fast", "slow", "screened", "timeout", ...)
    is_equivalent(pred, gold)     check(...).correct
    compute_reward(response, gold) 1.0 or 0.0, the simple entry point
    check_many / reward_metrics   a batch at a time, and the counts the trainer logs (`reward/timeouts`, ...)
    score_trajectories(trajs, golds)  each rollout's reward set from its own text (train, eval, held-out eval)

How a pair is decided, cheapest first:
1. Fast path, in this process, no LaTeX parser: the normalized texts are identical, or both are plain numerals
   (`204`, ` 204 `, `204.0`, `0204`, `\\text{204}`, `$204$`, `204^\\circ`, `1,000`, `x = 204`, `204 \\text{ cm}`,
   `3\\times10^{8}`, `3e8`): exact rational compare. Most training answers end here (tens of microseconds).
2. Pre-screen, in this process: a broken or explosive answer (unbalanced braces, over MAX_ANSWER_CHARS, nesting
   over MAX_NESTING, a power tower over MAX_TOWER levels, an exponent over MAX_EXPONENT, a factorial over
   MAX_FACTORIAL) scores 0 without reaching sympy.
3. Slow path: Hugging Face Math-Verify (parse + verify, which use sympy) in a small pool of pre-started worker
   processes (spawn, never fork; plumbing/check_pool.py). A check that does not answer within TIMEOUT_S seconds
   scores 0 and is reported as a timeout; its worker is killed and replaced. Math-Verify was chosen over a
   hand-written sympy checker on measured evidence: docs/reward_choice.md (`.venv/bin/python bench/reward.py`
   reproduces the numbers).

Time bound: every check returns within TIMEOUT_S (default 5 s) of reaching an idle worker; any thread may call
this. Importing this module starts no process and imports no sympy; the pool starts on the first slow check and is
closed at exit. How the pool keeps the bound, and why its workers never run the calling program again:
plumbing/check_pool.py.

Deliberately not handled: answers outside a box (a bare `<answer>42</answer>` scores 0, as the system prompt asks
for \\boxed{}); `\\boxed 5` without braces; relative tolerances and percent-scaling heuristics (`10` never matches
`1000` or `0.1`: they buy recall with false accepts); multiple-choice mapping beyond what Math-Verify does; answers
whose check needs more than TIMEOUT_S (they score 0, counted). Run `python reward.py` for a small demo.
"""
import atexit
import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

from plumbing import check_pool

# Seconds a slow check may run before it counts 0: Math-Verify's own default. The slowest gold pair of the four
# evaluation sets measured 0.5 s on 2 idle cores and 1.1 s at load average 15.
TIMEOUT_S = 5.0
WORKERS = 3  # slow-path worker processes; with two busy, a spare is ready while a killed one restarts
MAX_ANSWER_CHARS = 1000  # longer answers score 0 unchecked (MATH-500's longest gold is under 100 chars)
MAX_NESTING = 20  # deepest {, ( or [ nesting allowed
MAX_TOWER = 2  # a^{b^{c}} is allowed, a^{b^{c^{d}}} is not
MAX_EXPONENT = 100_000  # largest numeric exponent (`2^{2024}` passes, `2^{2^{30}}` does not)
MAX_FACTORIAL = 10_000  # largest numeric factorial argument (`26!` passes, `(10^{6})!` does not)

# --- 1. Extraction -------------------------------------------------------------------------------------------------
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)  # an escaped character (\{, \\) never opens or closes a group


def _closing_brace(text: str, open_at: int) -> int | None:
    """Index of the `}` that closes the `{` at `open_at`, or None when it is never closed."""
    depth = 0
    for m in _BRACE_TOKEN.finditer(text, open_at):
        if m.group() == "{":
            depth += 1
        elif m.group() == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}/\\fbox{...} in `text`; None if there is none or it is never closed."""
    last = None
    for last in _BOX.finditer(text):
        pass
    close = _closing_brace(text, last.end() - 1) if last else None
    return (text[last.end() : close].strip() or None) if close is not None else None


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last box inside the final complete <answer>...</answer> block, or, when the
    text has no complete block, the last box anywhere in it.

    Pass only what the model wrote (never tool output: it could hold a box the model did not give).
    Returns None when there is no box, the last box is unbalanced, or it is empty.
    """
    if not isinstance(text, str):
        return None
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end != -1 else -1
    if start != -1:
        return _last_boxed(text[start + len("<answer>") : end])
    return _last_boxed(text)


# --- 2. Normalisation and the fast path (plain string and integer work; no parser) ---------------------------------
# Spacing commands, \displaystyle, and \left/\right before a bracket; group 1 keeps `\\` (a matrix row break).
_SPACING = re.compile(r"(\\\\)|\\[,;:! ]|\\q?quad(?![a-zA-Z])|~|\\displaystyle|\\(?:left|right)(?=[()[\]|]|\\[{}])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree|°")
_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|boxed|fbox)\s*\{")
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d+)(?![\w.])")  # 3e8; Math-Verify reads 3*e*8
_ASSIGNMENT = re.compile(r"^[a-zA-Z]=")  # x=3 -> 3
_UNIT = re.compile(r"(?<=[\d.])\\(?:text|mbox|mathrm)\{[a-zA-Z]{2,}\}(?:\^[23])?$")  # 5.4\text{cents} -> 5.4
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")  # 1,000 and 11,111,100 (not a list like 3,5)
_NUMBER = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:(?:\\times|\\cdot)10\^\{?([+-]?\d{1,4})\}?)?")
_MAX_FAST_CHARS = 60  # longer numerals go to the slow path (Python refuses int() of over 4300 digits anyway)


def normalize(answer: str) -> str:
    """Strip what never changes the value: $ and \\$, spacing commands, degree signs, whole-answer \\text{} wrappers.

    Also rewrites scientific notation `3e8` as `3\\times10^{8}`. Cheap string work only.
    """
    s = answer.replace("\\$", "").replace("$", "").replace("{,}", ",")
    s = _SPACING.sub(lambda m: m.group(1) or "", s)
    s = _DEGREES.sub("", s).strip().rstrip(".").strip()
    while (m := _WRAPPER.match(s)) and _closing_brace(s, m.end() - 1) == len(s) - 1:
        s = s[m.end() : -1].strip()
    return _SCIENTIFIC.sub(r"\1\\times10^{\2}", s)


def as_number(answer: str) -> Fraction | None:
    """Exact value of a normalized plain numeral (`204`, `-0.5`, `1,000`, `x=3`, `5\\text{cm}`, `3\\times10^{8}`).

    None means "not a plain numeral": the slow path decides. Never parses LaTeX.
    """
    s = answer.replace(" ", "")
    if len(s) > _MAX_FAST_CHARS:
        return None
    s = _UNIT.sub("", _ASSIGNMENT.sub("", s))
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    m = _NUMBER.fullmatch(s)
    if m is None:
        return None
    return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2) or 0)


# --- 3. Pre-screen: broken or explosive answers never reach sympy --------------------------------------------------
_TOKEN = re.compile(r"\\[a-zA-Z]+|\\.|\S", re.DOTALL)
_NUMERIC_TEXT = re.compile(r"[\d\s{}()^!+\-]*")  # only digits, groups, powers, factorials: a size can be estimated
_EXPONENT = re.compile(r"\^\s*(\{|\d+|\\[a-zA-Z]+|.)", re.DOTALL)
_FACTORIAL = re.compile(r"(\d+|\([^()]*\)|\{[^{}]*\})\s*!")  # 26!, (10^{6})!: what the ! applies to


def _unwrap(text: str) -> str:
    """`{x}` or `(x)` -> `x` when the outer pair encloses the whole text."""
    t = text.strip()
    while len(t) >= 2 and (t[0], t[-1]) in (("{", "}"), ("(", ")")):
        depth = 0
        for i, c in enumerate(t):
            depth += (c == t[0]) - (c == t[-1])
            if depth == 0 and i < len(t) - 1:
                return t  # the first group closes early: `(1)(2)`
        t = t[1:-1].strip()
    return t


def _size(text: str) -> float:
    """Rough magnitude of a numeric expression made of integers, ^ and !; 0.0 for anything symbolic."""
    if not _NUMERIC_TEXT.fullmatch(text):
        return 0.0
    t = _unwrap(text).lstrip("+-").strip()
    if t.isdecimal():
        return float(t) if len(t) < 300 else math.inf
    depth = 0
    for i, c in enumerate(t):  # split at the first top-level ^ into base and exponent
        depth += (c in "{(") - (c in "})")
        if c == "^" and depth == 0:
            base, exponent = _size(t[:i]), _size(t[i + 1 :])
            if base <= 1:
                return base
            # log10(base ** exponent) = exponent * log10(base); beyond 10^300 call it infinite
            return math.inf if exponent * math.log10(base) > 300 else base**exponent
    if t.endswith("!"):
        n = _size(t[:-1])
        return math.inf if n > 170 else math.gamma(n + 1)
    return 0.0


def is_explosive(answer: str) -> bool:
    """True when `answer` is broken or could make sympy run away; cheap string checks only (no parsing)."""
    if len(answer) > MAX_ANSWER_CHARS:
        return True
    braces: list[bool] = []  # one entry per open {, True when the group is an exponent (opened right after ^)
    brackets = deepest = tower = 0
    previous = ""
    for m in _TOKEN.finditer(answer):
        token = m.group()
        if token == "{":
            braces.append(previous == "^")
        elif token == "}":
            if not braces:
                return True  # unbalanced
            braces.pop()
        elif token in "([":
            brackets += 1
        elif token in ")]":
            brackets -= 1
        elif token == "^":
            tower = max(tower, 1 + sum(braces))  # this power sits inside sum(braces) exponents
        deepest = max(deepest, len(braces) + brackets)
        previous = token
    if braces or deepest > MAX_NESTING or tower > MAX_TOWER:
        return True
    for m in _EXPONENT.finditer(answer):  # the exponent of each ^: a {group} (balanced, checked above) or one token
        exponent = answer[m.start(1) : _closing_brace(answer, m.start(1)) + 1] if m.group(1) == "{" else m.group(1)
        if _size(exponent) > MAX_EXPONENT:
            return True
    return any(_size(m.group(1)) > MAX_FACTORIAL for m in _FACTORIAL.finditer(answer))


# --- 4. Slow path: Math-Verify, only ever run inside a worker process (it has no time bound of its own here) -------
def math_verify_equal(pred: str, gold: str) -> bool:
    """Math-Verify's parse + verify on two bare, normalized answers. Unbounded in time: run it through CheckPool
    (plumbing/check_pool.py), whose workers import it by name."""
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that its own timeout is off
    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=None))


class CheckPool(check_pool.CheckPool):
    """The slow path's worker processes (plumbing/check_pool.py) with this rule's defaults: Math-Verify
    (`math_verify_equal`), TIMEOUT_S per check, WORKERS workers."""

    def __init__(self, workers: int = WORKERS, timeout_s: float = TIMEOUT_S, equal_fn=math_verify_equal, **options):
        super().__init__(workers, timeout_s, equal_fn, **options)


_default_pool: CheckPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> CheckPool:
    """The shared pool used when no pool is passed; created on first use and closed at interpreter exit."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = CheckPool()
            atexit.register(_default_pool.close)
        return _default_pool


# --- 5. Public API -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """The outcome of one check. decided_by: "no_answer", "fast", "screened", "slow", "timeout" or "crash"."""

    correct: bool
    decided_by: str

    @property
    def timed_out(self) -> bool:
        return self.decided_by == "timeout"


def answer_text(answer) -> str | None:
    """An answer as the text the checker reads: a str as it is; an int, a float or a Fraction as the text of the
    same number. A float means its shortest repr, as written (0.5 -> "0.5", 0.1 -> "0.1", not the binary value
    0.1000000000000000055...); Fraction(-3, 8) -> "-\\frac{3}{8}". None for anything else: bool (not a number
    here), nan and inf, an int of over 4 * MAX_ANSWER_CHARS bits, other types."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        # over 4 bits a digit it has more than MAX_ANSWER_CHARS digits (screened anyway); str() of it may refuse
        return str(answer) if answer.bit_length() <= 4 * MAX_ANSWER_CHARS else None
    if isinstance(answer, float):
        return repr(answer) if math.isfinite(answer) else None
    if isinstance(answer, Fraction):
        if answer.denominator == 1:
            return answer_text(answer.numerator)
        sign = "-" if answer < 0 else ""
        return f"{sign}\\frac{{{abs(answer.numerator)}}}{{{answer.denominator}}}"
    return None


def _decide_locally(pred, gold) -> Verdict | tuple[str, str]:
    """A Verdict when no sympy is needed, else the normalized (pred, gold) pair for the slow path."""
    pred, gold = answer_text(pred), answer_text(gold)
    if pred is None or gold is None or not pred.strip() or not gold.strip():
        return Verdict(False, "no_answer")
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return Verdict(False, "screened")
    pred, gold = normalize(pred), normalize(gold)
    if pred == gold:  # the same text is the same value, whatever it is
        return Verdict(True, "fast")
    pred_value, gold_value = as_number(pred), as_number(gold)
    if pred_value is not None and gold_value is not None:
        return Verdict(pred_value == gold_value, "fast")
    if not pred or is_explosive(pred) or is_explosive(gold):
        return Verdict(False, "screened")
    return pred, gold


def check(pred: str | None, gold, pool: CheckPool | None = None) -> Verdict:
    """Is the extracted answer `pred` mathematically equivalent to `gold`? Either may also be an int, a float or a
    Fraction, read as the text of that number (`answer_text`). Bounded in time; never raises on any input (only a
    RuntimeError when the worker processes cannot start at all, e.g. math-verify is missing)."""
    local = _decide_locally(pred, gold)
    if isinstance(local, Verdict):
        return local
    equal, status = (pool or default_pool()).run(*local)
    return Verdict(equal, status)


def check_many(preds: list, golds: list, pool: CheckPool | None = None) -> list[Verdict]:
    """check() over pairs; the fast ones in this thread, the slow ones spread over the pool's workers."""
    verdicts = [_decide_locally(p, g) for p, g in zip(preds, golds, strict=True)]
    slow = [i for i, v in enumerate(verdicts) if not isinstance(v, Verdict)]
    if slow:
        pool = pool or default_pool()
        with ThreadPoolExecutor(max_workers=pool.workers) as threads:
            results = list(threads.map(lambda i: pool.run(*verdicts[i]), slow))
        for i, (equal, status) in zip(slow, results):
            verdicts[i] = Verdict(equal, status)
    return verdicts


def score_trajectories(trajs: list, golds: list, pool: CheckPool | None = None) -> list[Verdict]:
    """Each rollout's reward, set on it (`t.reward`): 1.0 if the last boxed answer of its own text (`t.text`) is
    equivalent to its gold answer, else 0.0. Returns the verdicts (timeouts, how each was decided)."""
    verdicts = check_many([extract_answer(t.text) for t in trajs], golds, pool)
    for t, v in zip(trajs, verdicts):
        t.reward = 1.0 if v.correct else 0.0
    return verdicts


def is_equivalent(pred, gold, pool: CheckPool | None = None) -> bool:
    """True when `pred` (an extracted answer) is mathematically equivalent to `gold`."""
    return check(pred, gold, pool).correct


def compute_reward(response: str, gold, pool: CheckPool | None = None) -> float:
    """r = 1.0 if the last boxed answer in the model's own text is equivalent to `gold` (a str, or a number as
    `check` takes it), else 0.0 (report §2)."""
    return 1.0 if check(extract_answer(response), gold, pool).correct else 0.0


def reward_metrics(verdicts: list[Verdict]) -> dict[str, float]:
    """Counts for the log: timeouts and screened answers (both scored 0), and the share that needed sympy."""
    n = max(len(verdicts), 1)
    by = [v.decided_by for v in verdicts]
    return {
        "reward/timeouts": float(by.count("timeout")),
        "reward/screened": float(by.count("screened")),
        "reward/no_answer_frac": by.count("no_answer") / n,
        "reward/slow_frac": sum(b in ("slow", "timeout", "crash") for b in by) / n,
    }


if __name__ == "__main__":
    demo = [("<reason>...</reason><answer>The answer is \\boxed{ 204 }.</answer>", "204"),
            ("<answer>\\boxed{\\dfrac{1}{2}}</answer>", "0.5"),
            ("<answer>\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}</answer>", "\\left( 3, \\frac{\\pi}{2} \\right)"),
            ("<answer>\\boxed{9^{9^{9^{9}}}}</answer>", "204"), ("no box at all: 204", "204")]
    for response, gold in demo:
        print(f"{compute_reward(response, gold):.0f}  {check(extract_answer(response), gold)}  {response[:60]!r}")
