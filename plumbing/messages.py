"""A conversation in the common chat format, read and checked for protocol.ChatFormat.render_messages: each
message's text, and an assistant message's one tool call. Bad input raises ValueError naming the message's index."""
import json


def message_text(msg: dict, index: int) -> str:
    """The message's `content`, which must be a string."""
    content = msg.get("content")
    if not isinstance(content, str):
        raise ValueError(f"message {index}: 'content' must be a string")
    return content


def message_tool_call(msg: dict, index: int, tool_name: str) -> tuple[str, str] | None:
    """(code, stdin) of an assistant message's tool call, None when it makes none. The call is
    {"function": {"name", "arguments"}} (or the function itself), its arguments an object or its JSON text, naming
    `tool_name` with a string `code`; one call per message."""
    calls = msg.get("tool_calls") or []
    if not calls:
        return None
    if len(calls) != 1:
        raise ValueError(f"message {index}: one tool call per turn (got {len(calls)})")
    fn = calls[0].get("function", calls[0])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ValueError(f"message {index}: tool call arguments are not valid JSON") from None
    if fn.get("name") != tool_name or not isinstance(args, dict) or not isinstance(args.get("code"), str):
        raise ValueError(f"message {index}: tool call must name {tool_name} with a string 'code' argument")
    return args["code"], args.get("input", "") or ""
