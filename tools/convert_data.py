"""Public math sets -> our data: RL problems as JSONL lines {"problem", "answer", "id", "source"} (data.load_problems
reads them), and SFT conversations as {"messages": [...]} with tool calls (data.load_conversations reads them).

    python -m tools.convert_data dapo data/dapo-math-17k.parquet data/dapo_math.jsonl
    python -m tools.convert_data dapo hub data/dapo_math.jsonl                   # download from the Hugging Face hub
    python -m tools.convert_data math MATH/train data/math_train.jsonl           # MATH's train split, as released
    python -m tools.convert_data math math_train.jsonl data/math_train.jsonl --all-answers
    python -m tools.convert_data tir NuminaMath-TIR/data/train-00000-of-00001.parquet data/sft_tir.jsonl

Sources:
- dapo: DAPO-Math-17k (Yu et al. 2025, arXiv 2503.14476; hub `BytedTsinghua-SIA/DAPO-Math-17k`, Apache-2.0), the
  public stand-in for the report's unreleased 42K integer-answer problems. Its parquet file repeats one block of
  17,917 rows 100 times; each row's `prompt[0].content` wraps the problem in a fixed instruction (DAPO_PREFIX,
  DAPO_SUFFIX), stripped here; the answer is `reward_model.ground_truth`, an integer. Also read: rows whose
  `prompt` is already a string (`open-r1/DAPO-Math-17k-Processed`, which rStar2-Agent's public code loads).
- math: MATH's train split (Hendrycks et al. 2021, MIT licence): the release's folder of JSON files
  (train/<subject>/<n>.json), or a JSONL/parquet copy with `problem` and `solution`. The answer is the last
  \\boxed{...} of the solution.
- tir: NuminaMath-TIR (Numina and Hugging Face 2024; hub `AI-MO/NuminaMath-TIR`, 72,441 train rows of `problem`,
  `solution`, `messages`; its card has given Apache-2.0 and CC BY-NC 4.0 at different times: check before commercial
  use), as SFT conversations in our protocol: each ```python block followed by its ```output block becomes an
  assistant turn with a tool call and the tool's reply; the text after the last one, then
  <answer>\\boxed{...}</answer> with the solution's last box, ends it. Every call is run again through our code
  tool (`CodeTool`, the settings of the --tool-* options, which should be the RL config's), and the reply is its
  `ToolResult.render()`: the text a rollout shows for that code, token for token (`ok\\n4.0\\n`, where the dataset
  recorded a notebook's bare `4.0`). Re-running rather than wrapping the recorded text: only the tool itself knows
  what it shows for a call (its status line, its echo of a last expression, its tracebacks and output cut). A
  solution is kept only when every call runs without error and prints what the dataset recorded (whitespace
  aside), so the prose after each call still describes what the tool showed.
Files: .parquet (needs `pip install pyarrow`), .jsonl, or a folder of .json files; `hub` downloads DAPO's parquet
file with huggingface_hub (installed with transformers). When the hub cannot be reached (no network, HF_HUB_OFFLINE=1)
it stops with one line: download the file elsewhere and give its path instead of `hub`.

Cleaning, each step counted in the summary line: problems are compared after collapsing whitespace; repeats of a
problem with the same answer are dropped, problems with conflicting answers are dropped entirely; answers that are
not integers are dropped unless --all-answers (the report trains on integer answers: their check is exact);
problems whose text equals one in an evaluation set (--decontaminate, by default data/{aime24,aime25,hmmt25,
math500}.jsonl) are dropped.
"""
import argparse
import json
import os
import re
import sys
from pathlib import Path

from code_tool import CodeTool
from plumbing.data import load_conversations, load_problems, write_jsonl
from protocol import TOOL_NAME

DAPO_HUB = ("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet")
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
EVAL_SETS = [str(Path(__file__).resolve().parents[1] / "data" / f"{name}.jsonl")
             for name in ("aime24", "aime25", "hmmt25", "math500")]
INTEGER = re.compile(r"[+-]?\d+")


def normalize(text: str) -> str:
    """The comparison key of a problem: whitespace runs collapsed to one space, ends stripped."""
    return " ".join(text.split())


def last_boxed(solution: str) -> str | None:
    """The contents of the last \\boxed{...} (or \\fbox{...}) in a solution, braces balanced; None if there is none."""
    start = max(solution.rfind("\\boxed{"), solution.rfind("\\fbox{"))
    if start < 0:
        return None
    i = solution.index("{", start) + 1
    depth, j = 1, i
    while j < len(solution) and depth:
        depth += {"{": 1, "}": -1}.get(solution[j], 0)
        j += 1
    return solution[i:j - 1].strip() if depth == 0 else None


def dapo_row(row: dict) -> tuple[str, str, str]:
    """(problem, answer, id) of a DAPO-Math-17k row (original or open-r1's processed layout)."""
    prompt = row["prompt"]
    text = prompt[0]["content"] if isinstance(prompt, list) else prompt
    if text.startswith(DAPO_PREFIX) and text.endswith(DAPO_SUFFIX):
        text = text[len(DAPO_PREFIX):-len(DAPO_SUFFIX)]
    answer = row["reward_model"]["ground_truth"] if "reward_model" in row else row["solution"]
    return text.strip(), str(answer).strip(), str((row.get("extra_info") or {}).get("index", ""))


def math_row(row: dict) -> tuple[str, str | None, str]:
    """(problem, answer or None, id) of a MATH row: the answer is the solution's last \\boxed{}."""
    return row["problem"].strip(), last_boxed(row["solution"]), str(row.get("id", ""))


TIR_CALL = re.compile(r"```python\n(.*?)```\s*```output\n(.*?)```", re.S)


def tir_calls(solution: str) -> tuple[list[tuple[str, str, str]], str, str] | None:
    """A NuminaMath-TIR solution cut into its calls, [(text before, code, recorded output)], the text after the last
    call and the last boxed answer; None when it has no call or no box."""
    calls, start = [], 0
    for match in TIR_CALL.finditer(solution):
        calls.append((solution[start:match.start()].strip(), match.group(1).strip(), match.group(2).strip()))
        start = match.end()
    answer = last_boxed(solution)
    return (calls, solution[start:].strip(), answer) if calls and answer is not None else None


def tir_messages(problem: str, calls, final: str, answer: str, results) -> list[dict] | None:
    """Our SFT conversation for a cut solution, each call answered by its ToolResult from our code tool (`results`,
    in call order); None when a call failed or printed other than what the dataset recorded."""
    messages = [{"role": "user", "content": problem.strip()}]
    for (text, code, recorded), result in zip(calls, results):
        if not result.ok or normalize(result.stdout) != normalize(recorded):
            return None
        messages.append({"role": "assistant", "content": f"{text}</reason>\n",
                         "tool_calls": [{"function": {"name": TOOL_NAME, "arguments": {"code": code}}}]})
        messages.append({"role": "tool", "content": result.render()})
    messages.append({"role": "assistant", "content": f"{final}</reason>\n<answer>\\boxed{{{answer}}}</answer>"})
    return messages


def convert_tir(rows: list[dict], source: str, eval_problems: set[str], tool: CodeTool):
    """SFT conversation rows from NuminaMath-TIR rows, every call run through `tool`, and the count of each thing
    dropped."""
    plans, seen = [], set()
    counts = {"rows": len(rows), "repeats": 0, "no_usable_code": 0, "tool_output_differs": 0, "in_eval_sets": 0}
    for index, row in enumerate(rows):
        key, cut = normalize(row["problem"]), tir_calls(row["solution"])
        if key in seen:
            counts["repeats"] += 1
        elif key in eval_problems:
            counts["in_eval_sets"] += 1
        elif cut is None:
            counts["no_usable_code"] += 1
        else:
            plans.append((index, row["problem"], cut))
        seen.add(key)
    results = iter(tool.run_batch([(code, "") for _, _, (calls, _, _) in plans for _, code, _ in calls]))
    out = []
    for index, problem, (calls, final, answer) in plans:
        messages = tir_messages(problem, calls, final, answer, [next(results) for _ in calls])
        if messages is None:
            counts["tool_output_differs"] += 1
        else:
            out.append({"messages": messages, "id": str(index), "source": f"{source}:{index}"})
    return out, counts


def read_rows(path: str) -> list[dict]:
    """Rows of a .parquet or .jsonl file, or of a folder of .json files (each row gets its relative path as id)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.rglob("*.json"))
        return [{**json.loads(f.read_text(encoding="utf-8")), "id": str(f.relative_to(p))} for f in files]
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"convert_data: reading {p} needs pyarrow: pip install pyarrow") from None
        return pq.read_table(p).to_pylist()
    with p.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def convert(rows: list[dict], kind: str, source: str, eval_problems: set[str], integer_only: bool):
    """Our problem rows, and the count of each thing dropped (see the module docstring)."""
    parse = dapo_row if kind == "dapo" else math_row
    answers: dict[str, set] = {}
    first: dict[str, tuple] = {}
    counts = {"rows": len(rows), "no_answer": 0, "repeats": 0, "conflicting": 0, "not_integer": 0,
              "in_eval_sets": 0}
    for index, row in enumerate(rows):
        problem, answer, row_id = parse(row)
        if not problem or not answer:
            counts["no_answer"] += 1
            continue
        key = normalize(problem)
        if key in first:
            counts["repeats"] += 1
        else:
            first[key] = (problem, answer, row_id or str(index))
        answers.setdefault(key, set()).add(answer)
    out = []
    for key, (problem, answer, row_id) in first.items():
        if len(answers[key]) > 1:
            counts["conflicting"] += 1
        elif integer_only and not INTEGER.fullmatch(answer):
            counts["not_integer"] += 1
        elif key in eval_problems:
            counts["in_eval_sets"] += 1
        else:
            out.append({"problem": problem, "answer": str(int(answer)) if INTEGER.fullmatch(answer) else answer,
                        "id": row_id, "source": f"{source}:{row_id}"})
    return out, counts


def hub_unreachable_errors() -> tuple[type, ...]:
    """What huggingface_hub raises when the hub cannot be reached: LocalEntryNotFoundError (the file's metadata could
    not be fetched, for want of a connection, under HF_HUB_OFFLINE=1 or with the hub down, and no copy is cached),
    OfflineModeIsEnabled (a request under HF_HUB_OFFLINE=1), and its HTTP client's transport errors (a connection
    lost mid-download, after its retries): httpx2 in huggingface_hub 2.x, httpx in 1.x, requests before."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled
    errors = [LocalEntryNotFoundError, OfflineModeIsEnabled]
    for module, names in (("httpx2", ["TransportError"]), ("httpx", ["TransportError"]),
                          ("requests", ["ConnectionError", "Timeout"])):
        try:
            imported = __import__(module)
        except ImportError:
            continue
        errors += [getattr(imported, name) for name in names]
    return tuple(errors)


def download_dapo(output: str) -> str:
    """The local path of DAPO-Math-17k's parquet file, downloaded from the hub (or its cache); one line saying how
    to give the file instead when the hub cannot be reached."""
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download(*DAPO_HUB, repo_type="dataset")
    except hub_unreachable_errors() as e:
        repo, file = DAPO_HUB
        offline = ", HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes",
                                                                                                "on") else ""
        raise SystemExit(f"convert_data: the Hugging Face hub could not be reached ({type(e).__name__}{offline}); "
                         f"download {file} from https://huggingface.co/datasets/{repo} and give its path: "
                         f"python -m tools.convert_data dapo {Path(file).name} {output}") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["dapo", "math", "tir"], help="which public set the input is")
    parser.add_argument("input", help="a .parquet / .jsonl file, a folder of .json files, or `hub` (dapo only)")
    parser.add_argument("output", help="the JSONL file to write")
    parser.add_argument("--all-answers", action="store_true", help="keep non-integer answers too")
    parser.add_argument("--decontaminate", nargs="*", default=EVAL_SETS,
                        help="evaluation sets whose problems are dropped (default: the four in data/)")
    tool = parser.add_argument_group("tir: the code tool that runs every call again (give the RL config's values)")
    tool.add_argument("--tool-workers", type=int, default=None, help="calls at once (default: the free cores)")
    tool.add_argument("--tool-timeout", type=float, default=4.0, help="seconds per call (the configs: 4.0)")
    tool.add_argument("--tool-memory-mb", type=int, default=1024, help="memory per call (the Qwen3 configs: 1024)")
    tool.add_argument("--tool-max-output-chars", type=int, default=1000, help="the reply's cut (the configs: 1000)")
    args = parser.parse_args(argv)
    path, source = args.input, Path(args.input).name
    if args.input == "hub":
        if args.kind != "dapo":
            raise SystemExit("convert_data: `hub` downloads DAPO-Math-17k only; give MATH as a local file or folder")
        path, source = download_dapo(args.output), DAPO_HUB[0]
    if not Path(path).exists():
        raise SystemExit(f"convert_data: {path} not found")
    try:
        eval_problems = {normalize(p["problem"]) for f in args.decontaminate for p in load_problems(f)}
    except ValueError as e:
        raise SystemExit(f"convert_data: --decontaminate: {e}") from None
    try:
        rows = read_rows(path)
        if args.kind == "tir":
            with CodeTool(workers=args.tool_workers, timeout=args.tool_timeout, memory_mb=args.tool_memory_mb,
                          max_output_chars=args.tool_max_output_chars) as tool:
                out, counts = convert_tir(rows, source, eval_problems, tool)
        else:
            out, counts = convert(rows, args.kind, source, eval_problems, integer_only=not args.all_answers)
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"convert_data: {path}: not a {args.kind} file ({type(e).__name__}: {e})") from None
    write_jsonl(args.output, out)
    if args.kind == "tir" and out:
        load_conversations(args.output)  # every conversation renders in our protocol
    noun = "conversations" if args.kind == "tir" else "problems"
    print(f"{args.output}: {len(out)} {noun} from {counts['rows']} rows; dropped "
          + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items() if k != "rows"))


if __name__ == "__main__":
    main(sys.argv[1:])
