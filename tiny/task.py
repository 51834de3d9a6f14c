"""The built-in tiny task: synthetic integer arithmetic on which one correct Python call pays, plus its SFT data.

This is the CPU-scale stand-in for the report's RL data (42K integer-answer math problems, its section on the
training recipe) and for its non-reasoning SFT data. A ~1M-parameter character-level model
cannot multiply a 3-digit by a 2-digit number in its head, but it can learn to copy the numbers into
`print(347*89)` and the printed result into `\\boxed{}`: the tool truly pays, so RL has something to learn.

Problems (answers are integers, written as strings):
- level 1 (short code): "Compute 347*89." and "Compute 512+347*89.";
- level 2 (longer code, more room for bugs; the later RL stages): "Compute 3471*8923 mod 97.",
  "Digit sum of 37**12." and "Count n in 1..500 with n%7==3." (needs `range(1,500+1)`, an off-by-one trap).

Splits, all drawn from one seeded generator and disjoint in problem text (each text is drawn once overall):
- test.jsonl: `n_test` problems of each level (default 100 + 100), drawn first, so the held-out set does not
  change when the train or SFT sizes do;
- sft.jsonl: `n_sft` conversations for the non-reasoning SFT stage (`sft.py`);
- train_level1.jsonl, train_level2.jsonl: `n_train` problems each for the RL stages;
- val.jsonl: `n_val` problems of each level, drawn last (the other splits stay as they were), for choosing between
  models (the pipeline's stage-3 guard) without looking at the test split.

The SFT data teaches the format, not the policy (the analogue of the report's non-reasoning SFT, which has no
reasoning traces). Each conversation is one of four traces, in configurable fractions:
- "direct": no tool; the answer is the true one with probability `direct_correct`, else a near miss (one digit
  changed), because a tiny model answering from its head is mostly wrong;
- "tool": one clean call, then the printed number as the answer;
- "fix": a first call with a realistic bug (unclosed parenthesis, misspelt name, `=` for `==`, a wrong type),
  the real error text, a fixed call, then the answer;
- "sloppy": one call that prints the result and then fails on a leftover line (`print(ans)`, a name never
  assigned), so the tool reports an error with its traceback, and the answer read from the printed number is
  still right.
The sloppy traces are the tool noise the report's Resample-on-Correct exists for (its section on GRPO-RoC): a
rollout whose call failed yet whose answer is right earns the full reward, so plain GRPO has no reason to stop
writing such calls, while RoC prefers the clean positives, but only where a failed call costs the answer little.
With the defaults (full tracebacks) it costs some: at temperature 1.0 make tiny's SFT model answers 49% of
rollouts with a failed call correctly against 74% with clean calls (69% after a sloppy call: the ~130-character
traceback between the printed number and the answer is a longer copy than the 5 characters after "ok\n"), and
only 17% when the output is cut to 120 characters in the middle (text SFT never showed; the model then drops digits
of the number): the RL configs must render as this script does. The RoC ablation (tiny/ablation.py) therefore builds its
own task with `error_format="last_line"` and more sloppy traces, where a failed call costs nothing (97% against 97%).
Tool responses are produced by running every call through the real `CodeTool`, so SFT shows exactly the text a
rollout would see, errors included; `error_format` is the tool's (`CodeTool(error_format=...)`: the RL and eval
configs must use the same, `tool_error_format`), and `sloppy_line` the sloppy traces' leftover line. The thinking
text is a few words: the decision ("Guess", "Tool", "Fix") on the first token after `<reason>`, which is what RL
can move, then the problem's numbers restated, which keeps every copy the model must learn (problem -> thinking ->
code, tool output -> answer) within a few tokens.

Left out: natural-language word problems, multi-call problems beyond one fix, and any answer that is not an
integer. Run `python -m tiny.task runs/tiny/data [--seed 0 --n-train 2000 --n-test 100 --n-sft 4000]`.
"""
import argparse
import random
from pathlib import Path

from code_tool import BACKENDS, ERROR_FORMATS, CodeTool
from plumbing.data import write_jsonl
from protocol import TOOL_NAME

# Few words of thinking per trace kind (every character is a token for the tiny model): the decision word first, then
# the problem's numbers restated ({note}, e.g. "347*89"). The restatement sits a few tokens after the problem, and the
# code a few tokens after the restatement, so every copy is short-range: a 1M-parameter model from scratch learns
# short-range copying far sooner than copying across the whole prompt (docs/LOG.md).
THINK_DIRECT = "Guess: {note}."
THINK_TOOL = "Tool: {note}."
THINK_FIX = "Fix: {note}."
SLOPPY_LINE = "print(ans)"  # the leftover line of a sloppy call: NameError after the result is printed
DEFAULT_MIX = {"direct": 0.4, "tool": 0.25, "sloppy": 0.15, "fix": 0.2}  # SFT trace-kind fractions
# Tool settings used to render SFT tool responses; the tiny RL configs should run the tool with the same output cap
# so the SFT text and rollout text agree.
TOOL_TIMEOUT_S = 4.0
TOOL_MAX_OUTPUT_CHARS = 1000


# ------------------------------------------------------------------------------------------ problem kinds
# Each kind draws numbers from `rng` and returns (problem text, integer answer, correct code, note for the thinking).
def _mul(rng):
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return f"Compute {a}*{b}.", a * b, f"print({a}*{b})", f"{a}*{b}"


def _mul_add(rng):
    a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 999)
    return f"Compute {c}+{a}*{b}.", c + a * b, f"print({c}+{a}*{b})", f"{c}+{a}*{b}"


def _mul_mod(rng):
    a, b, m = rng.randint(1000, 9999), rng.randint(1000, 9999), rng.randint(11, 99)
    return f"Compute {a}*{b} mod {m}.", a * b % m, f"print({a}*{b}%{m})", f"{a}*{b}%{m}"


def _digit_sum(rng):
    # 2,225 texts: the default task draws ~1,270 digit sums (test, SFT, RL, validation); with k <= 15 there were 890,
    # and RL's level 2 got 13% digit sums against the test split's 39%.
    a, k = rng.randint(11, 99), rng.randint(6, 30)
    return (f"Digit sum of {a}**{k}.", sum(map(int, str(a ** k))), f"print(sum(map(int,str({a}**{k}))))",
            f"digits of {a}**{k}")


def _count_mod(rng):
    n, m = rng.randint(100, 999), rng.randint(3, 19)
    r = rng.randint(0, m - 1)
    answer = sum(1 for i in range(1, n + 1) if i % m == r)
    return (f"Count n in 1..{n} with n%{m}=={r}.", answer,
            f"print(sum(n%{m}=={r} for n in range(1,{n}+1)))", f"n%{m}=={r} up to {n}")


LEVELS = {1: [_mul, _mul_add], 2: [_mul_mod, _digit_sum, _count_mod]}


def draw_problem(rng, level: int, seen: set) -> dict:
    """One problem of `level` whose text is not in `seen` (added to it): {problem, answer, level, code, note}. The kind
    is drawn first and kept while its numbers are redrawn, so every split has the kinds in equal shares (redrawing the
    kind too would favour the kinds with the most texts left)."""
    kind = rng.choice(LEVELS[level])
    while True:
        text, answer, code, note = kind(rng)
        if text not in seen:
            seen.add(text)
            return {"problem": text, "answer": str(answer), "level": level, "code": code, "note": note}


# ------------------------------------------------------------------------------------------ traces
def near_miss(answer: str, rng) -> str:
    """A wrong answer that looks plausible: one digit changed (never a leading zero), never equal to `answer`."""
    digits = list(answer)
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0" and len(digits) > 1)]
    digits[i] = rng.choice(choices)
    return "".join(digits)


def buggy_code(code: str, rng) -> str:
    """A realistic first attempt at `code` that fails when run: the kinds of bugs a small model writes."""
    bugs = [code[:-1],                                   # SyntaxError: '(' was never closed
            code.replace("print(", rng.choice(["prnt(", "pirnt(", "Print("]), 1)]  # NameError
    if "==" in code:
        bugs.append(code.replace("==", "=", 1))          # SyntaxError: assignment inside an expression
    if "str(" in code:
        bugs.append(code.replace("map(int,str(", "map(int,(", 1))  # TypeError: 'int' object is not iterable
    return rng.choice(bugs)


def _call(code: str) -> list[dict]:
    return [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": code, "input": ""}}}]


def _answer(value: str, think: str = "") -> dict:
    return {"role": "assistant", "content": f"{think}</reason>\n<answer>\\boxed{{{value}}}</answer>"}


def plan_trace(problem: dict, kind: str, rng, direct_correct: float, sloppy_line: str = SLOPPY_LINE) -> dict:
    """The trace before execution: {kind, problem, level, answer, note, guess, codes (the calls to run, in order)}."""
    plan = {"kind": kind} | {key: problem[key] for key in ("problem", "level", "answer", "note")}
    if kind == "direct":
        correct = rng.random() < direct_correct
        plan.update(guess=problem["answer"] if correct else near_miss(problem["answer"], rng), codes=[])
    elif kind == "tool":
        plan.update(codes=[problem["code"]])
    elif kind == "fix":
        plan.update(codes=[buggy_code(problem["code"], rng), problem["code"]])
    elif kind == "sloppy":
        plan.update(codes=[problem["code"] + "\n" + sloppy_line])
    else:
        raise ValueError(f"unknown trace kind {kind!r}")
    return plan


def build_messages(plan: dict, responses: list) -> list[dict]:
    """The conversation of a planned trace, given each call's ToolResult (in order of plan['codes'])."""
    messages = [{"role": "user", "content": plan["problem"]}]
    if plan["kind"] == "direct":
        return messages + [_answer(plan["guess"], THINK_DIRECT.format(note=plan["note"]))]
    thinks = [THINK_TOOL.format(note=plan["note"]), THINK_FIX.format(note=plan["note"])]
    for i, (code, result) in enumerate(zip(plan["codes"], responses)):
        messages.append({"role": "assistant", "content": f"{thinks[min(i, 1)]}</reason>\n", "tool_calls": _call(code)})
        messages.append({"role": "tool", "content": result.render()})
    final = responses[-1]
    if final.ok == (plan["kind"] == "sloppy"):
        raise RuntimeError(f"the last call for {plan['problem']!r} ({plan['kind']}) gave {final.render()!r}")
    printed = final.stdout
    if printed.splitlines()[:1] != [plan["answer"]]:
        raise RuntimeError(f"tool output for {plan['problem']!r} does not show {plan['answer']}: {printed!r}")
    return messages + [_answer(plan["answer"])]


def trace_kinds(n: int, mix: dict, rng) -> list[str]:
    """`n` trace kinds in the fractions of `mix` (rounded; the remainder goes to the largest), shuffled."""
    total = sum(mix.values())
    counts = {k: int(n * v / total) for k, v in mix.items()}
    counts[max(mix, key=mix.get)] += n - sum(counts.values())
    kinds = [k for k, c in counts.items() for _ in range(c)]
    rng.shuffle(kinds)
    return kinds


# ------------------------------------------------------------------------------------------ the task files
def write_task(out_dir, seed: int = 0, n_train: int = 2000, n_test: int = 100, n_sft: int = 4000,
               n_val: int = 100, mix: dict | None = None, direct_correct: float = 0.2, sft_level2: float = 0.4,
               workers: int = 2, tool_backend: str = "auto", error_format: str = "full",
               sloppy_line: str = SLOPPY_LINE) -> dict:
    """Write test.jsonl, sft.jsonl, train_level1.jsonl, train_level2.jsonl and val.jsonl under `out_dir`; same seed,
    same files.

    mix: trace-kind fractions for SFT (default DEFAULT_MIX); direct_correct: chance that a
    direct answer is the true one; sft_level2: fraction of SFT problems from level 2; tool_backend: the code
    tool's backend (code_tool.BACKENDS), which renders the tool responses; error_format: how the tool renders a
    failed call (code_tool.ERROR_FORMATS); sloppy_line: the leftover line that makes a sloppy call fail after
    printing (it must raise). Returns {split: path}."""
    mix = mix or DEFAULT_MIX
    out = Path(out_dir)
    rng, seen = random.Random(seed), set()
    test = [draw_problem(rng, level, seen) for level in (1, 2) for _ in range(n_test)]
    sft_problems = [draw_problem(rng, 2 if rng.random() < sft_level2 else 1, seen) for _ in range(n_sft)]
    train = {level: [draw_problem(rng, level, seen) for _ in range(n_train)] for level in (1, 2)}

    plans = [plan_trace(p, kind, rng, direct_correct, sloppy_line)
             for p, kind in zip(sft_problems, trace_kinds(n_sft, mix, rng))]
    val = [draw_problem(rng, level, seen) for level in (1, 2) for _ in range(n_val)]
    calls = [(code, "") for plan in plans for code in plan["codes"]]
    with CodeTool(workers=workers, timeout=TOOL_TIMEOUT_S, max_output_chars=TOOL_MAX_OUTPUT_CHARS,
                  backend=tool_backend, error_format=error_format) as tool:
        results = iter(tool.run_batch(calls))
    sft = [{"messages": build_messages(plan, [next(results) for _ in plan["codes"]]),
            "kind": plan["kind"], "level": plan["level"], "answer": plan["answer"]} for plan in plans]

    def public(rows):  # the generator's code and note are not part of a problem file
        return [{k: v for k, v in row.items() if k not in ("code", "note")} for row in rows]
    return {"test": write_jsonl(out / "test.jsonl", public(test)),
            "sft": write_jsonl(out / "sft.jsonl", sft),
            "train_level1": write_jsonl(out / "train_level1.jsonl", public(train[1])),
            "train_level2": write_jsonl(out / "train_level2.jsonl", public(train[2])),
            "val": write_jsonl(out / "val.jsonl", public(val))}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the tiny task's data files.")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=2000, help="RL problems per level")
    parser.add_argument("--n-test", type=int, default=100, help="held-out problems per level")
    parser.add_argument("--n-sft", type=int, default=4000, help="SFT conversations")
    parser.add_argument("--n-val", type=int, default=100, help="validation problems per level (model choice)")
    parser.add_argument("--direct", type=float, default=DEFAULT_MIX["direct"], help="fraction of direct-answer traces")
    parser.add_argument("--tool", type=float, default=DEFAULT_MIX["tool"], help="fraction of clean tool-use traces")
    parser.add_argument("--fix", type=float, default=DEFAULT_MIX["fix"], help="fraction of fail-then-fix traces")
    parser.add_argument("--sloppy", type=float, default=DEFAULT_MIX["sloppy"],
                        help="fraction of traces whose call prints the answer, then fails on a leftover line")
    parser.add_argument("--direct-correct", type=float, default=0.2, help="chance a direct answer is right")
    parser.add_argument("--tool-backend", default="auto", choices=BACKENDS, help="the code tool's backend")
    parser.add_argument("--error-format", default="full", choices=ERROR_FORMATS,
                        help="how the tool shows a failed call (the RL/eval tool_error_format must match)")
    parser.add_argument("--sloppy-line", default=SLOPPY_LINE, help="the leftover line that fails a sloppy call")
    args = parser.parse_args(argv)
    paths = write_task(args.out_dir, seed=args.seed, n_train=args.n_train, n_test=args.n_test, n_sft=args.n_sft,
                       n_val=args.n_val,
                       mix={"direct": args.direct, "tool": args.tool, "sloppy": args.sloppy, "fix": args.fix},
                       direct_correct=args.direct_correct, tool_backend=args.tool_backend,
                       error_format=args.error_format, sloppy_line=args.sloppy_line)
    for split, path in paths.items():
        print(f"{split:>13}: {path}")


if __name__ == "__main__":
    main()
