"""An evaluation as one HTML page to read offline: the results table, every problem, every rollout's
turns and tool calls; and a page comparing two evaluations of the same benchmarks.

    python -m tools.report runs/tiny/eval_stage3          # writes runs/tiny/eval_stage3/report.html
    python -m tools.report compare runs/tiny/eval_sft runs/tiny/eval_stage3 \\
        runs/tiny/compare_sft_stage3.html             # the problems that changed, side by side
    python -m tools.report runs/tiny/stage1/rollouts/step_000040.jsonl   # a training step's rollouts

Input: an eval.py output folder: results.json and trajectories.jsonl (one `rollout.trajectory_record`
per rollout). eval.py writes the report at the end of every run. The report shows
- the results table per benchmark (pass@1 +- se, pass@k, maj@k, tool calls, tool-error rates,
  lengths) and how many rollouts each filter keeps, each count a link to those rollouts;
- every problem with its gold answer and how many samples solved it; opened, each sample: its
  turns (the reasoning as the model wrote it), each tool call's code and input, its status (ok,
  error, timeout, memory, output_limit, crash, parse_error: each its own colour, and in words) and
  the response the model saw, the extracted answer and the reward;
- filters: wrong rollouts, rollouts with a failed tool call, correct rollouts with a failed tool
  call (the positives Resample-on-Correct is least likely to train on), a call status, a number
  of turns. Links such as `report.html#b=0&show=wrong&open=first` set them.
A training step's rollouts (train.py's `save_rollouts_every`: the same records with the step, the penalty,
whether RoC kept each one, its advantage and mini-batch) make the same page, a section per step: each sample says
what the update made of it, the chips of the rollouts not trained on are faded, and two more filters show those
kept by RoC and those not trained on.
The comparison lists, per benchmark both folders hold, the problems (matched by index) whose share
of correct samples changed from A to B, largest change first, each with one sample of each side
next to each other: a wrong one against a right one.

One file, nothing fetched: style and script are inline; no fonts, images or outside links. The
rollouts are JSON in a `<script type="application/json">` block with every "<" written as \\u003c,
so no text can close the block; the script builds the page with `textContent` only (never
innerHTML), so model text and tool output are shown as text and never run. A problem's samples
are built when it is opened: opening the page costs parsing the JSON, not building every sample.
bench/report_page.py measures the size per rollout and the time to open a 200 x 4 evaluation, and
compares this with a page that holds every sample as HTML.
Left out: token ids and log-probs (trajectories.jsonl has none), text search (the browser's find
works on opened problems), and comparisons of more than two evaluations.
"""
import html
import json
import sys
from pathlib import Path

from plumbing.data import _read_jsonl
from protocol import parse_tool_call

# Keys of a trajectories.jsonl record (rollout.trajectory_record) that the page reads.
RECORD_KEYS = ("benchmark", "problem_index", "sample", "id", "problem", "answer", "pred", "reward",
               "end_reason", "response_tokens", "num_turns", "num_tool_calls",
               "num_failed_tool_calls", "turns", "tool_calls")
# Results-table columns: (results.json key, heading, format); "-" where the value is None.
COLUMNS = [("pass@1", "pass@1", "{:.3f}"), ("pass@1_se", "± se", "{:.3f}"),
           ("pass@k", "pass@k", "{:.3f}"), ("maj@k", "maj@k", "{:.3f}"),
           ("tool_calls_mean", "calls / rollout", "{:.2f}"),
           ("tool_error_rate", "tool-error rate", "{:.3f}"),
           ("tool_error_rate_in_correct", "tool-error rate in correct", "{:.3f}"),
           ("response_tokens_mean", "response tokens", "{:.0f}"),
           ("truncated_frac", "truncated", "{:.3f}")]
# Sample filters: (flag, heading in the table). A sample carries the flags of the filters it passes.
FILTERS = [("wrong", "wrong"), ("tool_error", "with a failed call"),
           ("correct_erroneous", "correct with a failed call")]
# ... and a training rollout's (train.py's save_rollouts_every): what Resample-on-Correct chose.
ROC_FILTERS = [("kept", "kept by RoC"), ("dropped", "not trained on")]
# Keys a training rollout adds to a trajectory record.
ROLLOUT_KEYS = ("step", "penalty", "kept", "advantage", "minibatch")


# ============================================================================ records -> page data
def split_turn(text: str) -> tuple[str, str, str]:
    """(text before the first <tool_call>, the call as written up to its </tool_call>, the rest).
    The middle is "" when the turn has no call; a call without </tool_call> runs to the end."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, "", ""
    end = text.find("</tool_call>", start)
    end = len(text) if end < 0 else end + len("</tool_call>")
    return text[:start], text[start:end], text[end:]


def sample_flags(correct: bool, failed_calls: int, kept: bool | None = None) -> list[str]:
    """The FILTERS a sample passes, and for a training rollout (`kept` not None) ROC_FILTERS'."""
    keep = {"wrong": not correct, "tool_error": failed_calls > 0,
            "correct_erroneous": correct and failed_calls > 0, "kept": kept is True, "dropped": kept is False}
    return [name for name, _ in FILTERS + ROC_FILTERS if keep[name]]


def roc_view(rec: dict) -> dict | None:
    """What the update made of a training rollout (rl_stage.save_rollouts): kept by RoC with its advantage and
    mini-batch, or why not; None for an evaluation's rollout."""
    if "kept" not in rec:
        return None
    return {"kept": rec["kept"], "advantage": rec["advantage"], "minibatch": rec["minibatch"],
            "penalty": rec["penalty"]}


def sample_view(rec: dict) -> dict:
    """One rollout as the page shows it: each turn with the tool call it made, and its flags.

    Turns and calls pair up as in the rollout: a turn whose text holds a tool call made the next
    recorded call. A call in the last allowed turn (end "max_turns") never ran and has no record,
    nor has one cut off by the length budget: for those, and for calls that did not parse, the
    call as the model wrote it is kept (call_text)."""
    calls = iter(rec["tool_calls"])
    turns = []
    for text in rec["turns"]:
        before, call_text, after = split_turn(text)
        call = next(calls, None) if parse_tool_call(text) is not None else None
        turn = {"text": before, "after": after}
        if call is not None:
            turn["call"] = call
        if call_text and (call is None or call["status"] == "parse_error"):
            turn["call_text"] = call_text
        turns.append(turn)
    failed = rec["num_failed_tool_calls"]
    return {"sample": rec["sample"], "reward": rec["reward"], "pred": rec["pred"],
            "end": rec["end_reason"], "tokens": rec["response_tokens"],
            "calls": rec["num_tool_calls"], "failed": failed, "turns": turns,
            "statuses": sorted({c["status"] for c in rec["tool_calls"]}),
            "flags": sample_flags(rec["reward"] == 1, failed, rec.get("kept")), "roc": roc_view(rec)}


def problem_views(records: list[dict]) -> dict[str, list[dict]]:
    """Records grouped by benchmark (first-seen order), then problem (index order), then sample."""
    benches: dict[str, dict[int, dict]] = {}
    for rec in records:
        problems = benches.setdefault(rec["benchmark"], {})
        new = {"index": rec["problem_index"], "id": rec["id"], "problem": rec["problem"],
               "answer": rec["answer"], "samples": []}
        problems.setdefault(rec["problem_index"], new)["samples"].append(sample_view(rec))
    views = {}
    for name, problems in benches.items():
        views[name] = [problems[i] for i in sorted(problems)]
        for p in views[name]:
            p["samples"].sort(key=lambda s: s["sample"])
            p["correct"] = sum(s["reward"] == 1 for s in p["samples"])
    return views


def flag_counts(problems: list[dict]) -> dict[str, int]:
    """How many samples carry each filter flag (RoC's for training rollouts), and "samples": how many there are."""
    samples = [s for p in problems for s in p["samples"]]
    filters = FILTERS + (ROC_FILTERS if any(s["roc"] for s in samples) else [])
    counts = {name: sum(name in s["flags"] for s in samples) for name, _ in filters}
    return {"samples": len(samples), **counts}


def pick_sample(samples: list[dict], correct: bool) -> dict:
    """The first sample that is correct (or wrong, as asked); the first sample when none is."""
    return next((s for s in samples if (s["reward"] == 1) == correct), samples[0])


def changed_problems(a: list[dict], b: list[dict]) -> list[dict]:
    """The problems (matched by index) whose share of correct samples differs between evaluations A
    and B of one benchmark, largest change first (a gain before a loss of the same size), each
    with a sample of each side: for a gain a wrong one of A and a right one of B, for a loss the
    other way round. ValueError when a matched problem has another text or answer."""
    by_index = {p["index"]: p for p in b}
    rows = []
    for pa in a:
        pb = by_index.get(pa["index"])
        if pb is None:
            continue
        if (pa["problem"], pa["answer"]) != (pb["problem"], pb["answer"]):
            raise ValueError(f"problem {pa['index']} differs between the two evaluations")
        # delta = c_B / k_B - c_A / k_A: the change in the problem's accuracy
        delta = pb["correct"] / len(pb["samples"]) - pa["correct"] / len(pa["samples"])
        if delta == 0:
            continue
        rows.append({"index": pa["index"], "id": pa["id"], "problem": pa["problem"],
                     "answer": pa["answer"], "delta": delta,
                     "flags": ["better" if delta > 0 else "worse"],
                     "correct": [pa["correct"], pb["correct"]],
                     "k": [len(pa["samples"]), len(pb["samples"])],
                     "samples": [pick_sample(pa["samples"], delta < 0),
                                 pick_sample(pb["samples"], delta > 0)]})
    return sorted(rows, key=lambda r: (-abs(r["delta"]), -r["delta"], r["index"]))


# ============================================================================ HTML
def fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def results_table(results: dict, counts: dict[str, dict]) -> str:
    """One row per benchmark; the filters' counts link to their rollouts (#b=I&show=FLAG)."""
    e = html.escape
    filters = FILTERS + (ROC_FILTERS if any("kept" in c for c in counts.values()) else [])
    headings = [h for _, h, _ in COLUMNS] + [h for _, h in filters]
    head = "".join(f"<th>{e(h)}</th>" for h in headings)
    rows = []
    for i, (name, m) in enumerate(results.items()):
        cells = "".join(f"<td>{fmt(m.get(key), spec)}</td>" for key, _, spec in COLUMNS)
        c = counts.get(name, {})
        links = "".join(f'<td><a href="#b={i}&amp;show={flag}">{c.get(flag, 0)}</a></td>'
                        for flag, _ in filters)
        rows.append(f'<tr><td><a href="#b={i}">{e(name)}</a></td>'
                    f"<td>{m['problems']} × {m['samples']}</td>{cells}{links}</tr>")
    return (f'<table class="results"><tr><th>benchmark</th><th>problems × samples</th>{head}</tr>'
            + "".join(rows) + "</table>")


def compare_table(results_a: dict, results_b: dict, labels: list[str],
                  changed: dict[str, list[dict]]) -> str:
    """Per common benchmark: pass@1 of A and B, and how many problems got better or worse."""
    e = html.escape
    rows = []
    for i, (name, rows_changed) in enumerate(changed.items()):
        better = sum(r["delta"] > 0 for r in rows_changed)
        worse = len(rows_changed) - better
        a, b = results_a[name]["pass@1"], results_b[name]["pass@1"]
        rows.append(f'<tr><td><a href="#b={i}">{e(name)}</a></td><td>{a:.3f}</td>'
                    f"<td>{b:.3f}</td><td>{b - a:+.3f}</td>"
                    f'<td><a href="#b={i}&amp;show=better">{better}</a></td>'
                    f'<td><a href="#b={i}&amp;show=worse">{worse}</a></td></tr>')
    return (f'<table class="results"><tr><th>benchmark</th><th>pass@1 {e(labels[0])}</th>'
            f"<th>pass@1 {e(labels[1])}</th><th>change</th><th>problems better</th>"
            f"<th>problems worse</th></tr>" + "".join(rows) + "</table>")


def embed_json(data) -> str:
    """JSON for a <script type="application/json"> block: "<" becomes \\u003c, which JSON.parse
    reads back as "<", so no string in it can close the block, whatever it holds."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def page(title: str, header: str, data: dict) -> str:
    """The HTML document: the title (escaped here), the header (HTML), data, style and script."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n<body>"
            f'<h1>{html.escape(title)}</h1>{header}<div id="main"></div>\n'
            f'<script type="application/json" id="data">{embed_json(data)}</script>\n'
            f"<script>{SCRIPT}</script></body></html>\n")


def render_report(results: dict, records: list[dict], title: str, note: str = "") -> str:
    """The report of one evaluation from results.json's "benchmarks" and trajectories.jsonl's
    records; `note` is a line under the title (the model's path)."""
    views = problem_views(records)
    counts = {name: flag_counts(problems) for name, problems in views.items()}
    names = list(results) + [n for n in views if n not in results]
    benchmarks = [{"name": n, "problems": views.get(n, [])} for n in names]
    header = f'<p class="note">{html.escape(note)}</p>' if note else ""
    return page(title, header + results_table(results, counts),
                {"kind": "report", "benchmarks": benchmarks})


def render_compare(a: tuple[dict, list[dict]], b: tuple[dict, list[dict]],
                   labels: list[str]) -> str:
    """The comparison of evaluations A and B, each (results.json's "benchmarks", records), over the
    benchmarks both hold; ValueError when they share none."""
    views_a, views_b = problem_views(a[1]), problem_views(b[1])
    names = [n for n in a[0] if n in b[0] and n in views_a and n in views_b]
    if not names:
        raise ValueError(f"the two evaluations share no benchmark ({', '.join(a[0])} vs "
                         f"{', '.join(b[0])})")
    changed = {n: changed_problems(views_a[n], views_b[n]) for n in names}
    benchmarks = [{"name": n, "problems": rows} for n, rows in changed.items()]
    return page(f"{labels[0]} vs {labels[1]}: problems that changed",
                compare_table(a[0], b[0], labels, changed),
                {"kind": "compare", "labels": labels, "benchmarks": benchmarks})


# ============================================================================ files, command line
def load_eval(folder) -> tuple[dict, list[dict], str]:
    """(results.json's "benchmarks", trajectories.jsonl's records, the model's path) of an eval.py
    folder; ValueError names the file, line and key that are wrong."""
    folder = Path(folder)
    results_path = folder / "results.json"
    if not results_path.is_file():
        raise ValueError(f"{results_path}: not found (is {folder} an eval.py out_dir?)")
    try:
        doc = json.loads(results_path.read_text(encoding="utf-8"))
        results = doc["benchmarks"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{results_path}: expected an object with 'benchmarks' ({e})") from None
    records = []
    path = folder / "trajectories.jsonl"
    for number, rec in _read_jsonl(path):
        missing = [k for k in RECORD_KEYS if k not in rec]
        if missing:
            raise ValueError(f"{path}:{number}: missing key {missing[0]!r}")
        records.append(rec)
    return results, records, str(doc.get("model_path", ""))


def rollout_results(records: list[dict]) -> dict:
    """The results table of training rollouts, a row per step: the evaluation's columns from the records (pass@1 is
    the mean reward of the step's samples; pass@k, maj@k and the standard error are not computed)."""
    steps: dict[str, list[dict]] = {}
    for rec in records:
        steps.setdefault(rec["benchmark"], []).append(rec)
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    results = {}
    for name, recs in steps.items():
        right = [r for r in recs if r["reward"] == 1]
        calls = lambda rs: sum(r["num_tool_calls"] for r in rs)  # noqa: E731
        failed = lambda rs: sum(r["num_failed_tool_calls"] for r in rs)  # noqa: E731
        results[name] = {
            "problems": len({r["problem_index"] for r in recs}),
            "samples": max(r["sample"] for r in recs) + 1, "pass@1": mean([r["reward"] for r in recs]),
            "tool_calls_mean": mean([r["num_tool_calls"] for r in recs]),
            "tool_error_rate": failed(recs) / calls(recs) if calls(recs) else None,
            "tool_error_rate_in_correct": failed(right) / calls(right) if calls(right) else None,
            "response_tokens_mean": mean([r["response_tokens"] for r in recs]),
            "truncated_frac": mean([float(r["end_reason"] == "length") for r in recs])}
    return results


def load_rollouts(path) -> list[dict]:
    """The records of a training-rollout file (train.py's save_rollouts_every); ValueError names the file, line
    and key that are wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: not found")
    records = []
    for number, rec in _read_jsonl(path):
        missing = [k for k in RECORD_KEYS + ROLLOUT_KEYS if k not in rec]
        if missing:
            raise ValueError(f"{path}:{number}: missing key {missing[0]!r} (a training-rollout file has "
                             f"{', '.join(ROLLOUT_KEYS)} beside an evaluation's keys)")
        records.append(rec)
    return records


def write_rollouts_report(path) -> Path:
    """Write the page of a training-rollout file beside it (step_N.jsonl -> step_N.html)."""
    path = Path(path)
    records = load_rollouts(path)
    out = path.with_suffix(".html")
    run = path.parent.parent.name
    note = (f"run: {path.parent.parent} · every rollout of the step, 2G a prompt; RoC keeps G of each group whose "
            f"rewards differ, and the update trains on those alone")
    out.write_text(render_report(rollout_results(records), records, f"Training rollouts: {run}", note),
                   encoding="utf-8")
    return out


def write_report(folder) -> Path:
    """Write folder/report.html from the folder's results.json and trajectories.jsonl."""
    folder = Path(folder)
    results, records, model_path = load_eval(folder)
    out = folder / "report.html"
    text = render_report(results, records, f"Evaluation: {folder.name}", f"model: {model_path}")
    out.write_text(text, encoding="utf-8")
    return out


def write_compare(folder_a, folder_b, out) -> Path:
    """Write the comparison of two eval.py folders, labelled by their folder names, to `out`."""
    labels = [Path(folder_a).name, Path(folder_b).name]
    text = render_compare(load_eval(folder_a)[:2], load_eval(folder_b)[:2], labels)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


USAGE = """usage: python -m tools.report EVAL_DIR                  # writes EVAL_DIR/report.html
       python -m tools.report RUN/rollouts/step_N.jsonl       # training rollouts: writes step_N.html beside it
       python -m tools.report compare EVAL_A EVAL_B OUT.html  # the problems that changed from A to B"""


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if len(argv) == 1 and argv[0].endswith(".jsonl"):
            print(f"wrote {write_rollouts_report(argv[0])}")
        elif len(argv) == 1 and argv[0] not in ("-h", "--help", "compare"):
            print(f"wrote {write_report(argv[0])}")
        elif len(argv) == 4 and argv[0] == "compare":
            print(f"wrote {write_compare(*argv[1:])}")
        else:
            raise SystemExit(USAGE)
    except ValueError as e:
        raise SystemExit(f"report error: {e}") from None


# ======================================================================== the page: style, script
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.2em auto;max-width:1200px;padding:0 1em;
color:#222}
h1{font-size:1.3em;margin-bottom:.2em}h2{font-size:1.1em;margin-top:1.6em}.note{color:#555}
table.results{border-collapse:collapse;font-size:13px}
.results td,.results th{border:1px solid #ccc;padding:3px 7px;text-align:right}
.results td:first-child,.results th{text-align:left}
.controls{position:sticky;top:0;z-index:1;background:#f6f6f6;border:1px solid #ddd;
padding:6px 8px;margin:1em 0}
.controls label{margin-right:1em}.count{color:#555;margin-left:1em}
section,details.problem{scroll-margin-top:48px}
details.problem{border:1px solid #ddd;border-radius:4px;margin:4px 0}
details.problem>summary{cursor:pointer;padding:4px 8px}
details.problem[open]>summary{background:#f0f4fa}
.pbody{padding:6px 10px}.snippet{color:#555}.gold{font-family:monospace}.hidden{display:none}
.chip{display:inline-block;width:1.3em;text-align:center;border-radius:3px;margin-right:2px;
color:#fff;font-size:12px}
.chip.right{background:#2e7d32}.chip.wrong{background:#c62828}.chip.err{outline:2px solid #f9a825}
.sample{border-left:4px solid #c62828;margin:8px 0;padding:4px 8px;background:#fafafa}
.sample.right{border-left-color:#2e7d32}.chip.faded{opacity:.35}
.roc{font-size:12.5px;margin:2px 0 4px;padding:1px 6px;border-radius:3px;display:inline-block}
.roc.kept{background:#e3f2fd;color:#0d47a1;font-weight:600}.roc.dropped{background:#eee;color:#555}
.shead{font-size:13px;margin-bottom:4px}.meta{color:#555;margin-left:.6em}
.turn{margin:6px 0 6px 6px}.tlabel{font-size:11px;color:#777;text-transform:uppercase}
pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;padding:4px 6px;font-size:12.5px;
background:#fff;border:1px solid #e3e3e3}
.call{border:2px solid #999;border-radius:4px;margin:4px 0;padding:3px 6px}
.call pre.code{background:#f7f7ff}.call pre.resp{background:#fcfcf4}
.status{display:inline-block;padding:0 6px;border-radius:3px;color:#fff;font-weight:600;
font-size:12px}
.st-ok{border-color:#2e7d32}.status.st-ok{background:#2e7d32}
.st-error{border-color:#c62828}.status.st-error{background:#c62828}
.st-timeout{border-color:#ef6c00}.status.st-timeout{background:#ef6c00}
.st-memory{border-color:#6a1b9a}.status.st-memory{background:#6a1b9a}
.st-output_limit{border-color:#8d6e63}.status.st-output_limit{background:#8d6e63}
.st-crash{border-color:#000}.status.st-crash{background:#000}
.st-parse_error{border-color:#1565c0;border-style:dashed}.status.st-parse_error{background:#1565c0}
.st-not_run{border-color:#999;border-style:dotted}.status.st-not_run{background:#999}
.side{display:grid;grid-template-columns:1fr 1fr;gap:10px}
"""

SCRIPT = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const COMPARE = DATA.kind === "compare";
const STATE = {show: "", status: "", turns: ""};  // the filters

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);  // text, never markup
  return e;
}
function add(parent, ...children) {
  for (const c of children) if (c) parent.appendChild(c);
  return parent;
}

// ---------------------------------------------------------------- one rollout
function callBlock(call, callText) {
  const status = call ? call.status : "not_run";
  const box = add(el("div", "call st-" + status), el("span", "status st-" + status, status),
                  el("span", "meta", call ? "tool call" : "tool call, never ran"));
  if (callText) add(box, el("pre", "code", callText));
  if (call && call.code) add(box, el("pre", "code", call.code));
  if (call && call.stdin) add(box, el("div", "tlabel", "stdin"), el("pre", "code", call.stdin));
  if (call) {
    add(box, el("div", "tlabel", "response the model saw"), el("pre", "resp", call.response));
  }
  return box;
}
function turnBlock(turn, i) {
  const box = add(el("div", "turn"), el("div", "tlabel", "turn " + (i + 1)));
  if (turn.text) add(box, el("pre", "reason", turn.text));
  if (turn.call || turn.call_text) add(box, callBlock(turn.call, turn.call_text));
  if (turn.after) add(box, el("pre", "reason", turn.after));
  return box;
}
function chip(right, failed, roc) {  // a sample's outcome; outlined when a tool call failed, faded if not trained on
  const cls = "chip " + (right ? "right" : "wrong") + (failed ? " err" : "") + (roc && !roc.kept ? " faded" : "");
  const box = el("span", cls, right ? "✓" : "✗");
  box.title = (right ? "correct" : "wrong") + (failed ? ", a tool call failed" : "") +
    (roc ? (roc.kept ? ", kept by RoC" : ", not trained on") : "");
  return box;
}
function rocLine(r) {  // a training rollout: what Resample-on-Correct and the update made of it
  const what = r.kept ? "kept by RoC · advantage " + (r.advantage >= 0 ? "+" : "") + r.advantage.toFixed(3) +
    " · mini-batch " + r.minibatch : "not trained on (RoC left it out, or its group's rewards were equal)";
  return el("div", "roc " + (r.kept ? "kept" : "dropped"), what + " · penalty " + r.penalty);
}
function sampleCard(s, label) {
  const right = s.reward === 1;
  const facts = "reward " + s.reward + " · " + s.turns.length + " turns · " + s.calls +
    " calls (" + s.failed + " failed) · " + s.tokens + " tokens · ended: " + s.end;
  const name = (label ? label + ": " : "") + "sample " + s.sample + " ";
  const head = add(el("div", "shead"), el("b", null, name), chip(right, s.failed),
    el("span", null, " answer "), el("code", null, s.pred === null ? "(none)" : s.pred),
    el("span", "meta", facts));
  const card = add(el("div", "sample " + (right ? "right" : "wrong")), head);
  if (s.roc) add(card, rocLine(s.roc));
  s.turns.forEach((t, i) => add(card, turnBlock(t, i)));
  return card;
}

// ---------------------------------------------------------------- filters
function keeps(s) {
  if (STATE.show && !s.flags.includes(STATE.show)) return false;
  if (STATE.status && !s.statuses.includes(STATE.status)) return false;
  if (STATE.turns && s.turns.length !== Number(STATE.turns)) return false;
  return true;
}
function shown(p) {
  return COMPARE ? !STATE.show || p.flags.includes(STATE.show) : p.samples.some(keeps);
}
function select(name, options) {
  const box = el("select");
  box.name = name;
  for (const [value, text] of options) add(box, el("option", null, text)).lastChild.value = value;
  box.addEventListener("change", () => { STATE[name] = box.value; apply(); });
  return box;
}
function controls() {
  const bar = el("div", "controls");
  if (COMPARE) {
    const b = DATA.labels[1];
    return add(bar, el("b", null, "Show problems: "), select("show", [["", "all that changed"],
               ["better", "better in " + b], ["worse", "worse in " + b]]), el("span", "count"));
  }
  const all = DATA.benchmarks.flatMap(b => b.problems.flatMap(p => p.samples));
  const statuses = [...new Set(all.flatMap(s => s.statuses))].sort();
  const turns = [...new Set(all.map(s => s.turns.length))].sort((x, y) => x - y).map(String);
  const roc = all.some(s => s.roc) ? [["kept", "kept by RoC"], ["dropped", "not trained on"]] : [];
  return add(bar, el("b", null, "Show samples: "),
    add(el("label"), select("show", [["", "all"], ["wrong", "wrong only"],
      ["tool_error", "with a failed tool call"],
      ["correct_erroneous", "correct, with a failed call"], ...roc])),
    add(el("label", null, "call status "),
        select("status", [["", "any"], ...statuses.map(x => [x, x])])),
    add(el("label", null, "turns "), select("turns", [["", "any"], ...turns.map(x => [x, x])])),
    el("span", "count"), el("span", "meta", "· outlined: a tool call failed" +
                                           (roc.length ? " · faded: not trained on" : "")));
}

// ---------------------------------------------------------------- problems
function problemHead(p) {
  const name = "#" + p.index + (p.id === null ? "" : " (" + p.id + ")") + " ";
  return add(el("summary"), el("b", null, name));
}
function problemSummary(p) {
  const sum = problemHead(p);
  p.samples.forEach(s => add(sum, chip(s.reward === 1, s.failed, s.roc)));
  return add(sum, el("span", null, " " + p.correct + "/" + p.samples.length + " · gold "),
             el("span", "gold", p.answer), el("span", "snippet", " · " + p.problem.slice(0, 120)));
}
function compareSummary(p) {
  const [a, b] = DATA.labels;
  const change = " " + a + " " + p.correct[0] + "/" + p.k[0] + " → " +
    b + " " + p.correct[1] + "/" + p.k[1];
  const up = p.delta > 0;
  return add(problemHead(p), el("span", "chip " + (up ? "right" : "wrong"), up ? "▲" : "▼"),
             el("span", null, change + " · gold "), el("span", "gold", p.answer),
             el("span", "snippet", " · " + p.problem.slice(0, 120)));
}
function problemBody(p) {
  const body = add(el("div", "pbody"), el("div", "tlabel", "problem"), el("pre", null, p.problem),
                   el("div", "tlabel", "gold answer"), el("pre", "gold", p.answer));
  if (COMPARE) {
    const side = add(body, el("div", "side")).lastChild;
    p.samples.forEach((s, i) => add(side, add(el("div"), sampleCard(s, DATA.labels[i]))));
    return body;
  }
  const kept = p.samples.filter(keeps);
  if (kept.length < p.samples.length) {
    const note = kept.length + " of " + p.samples.length + " samples match the filters";
    add(body, el("div", "meta", note));
  }
  kept.forEach(s => add(body, sampleCard(s)));
  return body;
}
function problemItem(p) {
  const item = add(el("details", "problem"), COMPARE ? compareSummary(p) : problemSummary(p));
  item.problem = p;
  item.addEventListener("toggle", () => {  // the samples are built when the problem is opened
    if (item.open && item.children.length === 1) add(item, problemBody(p));
  });
  return item;
}
function apply() {
  const items = [...document.querySelectorAll("details.problem")];
  for (const item of items) {
    const keep = shown(item.problem);
    item.classList.toggle("hidden", !keep);
    if (item.children.length > 1) item.removeChild(item.lastChild);
    if (item.open && keep) add(item, problemBody(item.problem));
  }
  const count = items.filter(item => !item.classList.contains("hidden")).length;
  document.querySelector(".count").textContent = count + " of " + items.length + " problems shown";
}

// ---------------------------------------------------------------- links: #b=I&show=F&open=P
function follow() {
  const args = new URLSearchParams(location.hash.slice(1));
  for (const name of Object.keys(STATE)) {
    STATE[name] = args.get(name) || "";
    const box = document.querySelector("select[name=" + name + "]");
    if (box) box.value = STATE[name];
  }
  apply();
  const section = document.getElementById("b" + (args.get("b") || "0"));
  let target = args.has("b") ? section : null;
  const wanted = args.get("open");  // a problem's index, or "first": the first one shown
  const item = section && wanted && [...section.querySelectorAll("details.problem")].find(d =>
    wanted === "first" ? !d.classList.contains("hidden") : String(d.problem.index) === wanted);
  if (item) {
    item.open = true;
    target = item;
  }
  if (!target) return;
  const scroll = () => target.scrollIntoView({block: "nearest"});  // none when it is in view
  if (document.readyState === "complete") scroll();
  else window.addEventListener("load", () => setTimeout(scroll, 0));  // after the browser's own
}

function build() {
  const main = add(document.getElementById("main"), controls());
  DATA.benchmarks.forEach((b, i) => {
    const what = COMPARE ? " problems changed" : " problems";
    const section = add(el("section"), el("h2", null, b.name + ": " + b.problems.length + what));
    section.id = "b" + i;
    b.problems.forEach(p => add(section, problemItem(p)));
    add(main, section);
  });
  window.addEventListener("hashchange", follow);
  follow();
  performance.mark("report-rendered");
}
build();
"""

if __name__ == "__main__":
    main()
