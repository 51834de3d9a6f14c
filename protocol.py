"""The chat protocol between the model and the Python tool: one place for all markup.

Implements the prompt and tool-call protocol of the rStar2-Agent report (§2) as this project reads it. SFT (`sft.py`), RL rollouts
(`rollout.py`) and evaluation (`eval.py`) all render text through this module, so the three cannot drift apart.

A conversation, as the model sees it (ChatML, the Qwen convention):

    <|im_start|>system\n{system prompt with the tool schema}<|im_end|>\n
    <|im_start|>user\n{problem}\n{instruction}<|im_end|>\n
    <|im_start|>assistant\n<reason>                         <- generation prefix, part of the prompt
    ...thinking...</reason>\n<tool_call>\n{json}\n</tool_call><|im_end|>    <- sampled by the policy
    \n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>
                                                            <- inserted by the environment (loss mask 0)
    ...thinking...</reason>\n<answer>\boxed{42}</answer><|im_end|>         <- sampled; no call: rollout ends

Rules (report §2):
- A turn ends at `<|im_end|>`. Only the FIRST `<tool_call>...</tool_call>` of a turn is executed.
- A call that is not valid JSON, names an unknown tool or has bad arguments is not an exception: `parse_tool_call`
  returns a `ToolCall` with `error` set, the rollout sends that text back as the tool response, and it counts as a
  failed call.
- The system prompt text is replaceable (config field `system_prompt`): the released checkpoint's is a preset
  (below); the tiny configs use a compact one because every character is a token there.

The choices, config fields of sft.py, train.py and eval.py alike (`CHAT_FIELDS`; `chat_format_of(cfg)` builds the
ChatFormat from them, in one place; resuming a run with other values is refused like any other config change):
- `system_prompt`: a preset of SYSTEM_PROMPTS (built for the configured tool name and arguments) or the text itself;
- `user_template`: the user turn, a preset of USER_TEMPLATES or a text with one `{problem}` slot and at most one
  `{instruction}` slot for `user_instruction` ("default": the problem, then the instruction on its own line; an
  empty instruction takes the newline that joins it with it);
- `tool_name`, `tool_required`: the tool's name (a call naming another is an "unknown tool" error) and the
  arguments its schema marks required (the schema in the system prompt shows them; the parser always needs `code`
  and reads a missing `input` as empty, as the public tool does);
- `tool_result_format`: how a ToolResult is written for the model (RESULT_FORMATS, below);
- `newline_after_turn`: the "\n" after an assistant turn's <|im_end|> (ChatML's separator), before a tool response
  and at the end of an SFT conversation; the public agent loop appends the tool response right after <|im_end|>.
Defaults are this project's format above. configs/formats/rstar2_public.yaml holds the public rStar2-Agent format
(microsoft/rStar: the chat template in rstar2_agent/config/rstar2_agent_trainer.yaml, the tool schema in
rstar2_agent/config/tool_config/python_tool_config.yaml, the result text in rstar2_agent/tools/code_judge_utils.py,
the turns as rstar2_agent/rollout/rstar2_agent_loop.py joins them): add it to any sft/train/eval command line to
evaluate the released checkpoints or train on data in that format. Not reproduced: the public executor's own error
messages (its traceback text comes from another executor) and its parse-error texts.

Tokens (`encode`, used by rollout.py for prompts and tool turns, and by sft.py for every segment): the markup above
is read with the tokenizer's control tokens (`<|im_start|>`, `<|im_end|>`, and Qwen3's `<tool_call>` and
`<tool_response>`, which are single tokens there); text from outside the protocol (`Plain`: problems, tool output,
a dataset's prose, the code inside a call) is encoded as ordinary text, so a program that prints `<|im_end|>` or
`</tool_response>` cannot end a turn or forge a tool result in the model's context. Renderers return `Rendered`
strings that remember which of their parts are Plain. In SFT targets the tags the policy writes itself (POLICY_TAGS)
are markup: their control token is what the policy samples in RL, and a sampled turn is only ever decoded, never
re-tokenized, so both decode to the same text for `parse_tool_call`.

What this module leaves out: more than one tool, parallel calls within one turn (the report executes one call per
turn), and any model-specific chat template (we never call `tokenizer.apply_chat_template`; the markup is here).
"""
import inspect
import json
import re
from dataclasses import dataclass

from plumbing.messages import message_text, message_tool_call
from plumbing.tokens import control_tokens, ordinary_ids

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_NAME = "execute_python_code_with_standard_io"
TOOL_ARGUMENTS = ("code", "input")  # the tool's arguments: the program, and the text on its standard input
# Markup strings a tokenizer may keep as single tokens (the tiny tokenizer does).
SPECIAL_TOKENS = [IM_START, IM_END, "<reason>", "</reason>", "<answer>", "</answer>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<tools>", "</tools>", TOOL_NAME]


def tool_schema(name: str = TOOL_NAME, required=("code",), descriptions=None) -> dict:
    """The tool as a JSON function schema (OpenAI's format, the one Qwen's chat templates show in <tools>).
    descriptions: (tool, code, input) texts; None: this project's."""
    tool, code, stdin = descriptions or (
        "Run a Python program in a fresh interpreter and return what it prints. The `input` string is fed to "
        "standard input. If nothing is printed and the program ends with an expression, that expression's value "
        "is shown.", "The Python source to run.", "Text for standard input (may be empty).")
    return {"type": "function", "function": {"name": name, "description": tool, "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "description": code},
                                         "input": {"type": "string", "description": stdin}},
        "required": list(required)}}}


def default_system_prompt(name: str = TOOL_NAME, required=("code",)) -> str:
    return ("You are a careful mathematician who can run Python. Think step by step inside <reason> </reason>. "
            "When a computation helps, call the tool and wait for its result before going on. "
            "Finish with the final result inside <answer> </answer>, written as \\boxed{...}.\n\n"
            "You have one tool, described as a JSON function schema:\n<tools>\n"
            + json.dumps(tool_schema(name, required)) + "\n</tools>\n\n"
            "To call it, write a JSON object with the tool's name and arguments inside tags, one call per turn:\n"
            '<tool_call>\n{"name": "' + name + '", "arguments": {"code": "print(1 + 1)", "input": ""}}\n</tool_call>\n'
            "The result comes back inside <tool_response> </tool_response>.")


def compact_system_prompt(name: str = TOOL_NAME, required=("code",)) -> str:
    """The tiny character-level model pays one token per character, so its configs use this shorter text; the
    markup, the tool name and the call format are the same as in the default."""
    return "Tool: <tools>" + name + "</tools> via <tool_call>{json}</tool_call>. Answer: <answer>\\boxed{}</answer>"


# The public rStar2-Agent format (microsoft/rStar): the system text its chat template writes when the conversation
# has no system message, and the tool schema of its tool config (the files: module docstring).
PUBLIC_TOOL_NAME = "python_code_with_standard_io"
PUBLIC_SYSTEM_TEXT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The Assistant "
    "first thinks about the reasoning process in the mind and then provides the User with the answer. The reasoning "
    "process is enclosed within <reason> </reason> and answer is enclosed within <answer> </answer> tags, "
    "respectively, i.e., <reason> reasoning process here </reason> <answer> answer here </answer>.")
PUBLIC_TOOL_DESCRIPTIONS = (
    "Execute Python code with standard input and capture standard output. This function takes a Python code string "
    "and an input string, provides the input string through standard input (stdin) to the code, and captures and "
    "returns any output produced through standard output (stdout). If the executed code raises an exception, the "
    "error message will be captured and returned instead.",
    "A string containing Python code to be executed. The code can read from standard input using the input() "
    "function.",
    "A string that will be provided as standard input to the code when it calls input().")


def rstar2_public_system_prompt(name: str = PUBLIC_TOOL_NAME, required=TOOL_ARGUMENTS) -> str:
    """The public chat template's system turn with tools: its default system text, then the Qwen-style tools block
    with the schema as JSON (the template's `tojson`: json.dumps with its default separators, non-ASCII kept)."""
    schema = tool_schema(name, required, PUBLIC_TOOL_DESCRIPTIONS)
    return (PUBLIC_SYSTEM_TEXT + "\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
            "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + json.dumps(schema, ensure_ascii=False) + "\n</tools>\n\nFor each function call, return a json object "
            "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


# Config values that name a preset instead of giving the text itself: (tool name, required arguments) -> text.
SYSTEM_PROMPTS = {"default": default_system_prompt, "compact": compact_system_prompt,
                  "rstar2_public": rstar2_public_system_prompt}
DEFAULT_SYSTEM_PROMPT = default_system_prompt()
COMPACT_SYSTEM_PROMPT = compact_system_prompt()
DEFAULT_USER_INSTRUCTION = "Put the final answer inside <answer> </answer> as \\boxed{...}."
# The user turn: `{problem}` is the problem, `{instruction}` the config's user_instruction.
USER_TEMPLATES = {
    "default": "{problem}\n{instruction}",
    # the public chat template's user turn: its instruction before the problem
    "rstar2_public": "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
                     "And your final answer will be extracted automatically by the \\boxed{} tag.\n"
                     "This is the problem:\n{problem}",
}


# Tags the policy writes in its own turns. In SFT targets they are markup (their control token, where the tokenizer
# has one); the rest of an assistant turn is Plain.
POLICY_TAGS = ("<reason>", "</reason>", "<answer>", "</answer>", "<tool_call>", "</tool_call>")


# ============================================================================ text and tokens
class Plain(str):
    """Text from outside the protocol: a problem, a tool's output, a dataset's prose, the code of a call. `encode`
    reads no control token in it: a `<|im_end|>` printed by a program stays ten characters of text."""


class Rendered(str):
    """Protocol text: the string itself (print it, compare it, decode to it) and `parts`, the markup strings and
    Plain pieces it was joined from, which `encode` reads. Made by `render`."""
    parts: tuple = ()


def render(*parts: str) -> Rendered:
    """Join markup strings, Plain text and other Rendered text (whose parts are kept) into one Rendered."""
    flat = tuple(p for part in parts for p in (part.parts if isinstance(part, Rendered) else (part,)) if p)
    out = Rendered("".join(flat))
    out.parts = flat
    return out


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of protocol text, no BOS or EOS added. Control tokens are read only in the markup: Plain text, and
    the Plain parts of a Rendered string, are encoded as ordinary text whatever they contain; any other str counts as
    markup. Where no Plain part holds a control string, the ids are exactly `tokenizer.encode(text)`'s (the text
    between two control tokens is encoded whole, across the seams of its parts)."""
    controls = control_tokens(tokenizer)
    split = re.compile("(" + "|".join(map(re.escape, sorted(controls, key=len, reverse=True))) + ")")
    parts = text.parts if isinstance(text, Rendered) else (text,)
    ids, run = [], ""  # run: the ordinary text since the last control token of the markup
    for part in parts:
        for i, piece in enumerate(split.split(part)):
            if i % 2 and not isinstance(part, Plain):
                ids += ordinary_ids(tokenizer, run, split)
                ids.append(controls[piece])
                run = ""
            else:
                run += piece
    return ids + ordinary_ids(tokenizer, run, split)


def policy_text(text: str) -> Rendered:
    """An assistant turn's text as SFT trains on it: POLICY_TAGS as markup, everything else Plain."""
    pieces = re.split("(" + "|".join(map(re.escape, POLICY_TAGS)) + ")", text)
    return render(*(piece if i % 2 else Plain(piece) for i, piece in enumerate(pieces)))


@dataclass(frozen=True)
class ToolCall:
    """What the first `<tool_call>` of a turn asked for. `error` is set when the call cannot be executed."""
    code: str = ""
    stdin: str = ""
    error: str | None = None


def format_tool_call(code: str, stdin: str = "", tool_name: str = TOOL_NAME) -> Rendered:
    """The text a policy writes to call the tool (used to render SFT data; the parser reads it back). The same
    characters as the public chat template writes for a tool call: {"name": ..., "arguments": tojson(arguments)}.
    The JSON, code included, is Plain; the tags are markup."""
    call = {"name": tool_name, "arguments": {"code": code, "input": stdin}}
    return render("<tool_call>\n", Plain(json.dumps(call, ensure_ascii=False)), "\n</tool_call>")


def parse_tool_call(turn: str, tool_name: str = TOOL_NAME) -> ToolCall | None:
    """The first tool call in one assistant turn: None if the turn has no `<tool_call>`, else a ToolCall
    whose `error` names what was wrong (never raises). A call must name `tool_name`."""
    start = turn.find("<tool_call>")
    if start < 0:
        return None
    end = turn.find("</tool_call>", start)
    if end < 0:
        return ToolCall(error="tool call error: missing </tool_call>")
    body = turn[start + len("<tool_call>"):end].strip()
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        return ToolCall(error=f"tool call error: invalid JSON ({type(e).__name__}: {str(e)[:80]})")
    if not isinstance(call, dict):
        return ToolCall(error="tool call error: expected a JSON object with name and arguments")
    if call.get("name") != tool_name:
        return ToolCall(error=f"tool call error: unknown tool {str(call.get('name'))[:60]!r}; the tool is {tool_name}")
    args = call.get("arguments")
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return ToolCall(error="tool call error: arguments is not a JSON object")
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        return ToolCall(error="tool call error: arguments must be an object with a string 'code'")
    stdin = args.get("input", "")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        return ToolCall(error="tool call error: 'input' must be a string")
    unknown = set(args) - set(TOOL_ARGUMENTS)
    if unknown:
        return ToolCall(error=f"tool call error: unknown arguments {sorted(unknown)}")
    return ToolCall(code=args["code"], stdin=stdin)


def tool_response_turn(text: str, newline: bool = True) -> Rendered:
    """Environment text appended after a turn that called the tool (loss mask 0): closes the assistant line (the
    "\n" after its <|im_end|>, unless newline=False), adds the tool result (Plain) as a user turn, and re-opens the
    assistant turn with the generation prefix."""
    return render(("\n" if newline else "") + f"{IM_START}user\n<tool_response>\n", Plain(text),
                  f"\n</tool_response>{IM_END}\n", GENERATION_PREFIX)


GENERATION_PREFIX = f"{IM_START}assistant\n<reason>"


def count_answer_blocks(text: str) -> int:
    """Number of complete `<answer>...</answer>` blocks in the model's own text (p_format uses it)."""
    return len(re.findall(r"<answer>.*?</answer>", text, flags=re.DOTALL))


# ============================================================================ the tool's result, as the model reads it
# `result`: a code_tool.ToolResult (status, stdout, stderr, elapsed, and its defaults max_chars and error_format).
ERROR_FORMATS = ("full", "last_line")  # how render_result shows a failed call's stderr


def render_result(result, max_chars: int | None = None, error_format: str | None = None) -> str:
    """Text the model sees: the status word on the first line, then stdout, then stderr, the body cut in the
    middle to max_chars. `print(2+2)` renders as "ok\\n4\\n"; a failure as "error\\n...ZeroDivisionError: x\\n".
    error_format (ERROR_FORMATS): "full" shows a failed call's stderr whole (the compact traceback); "last_line"
    only its last line, the exception ("NameError: name 'x' is not defined"), as agent setups that cut
    tracebacks to save context do. A successful call's stderr is always shown whole."""
    error_format = error_format or result.error_format
    if error_format not in ERROR_FORMATS:
        raise ValueError(f"error_format must be one of {ERROR_FORMATS}, got {error_format!r}")
    stderr = result.stderr
    if error_format == "last_line" and not result.ok:
        stderr = last_line(stderr)
    body = result.stdout
    if stderr:
        body += ("" if body.endswith("\n") or not body else "\n") + stderr
    return result.status + "\n" + cut_middle(body, result.max_chars if max_chars is None else max_chars)


def render_rstar2_public(result) -> str:
    """The text the public rStar2-Agent code shows the model (microsoft/rStar, rstar2_agent/tools/code_judge_utils.py,
    from its code-judge server's result): "Tool call success" or "Tool call failure" with the server's reason, then
    "stdout: ..." and "stderr: ..." when not empty, then "execution time: {seconds:.2f}s", one line each; a text
    longer than max_chars keeps its first and last max_chars // 2 characters around "...(truncated)..." (the public
    agent loop's middle cut, rstar2_agent/rollout/rstar2_agent_loop.py). The server's reasons here: a timeout is
    "worker_timeout", a dead worker "internal_error", any other failure "" (a non-zero exit); error_format applies
    to stderr as in render_result."""
    stderr = last_line(result.stderr) if result.error_format == "last_line" and not result.ok else result.stderr
    reason = {"timeout": "worker_timeout", "crash": "internal_error"}.get(result.status, "")
    parts = ["Tool call success"] if result.ok else ["Tool call failure", f"reason: {reason}"]
    if result.stdout:
        parts.append(f"stdout: {result.stdout}")
    if stderr:
        parts.append(f"stderr: {stderr}")
    text = "\n".join(parts + [f"execution time: {result.elapsed:.2f}s"])
    half = result.max_chars // 2
    return text if len(text) <= result.max_chars else text[:half] + "...(truncated)..." + text[-half:]


# How a ToolResult is written for the model (config field tool_result_format, ChatFormat): this project's text
# (ToolResult.render: render_result with the tool's defaults), or the public code's.
RESULT_FORMATS = {"default": lambda result: result.render(), "rstar2_public": render_rstar2_public}


def last_line(text: str) -> str:
    """The last non-blank line of text, with its newline ("" when there is none)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] + "\n" if lines else ""


def cut_middle(text: str, max_chars: int) -> str:
    """Keep the first and last max_chars/2 characters, with a marker saying how many were cut."""
    if len(text) <= max_chars:
        return text
    head, tail = max_chars // 2, len(text) - (max_chars - max_chars // 2)
    return f"{text[:head]}\n...[{len(text) - max_chars} chars cut]...\n{text[tail:]}"


@dataclass(frozen=True)
class ChatFormat:
    """The replaceable parts of the protocol (the module docstring; `chat_format` builds one from config values,
    presets resolved); the markup itself is fixed."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    user_instruction: str = DEFAULT_USER_INSTRUCTION
    user_template: str = USER_TEMPLATES["default"]  # the text, with its {problem} slot
    tool_name: str = TOOL_NAME
    tool_required: tuple[str, ...] = ("code",)
    tool_result_format: str = "default"  # a key of RESULT_FORMATS
    newline_after_turn: bool = True

    def prompt(self, problem: str) -> Rendered:
        """System turn, user turn and the generation prefix: where the policy starts writing. The problem is Plain;
        the system prompt, the template and the instruction are the protocol's own text (markup)."""
        return render(self._head(self.system_prompt, problem), GENERATION_PREFIX)

    def user_text(self, problem: str) -> Rendered:
        """The user turn's content: the template with the problem (Plain) and the instruction in their slots (an
        empty instruction takes its joining newline with it), in one pass, so neither text is read as a slot."""
        template = self.user_template
        if not self.user_instruction:
            template = re.sub(r"\n\{instruction\}|\{instruction\}\n?", "", template, count=1)
        pieces = re.split(r"\{(problem|instruction)\}", template)  # text, slot name, text, ...
        return render(*(piece if i % 2 == 0 else Plain(problem) if piece == "problem" else self.user_instruction
                        for i, piece in enumerate(pieces)))

    def parse_tool_call(self, turn: str) -> ToolCall | None:
        return parse_tool_call(turn, self.tool_name)

    def tool_response_turn(self, text: str) -> str:
        return tool_response_turn(text, self.newline_after_turn)

    def _head(self, system: str, problem: str) -> Rendered:
        return render(f"{IM_START}system\n", system, f"{IM_END}\n{IM_START}user\n", self.user_text(problem),
                      f"{IM_END}\n")

    def render_messages(self, messages: list[dict]) -> list[tuple[Rendered, bool]]:
        """A whole conversation as (text, trainable) segments whose concatenation is exactly what a rollout of the
        same conversation produces, token for token through `encode`. `trainable` is True only on text the policy writes (assistant content, its
        tool call and its `<|im_end|>`); everything else is False.

        messages: the common chat format: [{"role": "system"?, ...}, {"role": "user", "content": problem},
        then alternating {"role": "assistant", "content": text after <reason>, "tool_calls"?: [{"function":
        {"name", "arguments": {"code", "input"}}}]} and {"role": "tool", "content": tool result text}].
        Raises ValueError naming the message index on anything else."""
        msgs = list(messages)
        system = self.system_prompt
        if msgs and msgs[0].get("role") == "system":
            system = message_text(msgs.pop(0), 0)
        offset = len(messages) - len(msgs)
        if not msgs or msgs[0].get("role") != "user":
            raise ValueError(f"message {offset}: expected a user message with the problem")
        segments = [(render(self._head(system, message_text(msgs[0], offset)), GENERATION_PREFIX), False)]
        expect = "assistant"
        for i, msg in enumerate(msgs[1:], start=offset + 1):
            role = msg.get("role")
            if role != expect:
                raise ValueError(f"message {i}: expected role {expect!r}, got {role!r}")
            if role == "assistant":
                call = message_tool_call(msg, i, self.tool_name)  # (code, stdin) or None
                segments.append((render(policy_text(message_text(msg, i)),
                                        format_tool_call(*call, self.tool_name) if call else "", IM_END), True))
                expect = "tool" if msg.get("tool_calls") else "end"
            else:
                segments.append((self.tool_response_turn(message_text(msg, i)), False))
                expect = "assistant"
        if expect != "end":
            raise ValueError(f"message {len(messages) - 1}: a conversation must end with an assistant answer")
        if self.newline_after_turn:
            segments.append((render("\n"), False))
        return segments


def chat_format(system_prompt: str = "default", user_instruction: str = DEFAULT_USER_INSTRUCTION,
                user_template: str = "default", tool_name: str = TOOL_NAME, tool_required=("code",),
                tool_result_format: str = "default", newline_after_turn: bool = True) -> ChatFormat:
    """The ChatFormat for config values (the fields of the same names; module docstring). `system_prompt` and
    `user_template` are preset names (SYSTEM_PROMPTS, USER_TEMPLATES) or the text itself. Raises ValueError naming
    the field on a value that cannot work."""
    template = USER_TEMPLATES.get(user_template, user_template)
    if template.count("{problem}") != 1 or template.count("{instruction}") > 1:
        raise ValueError(f"user_template must hold {{problem}} once and {{instruction}} at most once: {template!r}")
    if user_instruction and "{instruction}" not in template:
        raise ValueError("user_instruction is set but user_template has no {instruction} slot for it "
                         "(set user_instruction to \"\")")
    if not tool_name.strip():
        raise ValueError("tool_name must not be empty")
    if "code" not in tool_required or not set(tool_required) <= set(TOOL_ARGUMENTS):
        raise ValueError(f"tool_required must name code and may name input, got {list(tool_required)}")
    if tool_result_format not in RESULT_FORMATS:
        raise ValueError(f"tool_result_format must be one of {list(RESULT_FORMATS)}, got {tool_result_format!r}")
    required = tuple(dict.fromkeys(tool_required))
    system = SYSTEM_PROMPTS[system_prompt](tool_name, required) if system_prompt in SYSTEM_PROMPTS else system_prompt
    return ChatFormat(system, user_instruction, template, tool_name, required, tool_result_format, newline_after_turn)


# The config fields every entry point (sft.py, train.py, eval.py) has, with chat_format's defaults.
CHAT_FIELDS = tuple(inspect.signature(chat_format).parameters)


def chat_format_of(cfg) -> ChatFormat:
    """The ChatFormat of an entry point's config: its CHAT_FIELDS, through `chat_format`."""
    return chat_format(**{name: getattr(cfg, name) for name in CHAT_FIELDS})


if __name__ == "__main__":
    fmt = ChatFormat()
    convo = [{"role": "user", "content": "What is 123 * 457?"},
             {"role": "assistant", "content": "Multiply with Python.</reason>\n",
              "tool_calls": [{"function": {"name": TOOL_NAME, "arguments": {"code": "print(123 * 457)"}}}]},
             {"role": "tool", "content": "56211"},
             {"role": "assistant", "content": "</reason>\n<answer>\\boxed{56211}</answer>"}]
    for text, trainable in fmt.render_messages(convo):
        print(f"--- trainable={trainable}\n{text}")
