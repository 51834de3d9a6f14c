"""protocol.py's replaceable parts: the user template, the tool's name and schema, the result text, the turn joins;
the public rStar2-Agent format reproduced character for character; one set of chat fields in sft, train and eval."""
import dataclasses
import inspect
import json
from pathlib import Path

import pytest

import eval as ev
import sft
import train
from plumbing import train_config
from code_tool import ToolResult
from plumbing.config import load_config
from protocol import (CHAT_FIELDS, DEFAULT_SYSTEM_PROMPT, PUBLIC_TOOL_NAME, RESULT_FORMATS, TOOL_NAME, ChatFormat,
                      chat_format, chat_format_of, format_tool_call, parse_tool_call)

pytestmark = pytest.mark.spec  # the one-minute tier: make test-fast

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = ROOT / "configs" / "formats" / "rstar2_public.yaml"

# ------------------------------------------------------------------------------ the public rendering, written out
# What the public rStar2-Agent code (microsoft/rStar) puts in front of the model for a conversation with one tool
# call. The prompt is its chat template (rstar2_agent/config/rstar2_agent_trainer.yaml, `custom_chat_template`)
# applied to the user message with the tool schema of rstar2_agent/config/tool_config/python_tool_config.yaml and
# add_generation_prompt; the model's turns follow as sampled, each ending with <|im_end|>; each tool response is the
# template applied to the tool message with add_generation_prompt, less the template's default system turn
# (rstar2_agent/rollout/rstar2_agent_loop.py: `tool_response_ids[len(self.system_prompt):]`), so it starts right
# after the <|im_end|>; the tool's text is code_judge_utils.py's "Tool call success" form.
PUBLIC_SYSTEM = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The Assistant "
    "first thinks about the reasoning process in the mind and then provides the User with the answer. The reasoning "
    "process is enclosed within <reason> </reason> and answer is enclosed within <answer> </answer> tags, "
    "respectively, i.e., <reason> reasoning process here </reason> <answer> answer here </answer>.")
PUBLIC_TOOLS = (
    '{"type": "function", "function": {"name": "python_code_with_standard_io", "description": "Execute Python code '
    'with standard input and capture standard output. This function takes a Python code string and an input string, '
    'provides the input string through standard input (stdin) to the code, and captures and returns any output '
    'produced through standard output (stdout). If the executed code raises an exception, the error message will be '
    'captured and returned instead.", "parameters": {"type": "object", "properties": {"code": {"type": "string", '
    '"description": "A string containing Python code to be executed. The code can read from standard input using the '
    'input() function."}, "input": {"type": "string", "description": "A string that will be provided as standard '
    'input to the code when it calls input()."}}, "required": ["code", "input"]}}}')
PUBLIC_CONVERSATION = (
    "<|im_start|>system\n" + PUBLIC_SYSTEM + "\n\n# Tools\n\nYou may call one or more functions to assist with the "
    "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + PUBLIC_TOOLS + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nYou must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n"
    "What is 123 * 457?<|im_end|>\n"
    "<|im_start|>assistant\n<reason>"
    "Multiply with Python.</reason>\n"
    '<tool_call>\n{"name": "python_code_with_standard_io", "arguments": {"code": "print(123 * 457)", "input": ""}}\n'
    "</tool_call><|im_end|>"
    "<|im_start|>user\n<tool_response>\nTool call success\nstdout: 56211\n\nexecution time: 0.02s\n</tool_response>"
    "<|im_end|>\n<|im_start|>assistant\n<reason>"
    "It is 56211.</reason>\n<answer>\\boxed{56211}</answer><|im_end|>")


def public_format(cls=ev.EvalConfig):
    return chat_format_of(load_config(cls, [PUBLIC]))


def test_the_public_preset_renders_the_public_codes_conversation_character_for_character():
    fmt = public_format()
    result = RESULT_FORMATS[fmt.tool_result_format](ToolResult("ok", "56211\n", "", elapsed=0.0213))
    convo = [{"role": "user", "content": "What is 123 * 457?"},
             {"role": "assistant", "content": "Multiply with Python.</reason>\n", "tool_calls": [
                 {"function": {"name": PUBLIC_TOOL_NAME, "arguments": {"code": "print(123 * 457)", "input": ""}}}]},
             {"role": "tool", "content": result},
             {"role": "assistant", "content": "It is 56211.</reason>\n<answer>\\boxed{56211}</answer>"}]
    segments = fmt.render_messages(convo)
    assert "".join(text for text, _ in segments) == PUBLIC_CONVERSATION
    assert fmt.prompt("What is 123 * 457?") == PUBLIC_CONVERSATION[:PUBLIC_CONVERSATION.index("Multiply")]
    # the trainable segments are exactly the model's turns, each through its <|im_end|>
    assert [t for t, trainable in segments if trainable] == [
        'Multiply with Python.</reason>\n<tool_call>\n{"name": "python_code_with_standard_io", "arguments": '
        '{"code": "print(123 * 457)", "input": ""}}\n</tool_call><|im_end|>',
        "It is 56211.</reason>\n<answer>\\boxed{56211}</answer><|im_end|>"]


def test_the_preset_is_the_same_format_in_sft_train_and_eval():
    assert public_format(sft.SFTConfig) == public_format(train.TrainConfig) == public_format(ev.EvalConfig)
    assert public_format() != chat_format()


def test_the_public_result_text_and_its_failure_variants():
    text = RESULT_FORMATS["rstar2_public"]
    assert text(ToolResult("ok", "4\n", "", 0.004)) == "Tool call success\nstdout: 4\n\nexecution time: 0.00s"
    assert text(ToolResult("ok", "", "", 1.0)) == "Tool call success\nexecution time: 1.00s"  # empty parts left out
    assert text(ToolResult("ok", "1\n", "warn\n", 0.5)) == "Tool call success\nstdout: 1\n\nstderr: warn\n\n" \
                                                          "execution time: 0.50s"
    assert text(ToolResult("error", "", "NameError: x\n", 0.031)) == \
        "Tool call failure\nreason: \nstderr: NameError: x\n\nexecution time: 0.03s"  # the server's empty reason
    assert text(ToolResult("timeout", "", "killed after 4 s\n", 4.0)).startswith(
        "Tool call failure\nreason: worker_timeout\n")
    assert text(ToolResult("crash", "", "", 0.0)).startswith("Tool call failure\nreason: internal_error\n")
    trace = "Traceback (most recent call last):\n  x\nZeroDivisionError: division by zero\n"
    assert "stderr: ZeroDivisionError: division by zero\n\n" in text(ToolResult("error", "", trace, 0.1,
                                                                                 error_format="last_line"))
    whole = "Tool call success\nstdout: " + "x" * 300 + "\nexecution time: 0.00s"
    cut = text(ToolResult("ok", "x" * 300, "", 0.0, max_chars=40))  # the public loop's middle cut, 20 + 20 kept
    assert cut == whole[:20] + "...(truncated)..." + whole[-20:]
    assert RESULT_FORMATS["default"](ToolResult("ok", "4\n")) == "ok\n4\n"  # this project's text, unchanged


# ------------------------------------------------------------------------------ the choices one by one
def test_the_default_format_is_todays():
    fmt = chat_format()
    assert fmt.user_text("P") == "P\nPut the final answer inside <answer> </answer> as \\boxed{...}."
    assert chat_format("compact", "").user_text("P") == "P"  # an empty instruction takes its newline with it
    assert fmt.tool_response_turn("ok\n1\n").startswith("\n<|im_start|>user\n<tool_response>\nok\n1\n")
    assert fmt.render_messages([{"role": "user", "content": "P"}, {"role": "assistant", "content": "a"}])[-1] == \
        ("\n", False)
    assert fmt.system_prompt == DEFAULT_SYSTEM_PROMPT and f'"name": "{TOOL_NAME}"' in DEFAULT_SYSTEM_PROMPT
    assert '"required": ["code"]' in DEFAULT_SYSTEM_PROMPT


def test_user_template_slots():
    before = chat_format(user_template="{instruction}\n{problem}", user_instruction="Solve:")
    assert before.user_text("1+1?") == "Solve:\n1+1?"
    assert chat_format(user_template="{instruction}\n{problem}", user_instruction="").user_text("1+1?") == "1+1?"
    assert chat_format(user_template="Q: {problem}", user_instruction="").user_text("1+1?") == "Q: 1+1?"
    # a problem or an instruction that contains a slot's name is text, not a slot
    assert before.user_text("say {instruction}") == "Solve:\nsay {instruction}"
    assert chat_format(user_instruction="{problem}").user_text("x") == "x\n{problem}"


@pytest.mark.parametrize("kw, message", [
    ({"user_template": "no slot"}, "user_template must hold {problem} once"),
    ({"user_template": "{problem} {problem}"}, "user_template must hold {problem} once"),
    ({"user_template": "rstar2_public"}, "user_instruction is set but user_template has no {instruction} slot"),
    ({"tool_name": " "}, "tool_name must not be empty"),
    ({"tool_required": ["input"]}, "tool_required must name code"),
    ({"tool_required": ["code", "stdin"]}, "tool_required must name code and may name input"),
    ({"tool_result_format": "json"}, "tool_result_format must be one of"),
])
def test_bad_chat_values_are_refused_with_the_field_named(kw, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        chat_format(**kw)


def test_the_tool_name_and_its_required_arguments():
    public_call = format_tool_call("print(2)", "", PUBLIC_TOOL_NAME)
    assert "unknown tool 'python_code_with_standard_io'" in parse_tool_call(public_call).error  # today's parser
    fmt = public_format()
    assert fmt.parse_tool_call(public_call).code == "print(2)" and fmt.parse_tool_call(public_call).error is None
    assert "unknown tool" in fmt.parse_tool_call(format_tool_call("print(2)")).error
    # a call without `input` runs with empty stdin, as the public tool reads it (parameters.get("input", ""))
    no_input = '<tool_call>\n{"name": "%s", "arguments": {"code": "print(2)"}}\n</tool_call>' % PUBLIC_TOOL_NAME
    assert fmt.parse_tool_call(no_input).stdin == "" and fmt.parse_tool_call(no_input).error is None
    schema = chat_format(tool_name="run_py", tool_required=["code", "input"])
    assert '"name": "run_py"' in schema.system_prompt and '"required": ["code", "input"]' in schema.system_prompt
    assert "<tools>run_py</tools>" in chat_format("compact", "", tool_name="run_py").system_prompt
    with pytest.raises(ValueError, match="message 1: tool call must name python_code_with_standard_io"):
        fmt.render_messages([{"role": "user", "content": "P"}, {"role": "assistant", "content": "a", "tool_calls": [
            {"function": {"name": TOOL_NAME, "arguments": {"code": "1"}}}]}, {"role": "tool", "content": "1"},
            {"role": "assistant", "content": "b"}])


def test_every_entry_point_has_the_chat_fields_with_the_same_defaults():
    defaults = {name: p.default for name, p in inspect.signature(chat_format).parameters.items()}
    for cls in (sft.SFTConfig, train.TrainConfig, ev.EvalConfig):
        fields = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                  for f in dataclasses.fields(cls)}
        for name in CHAT_FIELDS:
            value = fields[name]
            assert (list(value) if name == "tool_required" else value) == \
                   (list(defaults[name]) if name == "tool_required" else defaults[name]), (cls.__name__, name)
        assert chat_format_of(cls()) == ChatFormat()


def test_the_chat_fields_are_part_of_the_resume_identity():
    for fields in (train_config.RESUME_FREE, sft.RESUME_FREE, ev.CONTINUE_FREE):
        assert not set(CHAT_FIELDS) & set(fields)
    identity = json.dumps(dataclasses.asdict(load_config(train.TrainConfig, [PUBLIC])))
    assert '"tool_name": "python_code_with_standard_io"' in identity and '"newline_after_turn": false' in identity
