"""The task for a real small LM (SmolLM2-135M-Instruct): word problems whose integer answer a short program finds
and mental arithmetic does not, plus the non-reasoning SFT data that teaches the tool protocol on other tasks.

The stand-in for the report's RL data (integer-answer math problems, its section on the training recipe) and for its
non-reasoning SFT (tool use and the answer format, no reasoning traces), at a size a laptop CPU trains on.

RL families (FAMILIES; each has a few phrasings and two levels of difficulty, the second with bigger numbers or one
more condition): products of big numbers, sums of several big numbers, modular powers, digit sums of powers and
factorials, counts in a range with a divisibility property, binomial coefficients, prime counts, gcd and lcm, and
base conversion. One more family, sums of divisors (TRANSFER), is kept out of SFT and RL: the test split holds it as
a transfer line, a kind of problem the policy never trained on.

SFT tasks (SFT_TASKS) are from none of those families: letters and words in strings, lists of numbers (largest,
median, how many even), dates (days between, day of the year), units (seconds in a time, metres in kilometres),
alphabet positions, weekdays in a year, clock times; their programs are of several shapes (one line, a loop, a
list comprehension, an import). Each conversation is one trace kind, in the fractions of SFT_MIX:
- "tool": one clean call, then the printed number boxed;
- "direct": an easy instance answered without the tool (the report's SFT data answers some directly); its answer is
  right, so SFT shows both choices and RL decides which pays on the RL families;
- "fix": a first call with a bug a small model writes (an unclosed parenthesis, a misspelt name or module), the
  tool's real error text, the fixed call, then the answer.
The tool responses come from running every call through the real CodeTool, so SFT shows the text a rollout sees.

Splits, from one seeded generator, disjoint in problem text and in numbers (each program is drawn once overall): test.jsonl
(`n_test` per family and level, the transfer family's too, drawn first so they do not change with the other sizes),
train.jsonl (`n_train` per family and level), val.jsonl (`n_val` per family and level, for choosing between
models), sft.jsonl (`n_sft` conversations). Each problem row has `family` and `level`.

Run `python -m smol.task runs/smol/data [--seed 0 --n-train 200 --n-test 8 --n-val 4 --n-sft 480]`.
"""
import argparse
import math
import random
from datetime import date, timedelta
from pathlib import Path

from code_tool import BACKENDS, CodeTool
from plumbing.data import write_jsonl

TOOL_NAME = "python"  # the configs' tool_name (ours: a short name is fewer tokens in every call)
TOOL_TIMEOUT_S = 4.0  # as the configs' tool_timeout
TOOL_MAX_OUTPUT_CHARS = 1000
SFT_MIX = {"tool": 0.55, "direct": 0.3, "fix": 0.15}  # SFT trace-kind fractions (ours)
THINK_TOOL = ["Let me compute this with Python.", "I will write a short program for this.",
              "This is easiest to get right with code.", "Python can work this out exactly."]
THINK_DIRECT = ["This is small enough to answer directly.", "I can do this one in my head."]
THINK_FIX = ["The code failed; let me fix it.", "There is an error in the code. Fixed version:"]


# ------------------------------------------------------------------------------------------ RL families
# Each draws numbers from `rng` for `level` (1 or 2) and returns (problem text, integer answer, a correct program).
def _product(rng, level):
    if level == 1:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        text = rng.choice([f"What is {a} times {b}?", f"Multiply {a} by {b}.", f"Compute the product of {a} and {b}."])
        return text, a * b, f"print({a} * {b})"
    a, b, c = rng.randint(1000, 9999), rng.randint(100, 999), rng.randint(11, 99)
    text = rng.choice([f"What is {a} times {b} times {c}?", f"Compute the product of {a}, {b} and {c}.",
                       f"Multiply {a} by {b}, then multiply the result by {c}."])
    return text, a * b * c, f"print({a} * {b} * {c})"


def _sum(rng, level):
    numbers = [rng.randint(10_000, 99_999) for _ in range(3)] if level == 1 else \
        [rng.randint(100_000, 999_999) for _ in range(5)]
    listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    text = rng.choice([f"What is the sum of {listed}?", f"Add {listed}.", f"Compute the total of {listed}."])
    return text, sum(numbers), f"print({' + '.join(map(str, numbers))})"


def _mod_power(rng, level):
    base, exp, mod = (rng.randint(2, 19), rng.randint(20, 99), rng.randint(7, 99)) if level == 1 else \
        (rng.randint(20, 999), rng.randint(100, 9999), rng.randint(100, 9999))
    text = rng.choice([f"What is {base}^{exp} mod {mod}?",
                       f"Find the remainder when {base}^{exp} is divided by {mod}.",
                       f"Compute {base} to the power {exp}, modulo {mod}."])
    return text, pow(base, exp, mod), f"print(pow({base}, {exp}, {mod}))"


def _digit_sum(rng, level):
    if level == 1:
        base, exp = rng.randint(2, 12), rng.randint(15, 60)
        text = rng.choice([f"What is the sum of the digits of {base}^{exp}?",
                           f"Add up the digits of {base} to the power {exp}."])
        return text, sum(map(int, str(base ** exp))), f"print(sum(int(d) for d in str({base} ** {exp})))"
    if rng.random() < 0.5:
        n = rng.randint(15, 150)
        text = rng.choice([f"What is the sum of the digits of {n}!?", f"Add up the digits of {n} factorial."])
        return (text, sum(map(int, str(math.factorial(n)))),
                f"import math\nprint(sum(int(d) for d in str(math.factorial({n}))))")
    base, exp = rng.randint(13, 99), rng.randint(30, 150)
    text = rng.choice([f"What is the sum of the digits of {base}^{exp}?",
                       f"Add up the digits of {base} to the power {exp}."])
    return text, sum(map(int, str(base ** exp))), f"print(sum(int(d) for d in str({base} ** {exp})))"


def _count_divisible(rng, level):
    n = rng.randint(200, 5000)
    if level == 1:
        a, b = rng.sample(range(3, 20), 2)
        text = rng.choice([f"How many integers from 1 to {n} are divisible by {a} or {b}?",
                           f"Count the numbers between 1 and {n} (inclusive) that are multiples of {a} or of {b}."])
        return (text, sum(1 for i in range(1, n + 1) if i % a == 0 or i % b == 0),
                f"print(sum(1 for i in range(1, {n} + 1) if i % {a} == 0 or i % {b} == 0))")
    a, b, c = rng.sample(range(3, 20), 3)
    text = rng.choice([f"How many integers from 1 to {n} are divisible by {a} or {b} but not by {c}?",
                       f"Count the numbers between 1 and {n} (inclusive) that are multiples of {a} or of {b}, "
                       f"but not multiples of {c}."])
    return (text, sum(1 for i in range(1, n + 1) if (i % a == 0 or i % b == 0) and i % c != 0),
            f"print(sum(1 for i in range(1, {n} + 1) if (i % {a} == 0 or i % {b} == 0) and i % {c} != 0))")


def _binomial(rng, level):
    n = rng.randint(10, 40) if level == 1 else rng.randint(41, 90)
    k = rng.randint(3, n // 2)
    text = rng.choice([f"How many ways are there to choose {k} items from {n}?", f"What is {n} choose {k}?",
                       f"In how many ways can a team of {k} be picked from {n} people?"])
    return text, math.comb(n, k), f"import math\nprint(math.comb({n}, {k}))"


def _is_prime(n):
    return n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _prime_count(rng, level):
    if level == 1:
        n = rng.randint(100, 2000)
        text = rng.choice([f"How many prime numbers are less than {n}?", f"Count the primes below {n}."])
        return (text, sum(map(_is_prime, range(n))),
                f"print(sum(1 for n in range(2, {n}) if all(n % d for d in range(2, int(n ** 0.5) + 1))))")
    lo = rng.randint(1000, 20000)
    hi = lo + rng.randint(500, 5000)
    text = rng.choice([f"How many prime numbers are between {lo} and {hi}?",
                       f"Count the primes p with {lo} <= p <= {hi}."])
    return (text, sum(map(_is_prime, range(lo, hi + 1))),
            f"print(sum(1 for n in range({lo}, {hi} + 1) if all(n % d for d in range(2, int(n ** 0.5) + 1))))")


def _gcd_lcm(rng, level):
    if level == 1:
        g = rng.randint(2, 60)
        a, b = g * rng.randint(10, 200), g * rng.randint(10, 200)
        text = rng.choice([f"What is the greatest common divisor of {a} and {b}?", f"Find gcd({a}, {b})."])
        return text, math.gcd(a, b), f"import math\nprint(math.gcd({a}, {b}))"
    a, b, c = rng.randint(12, 300), rng.randint(12, 300), rng.randint(12, 300)
    text = rng.choice([f"What is the least common multiple of {a}, {b} and {c}?", f"Find lcm({a}, {b}, {c})."])
    return text, math.lcm(a, b, c), f"import math\nprint(math.lcm({a}, {b}, {c}))"


def _to_base(n, base):
    digits = ""
    while n:
        n, d = divmod(n, base)
        digits = str(d) + digits
    return digits or "0"


def _base(rng, level):
    base = rng.randint(2, 9)
    n = rng.randint(100, 5000) if level == 1 else rng.randint(10_000, 10 ** 7)
    text = rng.choice([f"Write {n} in base {base}.", f"What is the base-{base} representation of {n}?",
                       f"Convert {n} to base {base}."])
    code = f"n, s = {n}, ''\nwhile n:\n    s = str(n % {base}) + s\n    n //= {base}\nprint(s)"
    return text, int(_to_base(n, base)), code


def _divisor_sum(rng, level):
    n = rng.randint(100, 5000) if level == 1 else rng.randint(10_000, 1_000_000)
    text = rng.choice([f"What is the sum of all positive divisors of {n}?",
                       f"Add up every positive divisor of {n}."])
    return (text, sum(d for d in range(1, n + 1) if n % d == 0),
            f"print(sum(d for d in range(1, {n} + 1) if {n} % d == 0))")


FAMILIES = {"product": _product, "sum": _sum, "mod_power": _mod_power, "digit_sum": _digit_sum,
            "count_divisible": _count_divisible, "binomial": _binomial, "prime_count": _prime_count,
            "gcd_lcm": _gcd_lcm, "base": _base}
TRANSFER = {"divisor_sum": _divisor_sum}  # in the test split only: never in SFT or RL
LEVELS = (1, 2)


def draw_problem(rng, family: str, level: int, seen: set) -> dict:
    """One problem of `family` at `level` whose numbers are new: its program (which holds them, whatever the
    phrasing) is not in `seen`, and is added to it. {problem, answer, family, level, code}."""
    make = {**FAMILIES, **TRANSFER}[family]
    for _ in range(1000):
        text, answer, code = make(rng, level)
        if code not in seen:
            seen.add(code)
            return {"problem": text, "answer": str(answer), "family": family, "level": level, "code": code}
    raise RuntimeError(f"{family} level {level}: no new numbers in 1000 draws")


# ------------------------------------------------------------------------------------------ SFT tasks
WORDS = ["banana", "mississippi", "encyclopedia", "programming", "strawberry", "bookkeeper", "committee",
         "parallel", "accommodation", "occurrence", "rhythm", "onomatopoeia", "abracadabra", "assessment",
         "referee", "millennium", "possession", "tattoo", "cappuccino", "hippopotamus", "questionnaire",
         "succession", "balloon", "coffee", "jazz", "pepper", "giraffe", "kangaroo", "umbrella", "volcano"]
SENTENCES = ["the quick brown fox jumps over the lazy dog", "a small step for a man and a giant leap",
             "every good boy deserves fruit", "she sells sea shells by the sea shore",
             "to be or not to be that is the question", "all that glitters is not gold",
             "the early bird catches the worm", "a journey of a thousand miles begins with a single step"]


# Each SFT task draws from `rng` and returns (problem, integer answer, program, easy): `easy` instances may be
# answered directly.
def _letter_count(rng):
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    text = rng.choice([f"How many times does the letter '{letter}' appear in '{word}'?",
                       f"Count the '{letter}'s in the word \"{word}\"."])
    return text, word.count(letter), f"print('{word}'.count('{letter}'))", len(word) <= 6


def _word_length(rng):
    word = rng.choice(WORDS)
    text = rng.choice([f"How many letters are in the word '{word}'?", f"What is the length of \"{word}\"?"])
    return text, len(word), f"print(len('{word}'))", len(word) <= 6


def _vowels(rng):
    sentence = rng.choice(SENTENCES + WORDS)
    text = f"How many vowels (a, e, i, o, u) are in \"{sentence}\"?"
    code = f"text = '{sentence}'\nprint(len([ch for ch in text if ch in 'aeiou']))"
    return text, sum(ch in "aeiou" for ch in sentence), code, False


def _word_count(rng):
    sentence = rng.choice(SENTENCES)
    text = rng.choice([f"How many words are in the sentence \"{sentence}\"?",
                       f"Count the words in: {sentence}"])
    return text, len(sentence.split()), f"print(len('{sentence}'.split()))", len(sentence.split()) <= 6


def _list_stat(rng):
    numbers = [rng.randint(1, 999) for _ in range(rng.randint(4, 9))]
    listed = ", ".join(map(str, numbers))
    kind = rng.choice(["max", "min", "even", "range"])
    if kind == "max":
        return f"What is the largest number in the list {listed}?", max(numbers), f"print(max([{listed}]))", \
            len(numbers) <= 4
    if kind == "min":
        return f"What is the smallest of these numbers: {listed}?", min(numbers), f"print(min([{listed}]))", \
            len(numbers) <= 4
    if kind == "even":
        return (f"How many even numbers are in the list {listed}?", sum(x % 2 == 0 for x in numbers),
                f"xs = [{listed}]\nprint(len([x for x in xs if x % 2 == 0]))", len(numbers) <= 5)
    return (f"What is the difference between the largest and the smallest of {listed}?", max(numbers) - min(numbers),
            f"xs = [{listed}]\nprint(max(xs) - min(xs))", False)


def _median(rng):
    numbers = [rng.randint(1, 500) for _ in range(rng.choice([5, 7, 9]))]
    listed = ", ".join(map(str, numbers))
    return (f"What is the median of {listed}?", sorted(numbers)[len(numbers) // 2],
            f"xs = sorted([{listed}])\nprint(xs[len(xs) // 2])", False)


def _days_between(rng):
    start = date(rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28))
    end = start + timedelta(days=rng.randint(3, 2000))
    text = rng.choice([f"How many days are there from {start} to {end}?",
                       f"How many days after {start} is {end}?"])
    code = f"from datetime import date\nprint((date.fromisoformat('{end}') - date.fromisoformat('{start}')).days)"
    return text, (end - start).days, code, (end - start).days <= 7


def _day_of_year(rng):
    day = date(rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28))
    code = f"from datetime import date\nprint(date.fromisoformat('{day}').timetuple().tm_yday)"
    return f"What day of the year is {day}?", day.timetuple().tm_yday, code, day.month == 1


def _units(rng):
    kind = rng.choice(["time", "length", "weight"])
    if kind == "time":
        h, m = rng.randint(0, 9), rng.randint(1, 59)
        return (f"How many seconds are in {h} hours and {m} minutes?", (h * 60 + m) * 60,
                f"print(({h} * 60 + {m}) * 60)", h == 0 and m <= 5)
    if kind == "length":
        km = rng.randint(1, 99) / 10 if rng.random() < 0.5 else rng.randint(1, 40)
        return (f"How many metres are in {km} km?", round(km * 1000), f"print(round({km} * 1000))",
                isinstance(km, int) and km <= 5)
    kg = rng.randint(1, 50)
    return f"How many grams are in {kg} kg?", kg * 1000, f"print({kg} * 1000)", kg <= 5


def _alphabet(rng):
    letter = rng.choice("abcdefghijklmnopqrstuvwxyz")
    text = rng.choice([f"What is the position of the letter '{letter}' in the English alphabet?",
                       f"Which number is the letter '{letter}' in the alphabet (a = 1)?"])
    return text, ord(letter) - 96, f"print(ord('{letter}') - ord('a') + 1)", letter in "abcde"


def _long_words(rng):
    sentence, n = rng.choice(SENTENCES), rng.randint(3, 5)
    code = f"words = '{sentence}'.split()\ncount = 0\nfor w in words:\n    if len(w) > {n}:\n        count += 1\nprint(count)"
    return (f"How many words in \"{sentence}\" have more than {n} letters?",
            sum(len(w) > n for w in sentence.split()), code, False)


def _longest_word(rng):
    sentence = rng.choice(SENTENCES)
    return (f"How many letters does the longest word of \"{sentence}\" have?",
            max(len(w) for w in sentence.split()), f"print(max(len(w) for w in '{sentence}'.split()))", False)


def _distinct_letters(rng):
    word = rng.choice(WORDS)
    return (f"How many different letters does '{word}' use?", len(set(word)), f"letters = set('{word}')\nprint(len(letters))",
            len(word) <= 5)


def _weekdays(rng):
    year, weekday = rng.randint(1990, 2030), rng.randrange(7)
    name = ["Mondays", "Tuesdays", "Wednesdays", "Thursdays", "Fridays", "Saturdays", "Sundays"][weekday]
    start = date(year, 1, 1)
    days = (date(year + 1, 1, 1) - start).days
    answer = sum((start + timedelta(d)).weekday() == weekday for d in range(days))
    code = (f"from datetime import date, timedelta\nstart = date({year}, 1, 1)\ncount = 0\n"
            f"d = start\nwhile d.year == {year}:\n    if d.weekday() == {weekday}:\n        count += 1\n"
            f"    d += timedelta(days=1)\nprint(count)")
    return f"How many {name} are there in the year {year}?", answer, code, False


def _above_mean(rng):
    numbers = [rng.randint(1, 300) for _ in range(rng.randint(5, 9))]
    listed = ", ".join(map(str, numbers))
    mean = sum(numbers) / len(numbers)
    code = f"xs = [{listed}]\nmean = sum(xs) / len(xs)\nprint(len([x for x in xs if x > mean]))"
    return f"How many of the numbers {listed} are above their average?", sum(x > mean for x in numbers), code, False


def _clock(rng):
    h1, m1 = rng.randint(0, 11), rng.randint(0, 59)
    h2, m2 = rng.randint(h1 + 1, 23), rng.randint(0, 59)
    code = f"start = {h1} * 60 + {m1}\nend = {h2} * 60 + {m2}\nprint(end - start)"
    return (f"How many minutes pass from {h1:02d}:{m1:02d} to {h2:02d}:{m2:02d} on the same day?",
            (h2 * 60 + m2) - (h1 * 60 + m1), code, h2 == h1 + 1 and m1 == m2)


def _string_find(rng):
    sentence = rng.choice(SENTENCES)
    word = rng.choice(sentence.split())
    return (f"At which position (counting from 1) does the word '{word}' first start in \"{sentence}\"?",
            sentence.find(word) + 1, f"text = '{sentence}'\nprint(text.find('{word}') + 1)", False)


SFT_TASKS = [_letter_count, _word_length, _vowels, _word_count, _list_stat, _median, _days_between, _day_of_year,
             _units, _alphabet, _long_words, _longest_word, _distinct_letters, _weekdays, _above_mean, _clock,
             _string_find]


# ------------------------------------------------------------------------------------------ SFT traces
def buggy_code(code: str, rng) -> str:
    """A first attempt at `code` that fails when run, with a bug a small model writes."""
    bugs = [code.replace("print(", rng.choice(["prnt(", "pritn(", "Print("]), 1)]  # NameError
    if code.endswith(")"):
        bugs.append(code[:-1])                                  # SyntaxError: '(' was never closed
    if "from datetime import date" in code:
        bugs.append(code.replace("datetime", "datetim", 1))    # ModuleNotFoundError
    if code.startswith("xs = "):
        bugs.append(code.replace("xs", "x", 1))                 # NameError: name 'xs' is not defined
    if "\n    " in code:
        bugs.append(code.replace("\n    ", "\n", 1))          # IndentationError: expected an indented block
    return rng.choice(bugs)


def _call(code: str) -> list[dict]:
    return [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": code, "input": ""}}}]


def _answer(value, think: str = "") -> dict:
    return {"role": "assistant", "content": f"{think}</reason>\n<answer>\\boxed{{{value}}}</answer>"}


def plan_trace(rng, kind: str, easy_only_direct: bool = True) -> dict:
    """A drawn SFT task and its trace before the calls run: {kind, problem, answer, codes, think}. A direct trace
    redraws until the task is an easy one."""
    while True:
        text, answer, code, easy = rng.choice(SFT_TASKS)(rng)
        if kind != "direct" or easy or not easy_only_direct:
            break
    codes = {"tool": [code], "direct": [], "fix": [buggy_code(code, rng), code]}[kind]
    think = rng.choice(THINK_DIRECT if kind == "direct" else THINK_TOOL)
    return {"kind": kind, "problem": text, "answer": str(answer), "codes": codes, "think": think,
            "fix_think": rng.choice(THINK_FIX)}


def build_messages(plan: dict, results: list) -> list[dict]:
    """The conversation of a planned trace, given each call's ToolResult; refuses a trace whose tool output
    contradicts its answer (a wrong program in this file)."""
    messages = [{"role": "user", "content": plan["problem"]}]
    if plan["kind"] == "direct":
        return messages + [_answer(plan["answer"], plan["think"])]
    for i, (code, result) in enumerate(zip(plan["codes"], results)):
        think = plan["think"] if i == 0 else plan["fix_think"]
        messages.append({"role": "assistant", "content": f"{think}</reason>\n", "tool_calls": _call(code)})
        messages.append({"role": "tool", "content": result.render()})
    *first, last = results
    if any(r.ok for r in first) or not last.ok or last.stdout.strip() != plan["answer"]:
        raise RuntimeError(f"SFT trace for {plan['problem']!r} ({plan['kind']}): the calls gave "
                           f"{[r.render() for r in results]!r}, expected {plan['answer']}")
    return messages + [_answer(plan["answer"])]


def trace_kinds(n: int, mix: dict, rng) -> list[str]:
    """`n` trace kinds in the fractions of `mix` (rounded down; the remainder goes to the largest), shuffled."""
    total = sum(mix.values())
    counts = {k: int(n * v / total) for k, v in mix.items()}
    counts[max(mix, key=mix.get)] += n - sum(counts.values())
    kinds = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    return kinds


def sft_conversations(n: int, rng, mix: dict, workers: int = 2, tool_backend: str = "auto") -> list[dict]:
    """`n` SFT rows {messages, kind, answer}, each call run by the real tool; no two share a problem text."""
    plans, seen = [], set()
    for kind in trace_kinds(n, mix, rng):
        for _ in range(100):
            plan = plan_trace(rng, kind)
            if plan["problem"] not in seen:
                break
        seen.add(plan["problem"])
        plans.append(plan)
    calls = [(code, "") for plan in plans for code in plan["codes"]]
    with CodeTool(workers=workers, timeout=TOOL_TIMEOUT_S, max_output_chars=TOOL_MAX_OUTPUT_CHARS,
                  backend=tool_backend) as tool:
        results = iter(tool.run_batch(calls))
    return [{"messages": build_messages(plan, [next(results) for _ in plan["codes"]]), "kind": plan["kind"],
             "answer": plan["answer"]} for plan in plans]


# ------------------------------------------------------------------------------------------ the task files
def write_task(out_dir, seed: int = 0, n_train: int = 200, n_test: int = 8, n_val: int = 4, n_sft: int = 480,
               mix: dict | None = None, workers: int = 2, tool_backend: str = "auto") -> dict:
    """Write test.jsonl, train.jsonl, val.jsonl and sft.jsonl under `out_dir` (sizes per family and level, SFT in
    conversations); same seed, same files. Returns {split: path}."""
    out, rng, seen = Path(out_dir), random.Random(seed), set()
    every = [(f, lv) for f in {**FAMILIES, **TRANSFER} for lv in LEVELS]
    trained = [(f, lv) for f in FAMILIES for lv in LEVELS]
    test = [draw_problem(rng, f, lv, seen) for f, lv in every for _ in range(n_test)]
    train = [draw_problem(rng, f, lv, seen) for f, lv in trained for _ in range(n_train)]
    rng.shuffle(train)
    val = [draw_problem(rng, f, lv, seen) for f, lv in trained for _ in range(n_val)]
    sft = sft_conversations(n_sft, random.Random(seed + 1), mix or SFT_MIX, workers, tool_backend)

    def public(rows):  # the generator's program is not part of a problem file
        return [{k: v for k, v in row.items() if k != "code"} for row in rows]
    return {"test": write_jsonl(out / "test.jsonl", public(test)),
            "train": write_jsonl(out / "train.jsonl", public(train)),
            "val": write_jsonl(out / "val.jsonl", public(val)),
            "sft": write_jsonl(out / "sft.jsonl", sft)}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the SmolLM2 task's data files.")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=200, help="RL problems per family and level")
    parser.add_argument("--n-test", type=int, default=8, help="held-out problems per family and level")
    parser.add_argument("--n-val", type=int, default=4, help="validation problems per family and level")
    parser.add_argument("--n-sft", type=int, default=480, help="SFT conversations")
    parser.add_argument("--tool-backend", default="auto", choices=BACKENDS, help="the code tool's backend")
    args = parser.parse_args(argv)
    paths = write_task(args.out_dir, seed=args.seed, n_train=args.n_train, n_test=args.n_test, n_val=args.n_val,
                       n_sft=args.n_sft, tool_backend=args.tool_backend)
    for split, path in paths.items():
        print(f"{split:>6}: {path}")


if __name__ == "__main__":
    main()
