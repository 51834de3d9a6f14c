"""eval.py: metrics by hand, benchmark input errors, hub names offline, unsolved_out with a scripted sampler, and a
real run of the tiny model on AIME problems."""
import itertools
import json
import math
import re
from fractions import Fraction

import pytest

import eval as ev
from code_tool import choose_sandbox
from plumbing.config import load_config
from protocol import IM_END, format_tool_call
from rollout import ToolCallRecord, Trajectory
from samplers.interface import Completion, TurnSampler
from stops import Stop
from tiny.model import build_tiny, build_tokenizer

TOK = build_tokenizer()
IM_END_ID = TOK.convert_tokens_to_ids(IM_END)


def answer_turn(answer: str) -> str:
    return f"</reason>\n<answer>\\boxed{{{answer}}}</answer>"


def fake(answer: str | None, reward: float, tokens: int = 10, calls: int = 0, failed: int = 0, end: str = "answer"):
    """A finished Trajectory with the given answer text, reward, length and tool-call outcomes."""
    text = answer_turn(answer) if answer is not None else "</reason>\nno idea"
    records = [ToolCallRecord("print(1)", "", "error\n" if i < failed else "ok\n1\n", "error" if i < failed else "ok")
               for i in range(calls)]
    return Trajectory("p", [0], response_ids=[1] * tokens, loss_mask=[1] * tokens, turns=[text], tool_calls=records,
                      end_reason=end, reward=reward)


# ------------------------------------------------------------------------------------------ pure metrics
def test_pass_at_k_hand_values_and_brute_force():
    assert ev.pass_at_k(4, 0, 1) == 0.0
    assert ev.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert ev.pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert ev.pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3)
    assert ev.pass_at_k(4, 1, 4) == 1.0
    # Reference: the fraction of k-subsets of the n samples that hold at least one correct sample.
    for n, c, k in [(6, 2, 3), (7, 3, 2), (5, 0, 5), (8, 1, 4)]:
        samples = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert ev.pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 1, 5)


def test_majority_vote_groups_ties_and_missing_answers():
    # "3" x2 against "4" x2: a tie, won by the group seen first ("3", correct).
    assert ev.majority_vote(["3", "4", "4", "3", None], [1, 0, 0, 1, 0]) == 1.0
    assert ev.majority_vote(["4", "3", "3", "4"], [0, 1, 1, 0]) == 0.0
    # None does not vote: the single "7" beats three missing answers.
    assert ev.majority_vote([None, None, "7", None], [0, 0, 1, 0]) == 1.0
    assert ev.majority_vote([None, None], [0, 0]) == 0.0
    # Equivalent answers form one group: "1/2" and "0.5" outvote "3" only with an equivalence.
    same_value = lambda a, b: Fraction(a) == Fraction(b)  # noqa: E731
    assert ev.majority_vote(["3", "1/2", "0.5"], [0, 1, 1], same_value) == 1.0
    assert ev.majority_vote(["3", "1/2", "0.5"], [0, 1, 1]) == 0.0


def test_standard_error_by_hand():
    # mean 0.5, squared deviations 0.25 + 0.25 + 0 + 0 = 0.5, / (n-1) = 1/6, sqrt / sqrt(4)
    assert ev.standard_error([1.0, 0.0, 0.5, 0.5]) == pytest.approx(math.sqrt(1 / 6) / 2)
    assert ev.standard_error([0.3]) is None


def test_summarize_fake_trajectories_by_hand():
    groups = [
        # problem 0: 2 of 4 correct; "5" x2 (wrong) ties "6" x2 (right): the group seen first, "5", wins
        [fake("5", 0, tokens=10, calls=1, failed=1), fake("6", 1, tokens=20, calls=2), fake("5", 0, tokens=30),
         fake("6", 1, tokens=40, calls=1, failed=1, end="answer")],
        # problem 1: 4 of 4 correct
        [fake("8", 1, calls=1), fake("8", 1), fake("8", 1), fake("8", 1)],
        # problem 2: 0 of 4; two truncated, one without an answer
        [fake(None, 0, tokens=50, end="length"), fake("1", 0, end="max_turns", calls=2, failed=2), fake("2", 0),
         fake("1", 0)],
    ]
    m = ev.summarize(groups)
    assert (m["problems"], m["samples"]) == (3, 4)
    assert m["pass@1"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["pass@1_se"] == pytest.approx(ev.standard_error([0.5, 1.0, 0.0]))
    assert m["pass@1_se"] == pytest.approx(math.sqrt(0.25) / math.sqrt(3))  # deviations -0.5, 0.5, 0 -> var 0.25
    assert m["pass@k"] == pytest.approx(2 / 3)  # k = n = 4: problems solved at least once
    assert m["maj@k"] == pytest.approx((0 + 1 + 0) / 3)  # problem 0: tie "5"/"6", "5" first -> wrong
    assert m["response_tokens_mean"] == pytest.approx((10 + 20 + 30 + 40 + 4 * 10 + 50 + 10 + 10 + 10) / 12)
    assert m["tool_calls_mean"] == pytest.approx(7 / 12)
    assert m["tool_error_rate"] == pytest.approx(4 / 7)
    assert m["tool_error_rate_in_correct"] == pytest.approx(1 / 4)  # correct rollouts: 4 calls, 1 failed
    assert m["truncated_frac"] == pytest.approx(2 / 12)
    assert ev.unsolved([{"problem": "a"}, {"problem": "b"}, {"problem": "c"}], groups) == [{"problem": "a"},
                                                                                          {"problem": "c"}]
    no_calls = ev.summarize([[fake("1", 1), fake("1", 0)]])
    assert no_calls["tool_error_rate"] is None and no_calls["pass@1_se"] is None


# ------------------------------------------------------------------------------------------ benchmark input
def test_bad_benchmark_line_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'answer'"):
        ev.load_benchmark(str(bad))
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n\n{"answer": "4"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: 'problem'"):
        ev.load_benchmark(str(bad))
    # The command line stops before loading any model, with the same message.
    cfg = ev.EvalConfig(model_path="no-such/model", benchmarks=[str(bad)], out_dir=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match=r"input error: .*bad.jsonl:3"):
        ev.run(cfg)


def test_unknown_benchmark_name_lists_known_names(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'aime2099'.*aime24, aime25, hmmt25, math500"):
        ev.load_benchmark("aime2099")


def test_benchmark_names_read_the_copies_shipped_in_data():
    """Names resolve offline to data/NAME.jsonl, with the counts data/SOURCES.md lists."""
    sizes = {}
    for name in ("aime24", "aime25", "hmmt25", "math500"):
        got, problems = ev.load_benchmark(name)
        assert got == name
        sizes[name] = len(problems)
    assert sizes == {"aime24": 30, "aime25": 30, "hmmt25": 30, "math500": 500}
    assert ev.load_benchmark("aime24")[1][0]["answer"] == "204"  # 2024-I-1


# ------------------------------------------------------------------------------------------ scripted sampler
class ScriptedSampler(TurnSampler):
    """A: one good call, then the right answer. B: right, right, wrong (2 of 3). C: one malformed call, then wrong."""

    def __init__(self):
        self.seen = {"B": 0}

    def reply(self, prompt: str) -> str:
        problem = next(p for p in "ABC" if f"Problem {p}." in prompt)
        called = "<tool_response>" in prompt
        if problem == "A":
            return answer_turn("12") if called else "Use Python.</reason>\n" + format_tool_call("print(3*4)")
        if problem == "B":
            self.seen["B"] += 1
            return answer_turn("7" if self.seen["B"] % 3 else "8")
        return answer_turn("0") if called else "</reason>\n<tool_call>\n{not json\n</tool_call>"

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        out = []
        for ids, budget in zip(prompts, max_new_tokens):
            full = TOK.encode(self.reply(TOK.decode(ids)), add_special_tokens=False) + [IM_END_ID]
            out.append(Completion(full[:budget], [0.0] * min(budget, len(full)), stopped=len(full) <= budget))
        return out


PROBLEMS = [{"id": "a", "problem": "Problem A.", "answer": "12", "level": 1},
            {"id": "b", "problem": "Problem B.", "answer": "7", "level": 2},
            {"id": "c", "problem": "Problem C.", "answer": "5", "level": 2}]


def test_cli_run_with_scripted_sampler_writes_results_and_exactly_the_unsolved(tmp_path, monkeypatch):
    bench = tmp_path / "train_level2.jsonl"
    bench.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    monkeypatch.setattr(ev, "load_model", lambda cfg: (ScriptedSampler(), TOK))
    monkeypatch.setattr(ev, "check_model_path", lambda path: None)  # the scripted sampler needs no model
    cfg = load_config(ev.EvalConfig, [ev.__file__.replace("eval.py", "configs/tiny/eval.yaml")],
                      [f"benchmarks=[{bench}]", "samples=3", f"out_dir={tmp_path / 'out'}", "tool_workers=1",
                       f"unsolved_out={tmp_path / 'stage3.jsonl'}", "tool_backend=subprocess"])
    results = ev.run(cfg)
    m = results["train_level2"]
    per_problem = [1.0, 2 / 3, 0.0]
    assert m["pass@1"] == pytest.approx(5 / 9)
    assert m["pass@1_se"] == pytest.approx(math.sqrt(7) / 9)  # sqrt(((4/9)^2 + (1/9)^2 + (5/9)^2) / 2) / sqrt(3)
    assert m["pass@1_se"] == pytest.approx(ev.standard_error(per_problem))
    assert m["pass@k"] == pytest.approx(2 / 3)
    assert m["maj@k"] == pytest.approx(2 / 3)
    assert m["tool_calls_mean"] == pytest.approx(6 / 9)
    assert m["tool_error_rate"] == pytest.approx(3 / 6)  # C's malformed calls
    assert m["tool_error_rate_in_correct"] == pytest.approx(0.0)  # correct rollouts: A's good calls only
    assert m["truncated_frac"] == 0.0
    # Stage-3 data: the problems solved fewer than 3 of 3 times, with every input field, in input order.
    lines = (tmp_path / "stage3.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == PROBLEMS[1:]
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["benchmarks"]["train_level2"]["pass@1"] == pytest.approx(5 / 9)
    records = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    assert [(r["problem_index"], r["sample"]) for r in records] == [(i, j) for i in range(3) for j in range(3)]
    assert [r["reward"] for r in records[:3]] == [1.0, 1.0, 1.0]
    assert records[0]["tool_calls"][0]["code"] == "print(3*4)" and records[0]["pred"] == "12"
    page = (tmp_path / "out" / "report.html").read_text()  # the page to browse them (tools/report.py)
    assert '"problem":"Problem B."' in page and "<td>3 × 3</td>" in page
    text = ev.show(tmp_path / "out" / "trajectories.jsonl", 0)
    assert "Problem A." in text and "--- tool call ok: code\nprint(3*4)" in text and "\\boxed{12}" in text
    assert "--- tool response\nok\n12" in text
    assert (tmp_path / "out" / "sandbox.txt").read_text() == choose_sandbox("subprocess").line() + "\n"  # layers too


class PublicFormatSampler(TurnSampler):
    """Calls the tool as a model trained with the public rStar2-Agent format does (its tool name, code and input),
    then answers with the number the tool printed."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        out = []
        for ids, budget in zip(prompts, max_new_tokens):
            prompt = TOK.decode(ids)
            self.prompts.append(prompt)
            printed = re.search(r"stdout: (\S+)", prompt)  # the public result text; None for any other
            turn = format_tool_call("print(int(input()) * 4)", "3", "python_code_with_standard_io")
            turn = answer_turn(printed[1] if printed else "?") if "<tool_response>" in prompt else \
                "Use Python.</reason>\n" + turn
            full = TOK.encode(turn, add_special_tokens=False) + [IM_END_ID]
            out.append(Completion(full[:budget], None, stopped=len(full) <= budget))
        return out


def test_eval_with_the_public_format_runs_and_scores_its_tool_calls(tmp_path, monkeypatch):
    """configs/formats/rstar2_public.yaml: the public tool name parses, the call runs with its stdin, the result
    comes back in the public text, right after the turn's <|im_end|>, and the answer read from it scores. The same
    calls under the default format are unknown-tool errors."""
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"problem": "Problem A.", "answer": "12"}) + "\n")
    monkeypatch.setattr(ev, "check_model_path", lambda path: None)
    configs = [ev.__file__.replace("eval.py", "configs/tiny/eval.yaml")]
    public = configs + [ev.__file__.replace("eval.py", "configs/formats/rstar2_public.yaml")]
    runs = {}
    for name, files in (("public", public), ("default", configs)):
        sampler = PublicFormatSampler()
        monkeypatch.setattr(ev, "load_model", lambda cfg: (sampler, TOK))
        cfg = load_config(ev.EvalConfig, files, [f"benchmarks=[{bench}]", "samples=2", "tool_workers=1",
                                                 f"out_dir={tmp_path / name}", "tool_backend=subprocess"])
        runs[name] = (ev.run(cfg)["bench"], sampler.prompts, [json.loads(x) for x in (
            tmp_path / name / "trajectories.jsonl").read_text().splitlines()])
    metrics, prompts, records = runs["public"]
    assert metrics["pass@1"] == 1.0 and metrics["tool_calls_mean"] == 1.0 and metrics["tool_error_rate"] == 0.0
    call = records[0]["tool_calls"][0]
    assert (call["status"], call["code"], call["stdin"]) == ("ok", "print(int(input()) * 4)", "3")
    assert call["response"].startswith("Tool call success\nstdout: 12\n\nexecution time: ")
    assert "This is the problem:\nProblem A.<|im_end|>" in prompts[0]
    assert "</tool_call><|im_end|><|im_start|>user\n<tool_response>\nTool call success" in prompts[-1]
    metrics, _, records = runs["default"]
    assert metrics["pass@1"] == 0.0 and metrics["tool_error_rate"] == 1.0
    assert records[0]["tool_calls"][0]["status"] == "parse_error"
    assert "unknown tool 'python_code_with_standard_io'" in records[0]["tool_calls"][0]["response"]


def test_vllm_sampler_is_built_with_the_config_and_a_valid_signature(tmp_path, monkeypatch):
    """vLLM is not installed here: check that load_model calls VLLMSampler with arguments its signature accepts."""
    import inspect
    from samplers import vllm_engine
    real = vllm_engine.VLLMSampler
    TOK.save_pretrained(tmp_path / "model")
    built = []
    monkeypatch.setattr(vllm_engine, "VLLMSampler", lambda *args, **kwargs: built.append((args, kwargs)) or "engine")
    cfg = ev.EvalConfig(model_path=str(tmp_path / "model"), sampler="vllm", vllm_tensor_parallel_size=2, seed=3)
    engine, tokenizer = ev.load_model(cfg)
    assert engine == "engine" and tokenizer.convert_tokens_to_ids(IM_END) == IM_END_ID
    (args, kwargs), = built
    bound = inspect.signature(real).bind(*args, **kwargs).arguments  # raises if an argument does not fit
    assert bound["model_path"] == cfg.model_path and bound["im_end_id"] == IM_END_ID
    assert (bound["tensor_parallel_size"], bound["seed"], bound["dtype"]) == (2, 3, "bfloat16")
    with pytest.raises(SystemExit, match="sampler must be hf, vllm or reference"):
        ev.run(ev.EvalConfig(model_path="m", sampler="tgi", out_dir=str(tmp_path / "out")))


# ------------------------------------------------------------------------------------------ the tiny model, for real
def test_tiny_model_on_aime_writes_results_and_trajectories(tmp_path, data_dir, capsys):
    model = build_tiny(tmp_path / "model")
    out = tmp_path / "eval"
    ev.main([str(ev.__file__).replace("eval.py", "configs/tiny/eval.yaml"), f"model_path={model}",
             f"benchmarks=[{data_dir / 'aime24.jsonl'}]", "limit=3", "samples=2", "max_response_tokens=64",
             "max_turns=3", f"out_dir={out}", "tool_workers=1"])
    printed = capsys.readouterr().out
    assert "samples: 2" in printed and "aime24" in printed and "pass@1" in printed  # config, then the table
    assert (out / "config.yaml").is_file()
    results = json.loads((out / "results.json").read_text())["benchmarks"]["aime24"]
    assert {"pass@1", "pass@1_se", "pass@k", "maj@k", "response_tokens_mean", "tool_calls_mean", "tool_error_rate",
            "tool_error_rate_in_correct", "truncated_frac", "reward_timeouts"} <= set(results)
    assert (results["problems"], results["samples"]) == (3, 2)
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2
    gold = [json.loads(line) for line in (data_dir / "aime24.jsonl").read_text().splitlines()[:3]]
    assert [r["id"] for r in records] == [g["id"] for g in gold for _ in range(2)]
    assert all(0 < r["response_tokens"] <= 64 and r["end_reason"] in ("answer", "max_turns", "length")
               for r in records)
    ev.main(["show", str(out / "trajectories.jsonl"), "5"])
    shown = capsys.readouterr().out
    assert "=== trajectory 5 | aime24 problem 2 (id 2024-I-3) sample 1" in shown and gold[2]["problem"] in shown


def test_required_isolation_refuses_the_subprocess_backend_before_any_work(tmp_path):
    import eval as ev
    with pytest.raises(SystemExit, match="config error: tool_require_isolation is set, but .* subprocess"):
        ev.main(["configs/tiny/eval.yaml", f"model_path={tmp_path / 'nope'}", f"out_dir={tmp_path / 'out'}",
                 "tool_backend=subprocess", "tool_require_isolation=true"])
    assert not (tmp_path / "out").exists()


def test_missing_model_is_an_input_error_before_any_work(tmp_path):
    import eval as ev
    bench = tmp_path / "b.jsonl"
    bench.write_text('{"problem": "Say 1.", "answer": "1"}\n')
    with pytest.raises(SystemExit, match="model_path .* is not a model folder"):
        ev.main(["configs/tiny/eval.yaml", f"model_path={tmp_path / 'nope'}", f"benchmarks=[{bench}]",
                 f"out_dir={tmp_path / 'out'}"])


# ------------------------------------------------------------------------------------------ the output folder
class CrashOn(ScriptedSampler):
    """The scripted sampler, but the process 'dies' at the first prompt of problem `problem`."""

    def __init__(self, problem: str):
        super().__init__()
        self.problem, self.prompts = problem, []

    def reply(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if self.problem and f"Problem {self.problem}." in prompt:
            raise Stop
        return super().reply(prompt)


def scripted_eval(tmp_path, monkeypatch, sampler, out="out", *overrides):
    """run() on two benchmarks (first: problem A; second: B and C) with `sampler`, 3 samples each."""
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text(json.dumps(PROBLEMS[0]) + "\n")
    second.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS[1:]))
    monkeypatch.setattr(ev, "load_model", lambda cfg: (sampler, TOK))
    monkeypatch.setattr(ev, "check_model_path", lambda path: None)
    cfg = load_config(ev.EvalConfig, [ev.__file__.replace("eval.py", "configs/tiny/eval.yaml")],
                      [f"benchmarks=[{first},{second}]", "samples=3", f"out_dir={tmp_path / out}", "tool_workers=1",
                       "model_path=scripted", *overrides])
    return ev.run(cfg)


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_input_errors_leave_a_finished_evaluation_untouched(tmp_path, monkeypatch):
    scripted_eval(tmp_path, monkeypatch, ScriptedSampler())
    before = folder_bytes(tmp_path / "out")
    cfg = ev.EvalConfig(model_path="scripted", benchmarks=[str(tmp_path / "firts.jsonl")],
                        out_dir=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match="firts.jsonl: data file not found"):
        ev.run(cfg)
    assert folder_bytes(tmp_path / "out") == before


def test_a_finished_evaluation_is_read_back_never_redone_or_overwritten_unasked(tmp_path, monkeypatch):
    results = scripted_eval(tmp_path, monkeypatch, ScriptedSampler())
    before = folder_bytes(tmp_path / "out")
    assert scripted_eval(tmp_path, monkeypatch, CrashOn("A")) == results  # nothing rolled out again
    assert folder_bytes(tmp_path / "out") == before
    with pytest.raises(SystemExit, match=r"holds another evaluation \(samples: 3 -> 2\); .*overwrite=true"):
        scripted_eval(tmp_path, monkeypatch, ScriptedSampler(), "out", "samples=2")
    assert folder_bytes(tmp_path / "out") == before
    again = scripted_eval(tmp_path, monkeypatch, ScriptedSampler(), "out", "samples=2", "overwrite=true")
    assert again["first"]["samples"] == 2
    lines = (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 2


def test_an_interrupted_evaluation_continues_with_its_unfinished_benchmarks(tmp_path, monkeypatch):
    straight = scripted_eval(tmp_path, monkeypatch, ScriptedSampler(), "straight")
    with pytest.raises(Stop):
        scripted_eval(tmp_path, monkeypatch, CrashOn("B"), "out", f"unsolved_out={tmp_path / 'unsolved.jsonl'}")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())["benchmarks"]
    assert list(saved) == ["first"]
    with (tmp_path / "out" / "trajectories.jsonl").open("a") as f:
        f.write('{"benchmark": "second", "problem_index": 0, "sample": 0, "rew')  # killed mid-append
    resumed = CrashOn("")
    results = scripted_eval(tmp_path, monkeypatch, resumed, "out", f"unsolved_out={tmp_path / 'unsolved.jsonl'}")
    assert not any("Problem A." in p for p in resumed.prompts)  # the finished benchmark is not redone

    def untimed(res):  # every metric but the wall-clock seconds each benchmark took
        return {name: {k: v for k, v in m.items() if k != "seconds"} for name, m in res.items()}
    assert untimed(results) == untimed(straight) and all(m["seconds"] > 0 for m in results.values())
    records = [json.loads(x) for x in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    assert [(r["benchmark"], r["problem_index"], r["sample"]) for r in records] == \
        [("first", 0, s) for s in range(3)] + [("second", i, s) for i in range(2) for s in range(3)]
    assert records == [json.loads(x) for x in (tmp_path / "straight" / "trajectories.jsonl").read_text().splitlines()]
    # The stage-3 data covers both benchmarks, the one finished before the interruption included.
    assert [json.loads(x) for x in (tmp_path / "unsolved.jsonl").read_text().splitlines()] == PROBLEMS[1:]


def test_unknown_tool_error_format_is_a_config_error(tmp_path):
    import eval as ev
    with pytest.raises(SystemExit, match="tool_error_format must be one of"):
        ev.main(["configs/tiny/eval.yaml", "model_path=x", "tool_error_format=short", f"out_dir={tmp_path}"])
