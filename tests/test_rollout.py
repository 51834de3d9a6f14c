"""rollout.py and the protocol parser: masks, token bookkeeping, limits, batching, hostile tool calls, and a run
with the tiny model and the real code tool."""
import json
import random
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from samplers.hf import HFSampler
from protocol import IM_END, TOOL_NAME, chat_format, format_tool_call, parse_tool_call, tool_response_turn
from rollout import PARSE_ERROR, Trajectory, means, rollout, rollout_sums
from samplers.interface import Completion, TurnSampler
from tiny.model import build_tiny, build_tokenizer

FMT = chat_format("compact")
TOK = build_tokenizer()
IM_END_ID = TOK.convert_tokens_to_ids(IM_END)

CALL_TURN = "Multiply.</reason>\n" + format_tool_call("print(123*457)")
ANSWER_TURN = "</reason>\n<answer>\\boxed{56211}</answer>"


pytestmark = pytest.mark.usefixtures("one_torch_thread")
spec = pytest.mark.spec  # the one-minute tier (make test-fast): every test here but the two with the real code tool


# ------------------------------------------------------------------------------------------------ fakes
@dataclass
class FakeResult:
    """Shaped like code_tool.ToolResult."""
    status: str
    stdout: str

    @property
    def ok(self):
        return self.status == "ok"

    def render(self):
        return f"{self.status}\n{self.stdout}"


class FakeTool:
    """Answers each call from a table {code: (status, stdout)}; records what was submitted."""

    def __init__(self, table=None):
        self.table, self.calls = table or {}, []

    def submit(self, code, stdin=""):
        self.calls.append((code, stdin))
        future = Future()
        future.set_result(FakeResult(*self.table.get(code, ("ok", "TOOL_SAYS_56211\n"))))
        return future


class ScriptedSampler(TurnSampler):
    """Plays fixed turn texts per problem (the problem is recognised in the prompt), respecting max_new_tokens;
    every sampled token gets log-prob -0.25. Records every batch and every token id it produced."""

    def __init__(self, scripts: dict[str, list[str]]):
        self.scripts, self.turn = scripts, {}
        self.batches, self.produced = [], []

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        self.batches.append(len(prompts))
        out = []
        for ids, budget in zip(prompts, max_new_tokens):
            text = TOK.decode(ids)
            problem = next(p for p in self.scripts if p in text)
            k = self.turn.get(problem, 0)
            self.turn[problem] = k + 1
            script = self.scripts[problem]
            full = TOK.encode(script[min(k, len(script) - 1)], add_special_tokens=False) + [IM_END_ID]
            ids_out = full[:budget]
            self.produced.append(ids_out)
            out.append(Completion(ids_out, [-0.25] * len(ids_out), stopped=len(ids_out) == len(full)))
        return out


def run(scripts, tool=None, max_response_tokens=2000, max_turns=5, **kw):
    sampler = ScriptedSampler(scripts)
    trajs = rollout(list(scripts), sampler, tool or FakeTool(), TOK, FMT, max_response_tokens, max_turns, **kw)
    return trajs, sampler


def mask_runs(traj: Trajectory, value: int) -> list[list[int]]:
    """Contiguous runs of response ids whose loss mask equals `value`."""
    runs, cur = [], []
    for i, m in zip(traj.response_ids, traj.loss_mask):
        if m == value:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


# ------------------------------------------------------------------------------------------------ parser
GOOD = '<tool_call>\n{"name": "%s", "arguments": {"code": "print(1)", "input": "5"}}\n</tool_call>' % TOOL_NAME


@spec
def test_parser_reads_a_good_call_and_the_first_of_two():
    call = parse_tool_call("think</reason>\n" + GOOD + GOOD.replace("print(1)", "print(2)"))
    assert (call.code, call.stdin, call.error) == ("print(1)", "5", None)
    assert parse_tool_call("no call here</reason>\n<answer>\\boxed{1}</answer>") is None
    args_as_string = json.dumps({"name": TOOL_NAME, "arguments": json.dumps({"code": "x=1"})})
    assert parse_tool_call(f"<tool_call>{args_as_string}</tool_call>").code == "x=1"
    # what format_tool_call writes, the parser reads back exactly: quotes, backslashes, newlines, tabs, non-ASCII
    for code, stdin in [("print('a\"b')", "in"), ("s = 'x\\\\n'\nprint(s, end='\\t')", "1 2\n3\n"),
                        ("print('caf\u00e9 \u2211')", ""), ("{'a': [1, {}]}", "{}")]:
        call = parse_tool_call("Let me compute.</reason>\n" + format_tool_call(code, stdin))
        assert (call.code, call.stdin, call.error) == (code, stdin, None)


@pytest.mark.parametrize("body, words", [
    ('{"name": "%s", "arguments": {"code": "print(1)"' % TOOL_NAME, "invalid JSON"),          # bad JSON
    ('{"name": "rm_rf", "arguments": {"code": "print(1)"}}', "unknown tool"),                 # unknown tool
    ('{"name": "%s", "arguments": {"input": "1"}}' % TOOL_NAME, "string 'code'"),            # missing code
    ('{"name": "%s", "arguments": {"code": 42}}' % TOOL_NAME, "string 'code'"),              # code not a string
    ('{"name": "%s", "arguments": {"code": "1", "input": [1]}}' % TOOL_NAME, "'input'"),     # input not a string
    ('{"name": "%s", "arguments": {"code": "1", "rm": 1}}' % TOOL_NAME, "unknown arguments"),  # extra argument
    ('[1, 2]', "JSON object"),                                                                 # not an object
    ('[' * 100_000 + ']' * 100_000, "invalid JSON"),                                           # deeply nested
    ('{"name": "%s", "arguments": "not json"}' % TOOL_NAME, "arguments"),                      # args: bad string
])
@spec
def test_parser_turns_bad_calls_into_errors(body, words):
    call = parse_tool_call(f"x</reason>\n<tool_call>\n{body}\n</tool_call>")
    assert call is not None and call.error is not None and words in call.error
    assert len(call.error) < 300  # the error text the model sees stays short


@spec
def test_parser_missing_close_tag_and_huge_call():
    assert "missing </tool_call>" in parse_tool_call('<tool_call>{"name": "x"').error
    huge = format_tool_call("print(1)#" + "x" * 1_000_000)
    assert parse_tool_call(huge).code.startswith("print(1)#") and parse_tool_call(huge).error is None


# ------------------------------------------------------------------------------------------------ token bookkeeping
@spec
def test_scripted_multi_turn_rollout_matches_the_rendered_conversation_and_masks():
    (traj,), sampler = run({"Compute 123*457.": [CALL_TURN, ANSWER_TURN]})
    # The same conversation rendered by the protocol (SFT's view) ...
    messages = [{"role": "user", "content": "Compute 123*457."},
                {"role": "assistant", "content": "Multiply.</reason>\n",
                 "tool_calls": [{"function": {"name": TOOL_NAME, "arguments": {"code": "print(123*457)"}}}]},
                {"role": "tool", "content": "ok\nTOOL_SAYS_56211\n"},
                {"role": "assistant", "content": ANSWER_TURN}]
    segments = FMT.render_messages(messages)[:-1]  # the closing "\n" comes after the conversation's last <|im_end|>
    # ... equals the decoded token stream (token in, token out: nothing was re-tokenized) ...
    assert TOK.decode(traj.prompt_ids + traj.response_ids) == "".join(text for text, _ in segments)
    # ... and the mask is 1 exactly on the trainable segments, token for token.
    expected_ids, expected_mask = [], []
    for text, trainable in segments[1:]:
        ids = TOK.encode(text, add_special_tokens=False)
        expected_ids += ids
        expected_mask += [int(trainable)] * len(ids)
    assert traj.prompt_ids == TOK.encode(segments[0][0], add_special_tokens=False)
    assert (traj.response_ids, traj.loss_mask) == (expected_ids, expected_mask)
    # Every mask-1 token is one the sampler produced, in order.
    assert mask_runs(traj, 1) == sampler.produced
    assert traj.logprobs == [-0.25 if m else 0.0 for m in traj.loss_mask]
    # Only the model's own text is kept for reward extraction.
    assert traj.turns == ["Multiply.</reason>\n" + format_tool_call("print(123*457)"), ANSWER_TURN]
    assert "TOOL_SAYS" not in traj.text and "\\boxed{56211}" in traj.text
    assert (traj.num_turns, traj.num_tool_calls, traj.num_failed_tool_calls, traj.num_answer_blocks) == (2, 1, 0, 1)
    assert traj.end_reason == "answer" and not traj.truncated
    assert traj.tool_calls[0].response == "ok\nTOOL_SAYS_56211\n" and traj.tool_calls[0].ok
    record = json.loads(json.dumps(traj.to_dict()))
    assert record["num_tool_calls"] == 1 and record["text"] == traj.text and record["tool_calls"][0]["status"] == "ok"


@spec
def test_failed_calls_are_counted_and_parse_errors_never_reach_the_tool():
    bad = "Try.</reason>\n<tool_call>\n{not json}\n</tool_call>"
    slow = "Loop.</reason>\n" + format_tool_call("while True: pass")
    tool = FakeTool({"while True: pass": ("timeout", "")})
    (traj,), _ = run({"P1": [bad, slow, CALL_TURN, ANSWER_TURN]}, tool)
    assert [c.status for c in traj.tool_calls] == [PARSE_ERROR, "timeout", "ok"]
    assert traj.num_failed_tool_calls == 2 and tool.calls == [("while True: pass", ""), ("print(123*457)", "")]
    assert "invalid JSON" in TOK.decode(mask_runs(traj, 0)[0])  # the error text went back to the model
    assert traj.num_turns == 4 and traj.end_reason == "answer"


# ------------------------------------------------------------------------------------------------ limits
@spec
def test_max_turns_ends_without_running_the_last_call():
    tool = FakeTool()
    (traj,), _ = run({"P": [CALL_TURN]}, tool, max_turns=3)  # the script calls the tool forever
    assert traj.num_turns == 3 and traj.num_tool_calls == 2 and len(tool.calls) == 2
    assert traj.end_reason == "max_turns" and traj.truncated
    assert traj.response_ids[-1] == IM_END_ID  # ends on the policy's own turn, no tool text after it


@spec
def test_budget_cut_inside_a_turn():
    (traj,), sampler = run({"P": [CALL_TURN, ANSWER_TURN]}, max_response_tokens=20)
    assert traj.end_reason == "length" and len(traj.response_ids) == 20 and sum(traj.loss_mask) == 20
    assert traj.num_tool_calls == 0  # the cut turn's call (if any) is never parsed or run


@spec
def test_budget_that_cannot_hold_the_tool_response_appends_nothing():
    turn_len = len(TOK.encode(CALL_TURN, add_special_tokens=False)) + 1
    (traj,), _ = run({"P": [CALL_TURN, ANSWER_TURN]}, max_response_tokens=turn_len + 10)
    assert traj.end_reason == "length" and traj.loss_mask == [1] * turn_len  # no tool tokens appended
    assert traj.num_tool_calls == 1  # the call was made; its response did not fit
    # A budget that fits the tool text but not the answer: the answer turn is cut.
    tool_len = len(TOK.encode(tool_response_turn("ok\nTOOL_SAYS_56211\n"), add_special_tokens=False))
    budget = turn_len + tool_len + 3  # the answer turn needs more than 3 tokens
    (traj,), _ = run({"P": [CALL_TURN, ANSWER_TURN]}, max_response_tokens=budget)
    assert traj.end_reason == "length" and len(traj.response_ids) == budget and traj.num_turns == 2


# ------------------------------------------------------------------------------------------------ batching
@spec
@pytest.mark.parametrize("sync_turns", [False, True])
def test_batch_keeps_order_and_finished_rollouts_drop_out(sync_turns):
    scripts = {"Q0": [ANSWER_TURN], "Q1": [CALL_TURN, CALL_TURN, ANSWER_TURN], "Q2": [CALL_TURN, ANSWER_TURN],
               "Q3": [CALL_TURN, CALL_TURN, CALL_TURN, ANSWER_TURN]}
    trajs, sampler = run(scripts, sync_turns=sync_turns)
    assert [t.problem for t in trajs] == list(scripts)
    assert [t.num_turns for t in trajs] == [1, 3, 2, 4] and all(t.end_reason == "answer" for t in trajs)
    assert sampler.batches == [4, 3, 2, 1]  # one generation per turn, nothing regenerated
    stats = means(rollout_sums(trajs, [1.0, 0.0, 1.0, 0.0]))
    assert stats["tool_calls_mean"] == 6 / 4 and stats["turns_mean"] == 10 / 4 and stats["reward_mean"] == 0.5


class OneTokenPerStep:
    """A continuous-batching fake: each request emits its scripted turn one token per `step`; `log` records the
    step count at which each request was added and finished."""

    def __init__(self, scripts: dict[str, list[str]]):
        self.scripts, self.turn, self.clock, self.running, self.log = scripts, {}, 0, [], []

    def add(self, key, prompt, max_new_tokens, temperature=1.0, top_p=1.0, seed=None):
        problem = next(p for p in self.scripts if p in TOK.decode(prompt))
        k = self.turn[problem] = self.turn.get(problem, -1) + 1
        full = TOK.encode(self.scripts[problem][k], add_special_tokens=False) + [IM_END_ID]
        self.running.append({"key": key, "problem": problem, "ids": full[:max_new_tokens], "done": 0,
                             "stopped": len(full) <= max_new_tokens})
        self.log.append(("add", problem, self.clock))

    def has_work(self):
        return bool(self.running)

    def step(self):
        self.clock += 1
        out = []
        for r in list(self.running):
            r["done"] += 1
            if r["done"] == len(r["ids"]):
                self.running.remove(r)
                self.log.append(("finish", r["problem"], self.clock))
                out.append((r["key"], Completion(r["ids"], [-0.5] * len(r["ids"]), r["stopped"])))
        return out


@spec
@pytest.mark.parametrize("sync_turns", [False, True])
def test_a_rollout_back_from_the_tool_rejoins_while_others_generate(sync_turns):
    """Q0 calls the tool in a short first turn; Q1 writes one long turn. Continuous: Q0's second turn is added the
    step after its first ended, long before Q1 finishes. sync_turns: it waits until Q1 has finished."""
    scripts = {"Q0": [CALL_TURN, ANSWER_TURN], "Q1": ["Think. " * 40 + ANSWER_TURN]}
    sampler = OneTokenPerStep(scripts)
    trajs = rollout(list(scripts), sampler, FakeTool(), TOK, FMT, 2000, 5, sync_turns=sync_turns)
    assert [t.num_turns for t in trajs] == [2, 1] and all(t.end_reason == "answer" for t in trajs)
    when = {(event, problem): clock for event, problem, clock in sampler.log}  # the last of each kind
    first_turn = len(TOK.encode(CALL_TURN, add_special_tokens=False)) + 1
    q1_end = len(TOK.encode(scripts["Q1"][0], add_special_tokens=False)) + 1
    assert when["finish", "Q1"] == q1_end
    if sync_turns:
        assert when["add", "Q0"] == q1_end
    else:
        assert when["add", "Q0"] == first_turn < q1_end
        assert when["finish", "Q0"] == first_turn + len(TOK.encode(ANSWER_TURN, add_special_tokens=False)) + 1


@spec
def test_no_logprobs_from_the_sampler_gives_none():
    class NoLogprobs(ScriptedSampler):
        def generate(self, *a, **k):
            return [Completion(c.token_ids, None, c.stopped) for c in super().generate(*a, **k)]
    trajs = rollout(["P"], NoLogprobs({"P": [CALL_TURN, ANSWER_TURN]}), FakeTool(), TOK, FMT, 2000, 5)
    assert trajs[0].logprobs is None and trajs[0].end_reason == "answer"


# ------------------------------------------------------------------------------------------------ real pieces
@pytest.fixture(scope="module")
def code_tool():
    from code_tool import CodeTool
    with CodeTool(workers=2, timeout=4.0) as tool:
        yield tool


def test_scripted_rollout_with_the_real_code_tool(code_tool):
    fix = "Fix.</reason>\n" + format_tool_call("print(1/0)")
    (traj,), _ = run({"Compute 123*457.": [fix, CALL_TURN, ANSWER_TURN]}, code_tool)
    assert [c.status for c in traj.tool_calls] == ["error", "ok"]
    assert "ZeroDivisionError" in traj.tool_calls[0].response and "56211" in traj.tool_calls[1].response
    assert "<tool_response>\nok\n56211\n" in TOK.decode(traj.response_ids)
    assert "ZeroDivisionError" not in traj.text


def test_tiny_model_rollout_with_the_real_code_tool(tmp_path, code_tool):
    """A random tiny model rarely writes a valid call; its random text still has to keep every invariant."""
    path = build_tiny(tmp_path / "tiny", hidden=32, layers=1, heads=2)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    sampler = HFSampler(model, tok, batch_size=8)
    torch.manual_seed(0)
    problems = ["Compute 12*34."] * 6
    trajs = rollout(problems, sampler, code_tool, tok, FMT, max_response_tokens=96, max_turns=3, temperature=1.0)
    for t in trajs:
        assert t.end_reason in ("answer", "length", "max_turns") and len(t.response_ids) <= 96
        assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs)
        assert all(lp < 0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
        assert tok.decode(t.prompt_ids) == FMT.prompt("Compute 12*34.")
        # the model's turns, decoded, are exactly the mask-1 text minus each turn's closing <|im_end|>
        sampled = [tok.decode(run_) for run_ in mask_runs(t, 1)]
        assert [s.removesuffix(IM_END) for s in sampled] == t.turns
    # with a random policy and 96 tokens, some rollouts stop on <|im_end|> and some run out of budget
    assert {t.end_reason for t in trajs} >= {"length"}


class SlowTool(FakeTool):
    """Like FakeTool, but each result arrives after a random delay of up to 20 ms (a thread timer)."""

    def submit(self, code, stdin=""):
        future, done = Future(), super().submit(code, stdin)
        threading.Timer(random.uniform(0, 0.02), lambda: future.set_result(done.result())).start()
        return future


@spec
def test_sync_turns_make_the_schedule_independent_of_tool_timing():
    """With sync_turns=True, which requests are added at which step is the same whatever the tool's delays, so a
    seeded sampler sees the same batches; the rollouts are the same too."""
    scripts = {f"Q{i}": [CALL_TURN] * (i % 3) + [ANSWER_TURN] for i in range(6)}
    logs = {}
    for sync_turns in (True, False):
        for seed in (1, 2):
            random.seed(seed)
            sampler = OneTokenPerStep(scripts)
            trajs = rollout(list(scripts), sampler, SlowTool(), TOK, FMT, 2000, 5, sync_turns=sync_turns)
            logs[sync_turns, seed] = (sampler.log, [t.response_ids for t in trajs])
    assert logs[True, 1] == logs[True, 2]
    assert logs[False, 1][0] != logs[False, 2][0]  # continuous: the steps at which turns rejoin follow the tool
