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
- The system prompt text is replaceable (config field `system_prompt`): users evaluating the released checkpoint
  paste the original one; the tiny configs use a compact one because every character is a token there.

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
import json
import re
from dataclasses import dataclass

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_NAME = "execute_python_code_with_standard_io"
# Markup strings a tokenizer may keep as single tokens (the tiny tokenizer does).
SPECIAL_TOKENS = [IM_START, IM_END, "<reason>", "</reason>", "<answer>", "</answer>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<tools>", "</tools>", TOOL_NAME]

TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run a Python program in a fresh interpreter and return what it prints. "
                       "The `input` string is fed to standard input. If nothing is printed and the program "
                       "ends with an expression, that expression's value is shown.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python source to run."},
                           "input": {"type": "string", "description": "Text for standard input (may be empty)."}},
            "required": ["code"],
        },
    },
}

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful mathematician who can run Python. Think step by step inside <reason> </reason>. "
    "When a computation helps, call the tool and wait for its result before going on. "
    "Finish with the final result inside <answer> </answer>, written as \\boxed{...}.\n\n"
    "You have one tool, described as a JSON function schema:\n<tools>\n" + json.dumps(TOOL_SCHEMA) + "\n</tools>\n\n"
    "To call it, write a JSON object with the tool's name and arguments inside tags, one call per turn:\n"
    '<tool_call>\n{"name": "' + TOOL_NAME + '", "arguments": {"code": "print(1 + 1)", "input": ""}}\n</tool_call>\n'
    "The result comes back inside <tool_response> </tool_response>."
)
DEFAULT_USER_INSTRUCTION = "Put the final answer inside <answer> </answer> as \\boxed{...}."
# The tiny character-level model pays one token per character, so its configs use this shorter text; the markup,
# the tool name and the call format are the same as in the default.
COMPACT_SYSTEM_PROMPT = ("Tool: <tools>" + TOOL_NAME + "</tools> via <tool_call>{json}</tool_call>. "
                         "Answer: <answer>\\boxed{}</answer>")
# Config values that name a preset instead of giving the text itself.
SYSTEM_PROMPTS = {"default": DEFAULT_SYSTEM_PROMPT, "compact": COMPACT_SYSTEM_PROMPT}
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


_TAG = re.compile(r"<[^<>\s]+>")


def control_tokens(tokenizer) -> dict[str, int]:
    """A tokenizer's control tokens, {text: id}: its special tokens and each added token written as a tag (`<...>`):
    ChatML's `<|im_start|>` / `<|im_end|>`, Qwen3's `<tool_call>`, `<tool_response>`, `<think>` and fill-in-the-middle
    markers (added but not special there), the tiny tokenizer's markers. Other added tokens (the tiny tokenizer's
    multi-character phrases, its one-token tool name) are pieces of ordinary text."""
    special = set(tokenizer.all_special_tokens)
    return {t: i for t, i in tokenizer.get_added_vocab().items() if t in special or _TAG.fullmatch(t)}


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
                ids += _ordinary_ids(tokenizer, run, split)
                ids.append(controls[piece])
                run = ""
            else:
                run += piece
    return ids + _ordinary_ids(tokenizer, run, split)


def _ordinary_ids(tokenizer, text: str, split: re.Pattern) -> list[int]:
    """Ordinary text: `tokenizer.encode` between control strings; each control string in it (it came from Plain
    text) goes through the tokenizer's normalizer, pre-tokenizer and model alone, which know no added tokens."""
    ids = []
    for i, piece in enumerate(split.split(text)):
        if i % 2:
            backend = tokenizer.backend_tokenizer
            piece = backend.normalizer.normalize_str(piece) if backend.normalizer else piece
            words = backend.pre_tokenizer.pre_tokenize_str(piece) if backend.pre_tokenizer else [(piece, None)]
            ids += [t.id for word, _ in words for t in backend.model.tokenize(word)]
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


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


def format_tool_call(code: str, stdin: str = "") -> Rendered:
    """The text a policy writes to call the tool (used to render SFT data; the parser reads it back). The JSON, code
    included, is Plain; the tags are markup."""
    call = {"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}}
    return render("<tool_call>\n", Plain(json.dumps(call, ensure_ascii=False)), "\n</tool_call>")


def parse_tool_call(turn: str) -> ToolCall | None:
    """The first tool call in one assistant turn: None if the turn has no `<tool_call>`, else a ToolCall
    whose `error` names what was wrong (never raises)."""
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
    if call.get("name") != TOOL_NAME:
        return ToolCall(error=f"tool call error: unknown tool {str(call.get('name'))[:60]!r}; the tool is {TOOL_NAME}")
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
    unknown = set(args) - {"code", "input"}
    if unknown:
        return ToolCall(error=f"tool call error: unknown arguments {sorted(unknown)}")
    return ToolCall(code=args["code"], stdin=stdin)


def tool_response_turn(text: str) -> Rendered:
    """Environment text appended after a turn that called the tool (loss mask 0): closes the assistant line,
    adds the tool result (Plain) as a user turn, and re-opens the assistant turn with the generation prefix."""
    return render(f"\n{IM_START}user\n<tool_response>\n", Plain(text), f"\n</tool_response>{IM_END}\n",
                  GENERATION_PREFIX)


GENERATION_PREFIX = f"{IM_START}assistant\n<reason>"


def count_answer_blocks(text: str) -> int:
    """Number of complete `<answer>...</answer>` blocks in the model's own text (p_format uses it)."""
    return len(re.findall(r"<answer>.*?</answer>", text, flags=re.DOTALL))


@dataclass(frozen=True)
class ChatFormat:
    """The replaceable texts of the protocol (config fields); the markup itself is fixed."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    user_instruction: str = DEFAULT_USER_INSTRUCTION

    def prompt(self, problem: str) -> Rendered:
        """System turn, user turn and the generation prefix: where the policy starts writing. The problem is Plain;
        the system prompt and the instruction are the protocol's own text (markup)."""
        return render(self._head(self.system_prompt, problem), GENERATION_PREFIX)

    def _head(self, system: str, problem: str) -> Rendered:
        instruction = f"\n{self.user_instruction}" if self.user_instruction else ""
        return render(f"{IM_START}system\n", system, f"{IM_END}\n{IM_START}user\n", Plain(problem), instruction,
                      f"{IM_END}\n")

    def render_messages(self, messages: list[dict]) -> list[tuple[Rendered, bool]]:
        """A whole conversation as (text, trainable) segments whose concatenation is exactly what a rollout of the
        same conversation produces, token for token through `encode`. `trainable` is True only on text the policy
        writes (assistant content, its tool call and its `<|im_end|>`); everything else is False.

        messages: the common chat format: [{"role": "system"?, ...}, {"role": "user", "content": problem},
        then alternating {"role": "assistant", "content": text after <reason>, "tool_calls"?: [{"function":
        {"name", "arguments": {"code", "input"}}}]} and {"role": "tool", "content": tool result text}].
        Raises ValueError naming the message index on anything else."""
        msgs = list(messages)
        system = self.system_prompt
        if msgs and msgs[0].get("role") == "system":
            system = _text(msgs.pop(0), 0)
        offset = len(messages) - len(msgs)
        if not msgs or msgs[0].get("role") != "user":
            raise ValueError(f"message {offset}: expected a user message with the problem")
        segments = [(render(self._head(system, _text(msgs[0], offset)), GENERATION_PREFIX), False)]
        expect = "assistant"
        for i, msg in enumerate(msgs[1:], start=offset + 1):
            role = msg.get("role")
            if role != expect:
                raise ValueError(f"message {i}: expected role {expect!r}, got {role!r}")
            if role == "assistant":
                segments.append((render(policy_text(_text(msg, i)), _assistant_call(msg, i), IM_END), True))
                expect = "tool" if msg.get("tool_calls") else "end"
            else:
                segments.append((tool_response_turn(_text(msg, i)), False))
                expect = "assistant"
        if expect != "end":
            raise ValueError(f"message {len(messages) - 1}: a conversation must end with an assistant answer")
        segments.append((render("\n"), False))
        return segments


def chat_format(system_prompt: str = "default", user_instruction: str = DEFAULT_USER_INSTRUCTION) -> ChatFormat:
    """The ChatFormat for config values: `system_prompt` is a preset name from SYSTEM_PROMPTS or the text itself."""
    return ChatFormat(SYSTEM_PROMPTS.get(system_prompt, system_prompt), user_instruction)


def _text(msg: dict, index: int) -> str:
    content = msg.get("content")
    if not isinstance(content, str):
        raise ValueError(f"message {index}: 'content' must be a string")
    return content


def _assistant_call(msg: dict, index: int) -> Rendered:
    calls = msg.get("tool_calls") or []
    if not calls:
        return render()
    if len(calls) != 1:
        raise ValueError(f"message {index}: one tool call per turn (got {len(calls)})")
    fn = calls[0].get("function", calls[0])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ValueError(f"message {index}: tool call arguments are not valid JSON") from None
    if fn.get("name") != TOOL_NAME or not isinstance(args, dict) or not isinstance(args.get("code"), str):
        raise ValueError(f"message {index}: tool call must name {TOOL_NAME} with a string 'code' argument")
    return format_tool_call(args["code"], args.get("input", "") or "")


if __name__ == "__main__":
    fmt = ChatFormat()
    convo = [{"role": "user", "content": "What is 123 * 457?"},
             {"role": "assistant", "content": "Multiply with Python.</reason>\n",
              "tool_calls": [{"function": {"name": TOOL_NAME, "arguments": {"code": "print(123 * 457)"}}}]},
             {"role": "tool", "content": "56211"},
             {"role": "assistant", "content": "</reason>\n<answer>\\boxed{56211}</answer>"}]
    for text, trainable in fmt.render_messages(convo):
        print(f"--- trainable={trainable}\n{text}")
