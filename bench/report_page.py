"""Benchmark: the report of a 200-problem x 4-sample evaluation opened in headless Chromium: size,
bytes per rollout and time to open, for tools/report.py's page and for a page with every sample in HTML.

tools/report.py embeds the rollouts as JSON and builds a problem's samples when the reader opens it. The
alternative, "prerendered", is that page with every problem opened, its DOM serialized and its
scripts removed: every sample as escaped HTML, nothing to build. The two are opened alternately,
each in a fresh browser, and the medians of the page's own timings (Navigation and Paint Timing,
from navigation start: the browser's start-up is not counted) are printed with their ratio.

Rollouts are synthetic and seeded, in rollout.trajectory_record's format, with a mix of call statuses,
at two sizes: "tiny" as in the tiny pipeline (a short thought, one call, a boxed answer: about 350
characters) and "long" at the report's scale (8 turns of ~1,500 characters of reasoning, a call
each: ~13K characters, some 4K tokens). Bytes per rollout = (page - the same page without
rollouts) / rollouts, shown next to the size of the rollout's line in trajectories.jsonl.
Run: `.venv/bin/python bench/report_page.py [--problems 200] [--samples 4] [--repeats 3]`.
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval as ev  # noqa: E402
from tools import report  # noqa: E402
from tools.browser import open_page  # noqa: E402
from code_tool import ToolResult  # noqa: E402
from protocol import format_tool_call  # noqa: E402
from rollout import PARSE_ERROR, ToolCallRecord, Trajectory  # noqa: E402

WORDS = ("the sum of we need so let x y n prime modulo compute check since then therefore count "
         "pairs integer divisible square root factor case each value equation gives both sides "
         "total answer is").split()
STATUSES = ["ok"] * 14 + ["error"] * 3 + ["timeout", "memory", PARSE_ERROR]  # 30% of calls fail
SIZES = {"tiny": (1, 120), "long": (8, 1500)}  # turns with a call, characters of reasoning a turn

OPEN_ALL = """new Promise(done => {
  const items = [...document.querySelectorAll("details.problem")];
  items.forEach(d => { d.open = true; });
  const finish = () => {
    document.querySelectorAll("script").forEach(s => s.remove());
    done("<!DOCTYPE html>\\n" + document.documentElement.outerHTML);
  };
  const check = () => items.every(d => d.children.length > 1) ? finish() : setTimeout(check, 20);
  check();
})"""


def words(rng: random.Random, chars: int) -> str:
    out, length = [], 0
    while length < chars:
        out.append(rng.choice(WORDS))
        length += len(out[-1]) + 1
    return " ".join(out)


def call(rng: random.Random) -> ToolCallRecord:
    status = rng.choice(STATUSES)
    if status == PARSE_ERROR:
        error = "tool call error: invalid JSON (JSONDecodeError: Expecting ',' delimiter)"
        return ToolCallRecord("", "", error, status)
    code = f"n = {rng.randint(2, 999)}\nprint(sum(i * i for i in range(n)) % {rng.randint(2, 99)})"
    ok = status == "ok"
    stdout, stderr = (f"{rng.randint(0, 10**6)}\n", "") if ok else ("", f"{status}: stopped")
    return ToolCallRecord(code, "", ToolResult(status, stdout, stderr).render(), status)


def rollout_record(rng: random.Random, problem: dict, index: int, sample: int, size: str) -> dict:
    """One synthetic rollout of `problem`, as a trajectories.jsonl record."""
    turns_with_calls, chars = SIZES[size]
    calls = [call(rng) for _ in range(turns_with_calls)]
    turns = [words(rng, chars) + "\n" + format_tool_call(c.code or "print(") for c in calls]
    correct = rng.random() < 0.5
    answer = problem["answer"] if correct else str(rng.randint(1000, 1999))
    turns.append(words(rng, chars // 4) + f"\n</reason>\n<answer>\\boxed{{{answer}}}</answer>")
    tokens = sum(len(t) for t in turns) // 3
    traj = Trajectory("p", [0], response_ids=[0] * tokens, loss_mask=[1] * tokens, turns=turns,
                      tool_calls=calls, end_reason="answer", reward=float(correct))
    return ev.trajectory_record("bench", problem, index, sample, traj)


def evaluation(problems: int, samples: int, size: str) -> tuple[dict, list[dict]]:
    """(results.json's "benchmarks", records): one benchmark, problems x samples rollouts."""
    rng = random.Random(0)
    records = []
    for i in range(problems):
        problem = {"problem": words(rng, 300), "answer": str(rng.randint(0, 999)), "id": f"p{i}"}
        records += [rollout_record(rng, problem, i, j, size) for j in range(samples)]
    metrics = {"problems": problems, "samples": samples, "pass@1": 0.5, "pass@1_se": 0.03,
               "pass@k": 0.9, "maj@k": 0.6, "response_tokens_mean": 1000.0,
               "tool_calls_mean": 1.0, "tool_error_rate": 0.3, "tool_error_rate_in_correct": 0.3,
               "truncated_frac": 0.0}
    return {"bench": metrics}, records


def timings(path: Path) -> dict:
    result = open_page(str(path))
    if result.errors or result.blank:
        raise SystemExit(f"{path}: {result.errors or 'blank page'}")
    return result.facts


def measure(folder: Path, problems: int, samples: int, size: str, repeats: int) -> dict:
    """Sizes and median timings of both pages for one rollout size."""
    results, records = evaluation(problems, samples, size)
    pages = {"tools/report.py": folder / f"{size}_report.html",
             "prerendered": folder / f"{size}_prerendered.html"}
    pages["tools/report.py"].write_text(report.render_report(results, records, "bench"), encoding="utf-8")
    html = open_page(str(pages["tools/report.py"]), expressions=(OPEN_ALL,)).values[0]
    pages["prerendered"].write_text(html, encoding="utf-8")
    runs = {name: [] for name in pages}
    for _ in range(repeats):  # alternate, so that drift in the machine's speed hits both alike
        for name, path in pages.items():
            runs[name].append(timings(path))
    empty = len(report.render_report(results, [], "bench").encode())
    jsonl = sum(len(json.dumps(r, ensure_ascii=False).encode()) + 1 for r in records)
    rows = {}
    for name, path in pages.items():
        size_bytes = path.stat().st_size
        rows[name] = {"bytes": size_bytes, "per_rollout": (size_bytes - empty) / len(records),
                      "load_ms": statistics.median(r["load_ms"] for r in runs[name]),
                      "paint_ms": statistics.median(r["first_paint_ms"] for r in runs[name])}
    built = statistics.median(r["rendered_ms"] for r in runs["tools/report.py"])
    return {"rows": rows, "jsonl_per_rollout": jsonl / len(records), "built_ms": built}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.problems * args.samples
    print(f"{args.problems} problems x {args.samples} samples = {n} rollouts; "
          f"medians of {args.repeats} loads each, ms from navigation start")
    print(f"{'rollouts':<9}{'page':<13}{'MB':>7}{'B/rollout':>11}{'jsonl B/r':>11}"
          f"{'load ms':>9}{'1st paint ms':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in SIZES:
            m = measure(Path(tmp), args.problems, args.samples, size, args.repeats)
            for name, r in m["rows"].items():
                print(f"{size:<9}{name:<13}{r['bytes'] / 1e6:7.2f}{r['per_rollout']:11.0f}"
                      f"{m['jsonl_per_rollout']:11.0f}{r['load_ms']:9.0f}{r['paint_ms']:14.0f}")
            a, b = m["rows"]["tools/report.py"], m["rows"]["prerendered"]
            print(f"{'':<9}prerendered / tools/report.py: size {b['bytes'] / a['bytes']:.2f}x, load "
                  f"{b['load_ms'] / a['load_ms']:.2f}x, first paint "
                  f"{b['paint_ms'] / a['paint_ms']:.2f}x; tools/report.py's page built at "
                  f"{m['built_ms']:.0f} ms")


if __name__ == "__main__":
    main()
