"""bench/vs_trl.py: both sides get the same work (prompts, token ids, tool text, reward), and its code path runs for
one step per arm.

The chat template's checks need only transformers; the run and TRL's own template checks need TRL, which lives in
a venv of its own (`make trl` builds .venv-trl, `make test-trl` runs this file there). Without TRL those tests skip,
unless RSTAR2_REQUIRE_TRL=1 (CI sets it): then a missing TRL is a failure."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import vs_trl  # noqa: E402
from code_tool import CodeTool  # noqa: E402
from protocol import TOOL_NAME, format_tool_call, tool_response_turn  # noqa: E402
from tiny.model import build_tokenizer  # noqa: E402
from train import prompt_indices  # noqa: E402

try:
    import trl
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling
except ImportError as e:
    if os.environ.get("RSTAR2_REQUIRE_TRL") == "1":
        raise ImportError(f"RSTAR2_REQUIRE_TRL=1 but trl does not import: {e}") from e
    trl = None
needs_trl = pytest.mark.skipif(trl is None, reason="TRL is not installed in this Python: `make trl` builds .venv-trl "
                               "and `make test-trl` runs these tests there")
PROBLEMS = ["Compute 141+876*63.", "Compute 616*27.", "Compute 7153*5768 mod 12.", "Count n in 1..500 with n%7==3."]
# Tool texts as the model sees them: a result, a traceback, an output cut in the middle, nothing printed.
TOOL_TEXTS = ["ok\n8883\n", "error\nTraceback (most recent call last):\n  File \"<cell>\", line 2, in <module>\n"
              "    print(ans)\nNameError: name 'ans' is not defined\n", "ok\n" + "1" * 500 + "\n... [cut 1,200 chars]"
              " ...\n" + "2" * 500, "ok\n"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template, tok.response_template = vs_trl.CHAT_TEMPLATE, vs_trl.RESPONSE_TEMPLATE
    return tok


@pytest.mark.spec
def test_the_chat_template_renders_each_prompt_as_the_same_token_ids(tokenizer):
    for problem in PROBLEMS:
        ids = tokenizer.apply_chat_template(vs_trl.prompt_messages(problem), add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        assert ids == tokenizer.encode(vs_trl.FMT.prompt(problem), add_special_tokens=False)


def tool_suffix(tokenizer, text: str) -> list[int]:
    """What a trainer appends after a tool call when it takes the tool turn from the template: a conversation with
    and without the tool message, cut after the last end-of-turn of the shorter one."""
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": "print(1)", "input": ""}}}
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    short = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(head + [{"role": "tool", "name": TOOL_NAME, "content": text}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    end = max(i for i, t in enumerate(short) if t == tokenizer.eos_token_id)
    assert full[:end + 1] == short[:end + 1]
    return full[end + 1:]


@pytest.mark.spec
def test_a_tool_turn_from_the_template_is_the_rollouts_tool_response_turn(tokenizer):
    for text in TOOL_TEXTS:
        assert tool_suffix(tokenizer, text) == tokenizer.encode(tool_response_turn(text), add_special_tokens=False)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {
        "role": "assistant", "content": "<reason>Tool: 2*3.</reason>\n", "tool_calls": [{"type": "function",
        "function": {"name": TOOL_NAME, "arguments": {"code": "print(2*3)", "input": ""}}}]}], tokenize=False)
    assert rendered.endswith("<reason>Tool: 2*3.</reason>\n" + format_tool_call("print(2*3)") + "<|im_end|>\n")


@pytest.mark.spec
def test_the_dataset_holds_train_pys_prompts_in_train_pys_order():
    problems = [{"problem": f"p{i}", "answer": str(i)} for i in range(37)]
    w = vs_trl.Workload(steps=5, prompts=16)
    rows = vs_trl.ordered_rows(problems, w)
    expected = [i for step in range(5) for i in prompt_indices(step, 16, 37, 0)]
    assert [r["answer"] for r in rows] == [str(i) for i in expected]
    assert rows[0]["prompt"][1] == {"role": "user", "content": f"p{expected[0]}"}
    assert len(set(expected[:37])) == 37  # a seeded permutation per epoch, not the file's order
    assert expected[:37] != list(range(37))


@pytest.mark.spec
def test_the_reward_reads_only_the_models_own_text():
    meter = vs_trl.Meter()
    reward = vs_trl.reward_function(meter)
    call = [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": "print(6*7)"}}}]
    tool_turn = [{"role": "assistant", "content": "<reason>Tool: 6*7.</reason>", "tool_calls": call},
                 {"role": "tool", "name": TOOL_NAME, "content": "ok\n\\boxed{42}\n"}]
    completions = [tool_turn + [{"role": "assistant", "content": "</reason>\n<answer>\\boxed{42}</answer>"}],
                   tool_turn + [{"role": "assistant", "content": "</reason>\n<answer>\\boxed{41}</answer>"}],
                   tool_turn,  # the box is only in the tool's output: not the model's answer
                   [{"role": "assistant", "content": "<answer>\\boxed{42}</answer>"}]]
    assert reward(None, completions, ["42"] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert meter.current == {"reward_sum": 2.0, "rollouts": 4.0}


def test_the_tool_function_returns_the_text_a_rollout_shows_and_meters_it():
    meter = vs_trl.Meter()
    with CodeTool(workers=1, timeout=2.0, max_output_chars=1000) as tool:
        fn = vs_trl.metered_tool(tool, meter)
        assert fn.__name__ == TOOL_NAME
        assert fn("print(int(input()) * 2)", "21") == tool.run("print(int(input()) * 2)", "21").render() == "ok\n42\n"
        assert fn("1/0").startswith("error\n") and "ZeroDivisionError" in fn("1/0")
    assert meter.current["tool_calls"] == 3 and meter.current["tool_busy_s"] > 0


@pytest.mark.spec
def test_a_meter_closes_steps_at_each_boundary():
    meter = vs_trl.Meter()
    meter.add("gen_s", 1.5)
    meter.boundary()
    meter.add("gen_s", 0.5)
    meter.add("gen_s", 0.25)
    meter.boundary()
    assert [s["gen_s"] for s in meter.steps] == [1.5, 0.75] and all(s["step_s"] >= 0 for s in meter.steps)
    assert meter.current == {}


@needs_trl
def test_trl_accepts_the_template_and_parses_our_tool_calls_as_its_tool_loop_needs(tokenizer):
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    prompt = tokenizer.encode(vs_trl.FMT.prompt(PROBLEMS[0]), add_special_tokens=False)
    turn = "Tool: 141+876*63.</reason>\n" + format_tool_call("print(141+876*63)", "") + "<|im_end|>"
    parsed = parse_response(tokenizer, tokenizer.encode(turn, add_special_tokens=False), prefix=prompt)
    assert parsed["tool_calls"] == [{"type": "function", "function": {
        "name": TOOL_NAME, "arguments": {"code": "print(141+876*63)", "input": ""}}}]
    answer = "</reason>\n<answer>\\boxed{55329}</answer><|im_end|>"
    parsed = parse_response(tokenizer, tokenizer.encode(answer, add_special_tokens=False), prefix=prompt)
    assert "tool_calls" not in parsed and vs_trl.own_text([parsed]).endswith("<answer>\\boxed{55329}</answer>")
    # TRL's own suffix code (an unbound call on the attributes it reads) gives rollout.py's tool turn too.
    from trl import GRPOTrainer
    trainer = SimpleNamespace(processing_class=tokenizer, _tokenizer=tokenizer, chat_template=None, _is_vlm=False,
                              chat_template_kwargs={})
    for text in TOOL_TEXTS:
        assert (GRPOTrainer._get_tool_suffix_ids(trainer, [{"role": "tool", "name": TOOL_NAME, "content": text}])
                == tokenizer.encode(tool_response_turn(text), add_special_tokens=False))


@needs_trl
def test_one_step_of_every_arm_runs_and_is_measured(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "bench/vs_trl.py", "--quick", "--root", str(tmp_path / "tiny"),
                           "--out", str(out)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for label in vs_trl.ARMS.values():
        assert label in done.stdout
    w = vs_trl.QUICK
    data = tmp_path / "tiny" / "data"
    problems = [json.loads(line)["problem"] for line in (data / "train_level1.jsonl").read_text().splitlines()]
    tok = build_tokenizer()
    for arm in vs_trl.ARMS:
        result = json.loads((out / "round1" / arm / "result.json").read_text())
        (step,) = result["steps"]
        assert step["sampled"] > 0 and 0 < step["gen_s"] <= step["rollout_s"] < step["step_s"]
        assert step["update_s"] > 0 and step["other_s"] >= 0
        assert step["rollout_s"] + step["update_s"] + step["other_s"] == pytest.approx(step["step_s"])
        assert 0.0 <= step["reward"] <= 1.0 and result["peak_rss_mb"] > 50
        assert result["eval"]["rollouts"] == w.eval_problems * w.eval_samples
        assert 0.0 <= result["eval"]["pass@1"] <= 1.0
        if arm.startswith("trl"):  # TRL's prompt ids: train.py's prompts, in its order, 2G times each
            first = json.loads((out / "round1" / arm / "first_prompt_ids.json").read_text())
            expected = [tok.encode(vs_trl.FMT.prompt(problems[i]), add_special_tokens=False)
                        for i in prompt_indices(0, w.prompts, len(problems), w.seed) for _ in range(w.rollouts)]
            assert first == expected
        else:  # the meter's count is train.py's own (its tokens/s times its rollout seconds)
            assert step["sampled"] == pytest.approx(step["logged_tokens"])
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["rounds"][0]) == set(vs_trl.ARMS)
