"""How a tool call travels as JSON: the prompt text that lists the tools, the schema a reply
must match, OpenAI messages turned into plain ChatML turns, and a reply read back.

The embedded server uses these to render `tools` itself (the shipped model's chat template has
no tools) and to constrain the reply; the actor's JSON tool-call mode (`model.tool_calls =
"json"`) uses the same three on the client side, for endpoints that accept a JSON schema
(`response_format`) but do not turn `tools` into calls for this model, so the model reads the
same prompt on either kind of server; and training renders its examples with them, so the
fine-tuning data is what the model was shown.
"""

from __future__ import annotations

import json
from typing import Any


def tool_call_schema(tools: list[dict[str, Any]], allow_text: bool) -> dict[str, Any]:
    """JSON schema of one call to any of `tools` (plus a text reply when `allow_text`)."""
    options: list[dict[str, Any]] = []
    for t in tools:
        fn = t.get("function", t)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if allow_text:
        options.append(
            {
                "type": "object",
                "properties": {"content": {"type": "string", "maxLength": 2000}},
                "required": ["content"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def render_tools(tools: list[dict[str, Any]]) -> str:
    lines = ['You can call these functions. Reply with JSON: {"name": <function>, "arguments": {...}}.']
    for t in tools:
        fn = t.get("function", t)
        props = (fn.get("parameters") or {}).get("properties", {})
        # enum values are not listed: the grammar enforces them and they cost prompt tokens
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        lines.append(f"- {fn['name']}({args}): {fn.get('description', '')}")
    return "\n".join(lines)


def to_chatml_messages(messages: list[dict[str, Any]], tools_text: str | None) -> list[dict[str, str]]:
    """OpenAI messages -> plain role/content turns the model's ChatML template understands."""
    out: list[dict[str, str]] = []
    for m in messages:
        role = m.get("role", "user")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if role == "assistant" and m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": _loads(c["function"].get("arguments"))}
                for c in m["tool_calls"]
            ]
            content = json.dumps(calls[0] if len(calls) == 1 else calls, separators=(",", ":"))
        elif role == "tool":
            role, content = "user", f"Result: {content}"
        elif role == "developer":
            role = "system"
        out.append({"role": role, "content": str(content)})
    if tools_text:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools_text}
        else:
            out.insert(0, {"role": "system", "content": tools_text})
    return out


def read_reply(text: str) -> tuple[str, dict[str, Any]] | str | None:
    """The other way: a reply matching `tool_call_schema` as (name, arguments) for a call, or
    the text of a `{"content": ...}` reply; None for anything else (cut off, another shape)."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    if isinstance(parsed.get("name"), str) and isinstance(parsed.get("arguments", {}), dict):
        return parsed["name"], parsed.get("arguments", {})
    if isinstance(parsed.get("content"), str):
        return parsed["content"]
    return None


def read_cut_text(text: str) -> str | None:
    """The text so far of a `{"content": ...}` reply cut off by the output limit (None if the
    reply is not one): a text reply that ran out of tokens is still what the model said, not
    a fragment of JSON to show anyone."""
    head = text.lstrip()
    if not head.startswith("{"):
        return None
    tries = [head + '"}', head + "}"]  # cut inside the string, or just after it
    if head.endswith("\\"):  # cut inside an escape: what it escaped was never said
        tries.insert(0, head[:-1] + '"}')
    for attempt in tries:
        reply = read_reply(attempt)
        if isinstance(reply, str):
            return reply
    return None


def _loads(s: Any) -> Any:
    if isinstance(s, str):
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            return s
    return s or {}
