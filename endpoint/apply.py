"""What the intervention endpoint changes in a request: the live policy of the rollout's arm.

* skills and exemplars: their text is appended to the agent's system message (a system
  message is added first where the agent sends none), as ratchet's actor shows them;
* the tools the agent offers: the policy's rules narrow their enumerated arguments (a menu)
  and its argument constraints are written into their JSON schemas, with what the agent has
  read so far (every user and tool message) as the context a copied argument comes from;
* `model`: the policy's served model (the champion adapter by name, or the base model);
* `temperature` and `seed`: the stage's sampling (explore samples, verify and evaluate are
  greedy), so the two arms of a gate play the same seeds;
* `stream`: off towards the model; the endpoint streams the finished reply to an agent that
  asked for a stream.

Everything else the agent sent (its own prompts, messages, tool descriptions, `tool_choice`,
`max_tokens`) is passed on unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from ratchet.agents.prompts import render_exemplars, render_skills
from ratchet.endpoint.recording import Arm
from ratchet.skills.constraints import constrain_args
from ratchet.skills.rules import Tried, call_text, constrain_tools, menu_entries, normal
from ratchet.types import ToolCall, ToolSpec


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def read_so_far(messages: list[dict[str, Any]]) -> list[str]:
    """What the agent has read: the text of every user and tool message, in order."""
    return [text_of(m.get("content")) for m in messages if m.get("role") in ("user", "tool")]


def latest_observation(messages: list[dict[str, Any]]) -> str:
    """What the model acts on at this call: the user and tool messages after the last
    assistant message (all of them at the first call)."""
    tail: list[str] = []
    for m in reversed(messages):
        if m.get("role") == "assistant":
            break
        if m.get("role") in ("user", "tool"):
            tail.append(text_of(m.get("content")))
    return "\n".join(reversed(tail))


def system_addition(arm: Arm) -> str:
    """The policy's text for this rollout: its skills and exemplars ('' when it has none)."""
    p = arm.policy
    skills = p.skills if arm.skills is None else arm.skills
    exemplars = p.exemplars if arm.exemplars is None else arm.exemplars
    return "\n\n".join(x for x in (render_skills(skills), render_exemplars(exemplars)) if x)


def with_system_text(messages: list[dict[str, Any]], extra: str) -> list[dict[str, Any]]:
    if not extra:
        return messages
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") in ("system", "developer"):
            m["content"] = f"{text_of(m.get('content'))}\n\n{extra}"
            return out
    return [{"role": "system", "content": extra}, *out]


def tool_specs(tools: list[dict[str, Any]]) -> list[ToolSpec] | None:
    """The request's function tools as ToolSpecs (None if any is not a plain function tool:
    then the tools are passed on as they are)."""
    specs = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            return None
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            return None
        specs.append(ToolSpec(name=f["name"], description=str(f.get("description") or ""), parameters=params))
    return specs


def tried_before(earlier: list[tuple[str, ToolCall]]) -> list[Tried]:
    """The rollout's earlier (observation, call) pairs, as the `no_repeat` rule reads them."""
    return [Tried(normal(obs), call_text(call)) for obs, call in earlier]


def apply_policy(
    body: dict[str, Any], arm: Arm, index: int, earlier: list[tuple[str, ToolCall]]
) -> tuple[dict[str, Any], list[str], list[str] | None]:
    """The request to forward, the rules and constraints that changed its tools, and the
    menu of the tools as the agent offered them (None: no tools)."""
    p = arm.policy
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    sent = dict(body)
    sent["messages"] = with_system_text(messages, system_addition(arm))
    sent["model"] = p.served_model
    sent["temperature"] = arm.temperature
    sent["seed"] = arm.seed + index
    sent["stream"] = False
    sent.pop("stream_options", None)
    if arm.max_tokens is not None and not (body.get("max_tokens") or body.get("max_completion_tokens")):
        sent["max_tokens"] = arm.max_tokens
    fired: list[str] = []
    menu: list[str] | None = None
    tools = body.get("tools")
    specs = tool_specs(tools) if isinstance(tools, list) and tools else None
    if specs:
        menu = menu_entries(specs)
        narrowed, fired = constrain_tools(specs, p.rules, latest_observation(messages), tried_before(earlier))
        if p.constraints:
            narrowed, bound = constrain_args(narrowed, p.constraints, read_so_far(messages))
            fired += bound
        if fired:
            sent["tools"] = [_merge(orig, spec) for orig, spec in _pair(tools, narrowed)]
    return sent, fired, menu


def _pair(tools: list[dict[str, Any]], narrowed: list[ToolSpec]) -> list[tuple[dict[str, Any], ToolSpec]]:
    """Each kept tool beside the request's own definition of it (a rule may drop tools)."""
    by_name = {t["function"]["name"]: t for t in tools}
    return [(by_name[s.name], s) for s in narrowed]


def _merge(original: dict[str, Any], spec: ToolSpec) -> dict[str, Any]:
    """The agent's tool definition with the narrowed parameters (any other key it set kept)."""
    return original | {"function": original["function"] | {"parameters": spec.parameters}}


def reply_message(reply: dict[str, Any] | None) -> dict[str, Any]:
    """A completion's assistant message ({} when it has none)."""
    try:
        message = (reply or {})["choices"][0]["message"] or {}
    except (KeyError, IndexError, TypeError):
        return {}
    return message if isinstance(message, dict) else {}


def reply_call(reply: dict[str, Any] | None) -> tuple[str, ToolCall | None, str | None]:
    """A completion's text, its first tool call, and that call's id."""
    message = reply_message(reply)
    text = text_of(message.get("content"))
    for c in message.get("tool_calls") or []:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            continue
        try:
            args = json.loads(f.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            args = {"arguments": f.get("arguments")}
        return (
            text,
            ToolCall(name=f["name"], args=args if isinstance(args, dict) else {"value": args}),
            c.get("id"),
        )
    return text, None, None
