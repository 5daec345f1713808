"""What the intervention endpoint changes in a request: the live policy of the rollout's arm.

* the policy, as `ratchet.skills.calls.apply_request` applies it for every caller: skills and
  exemplars (those chosen for the rollout's task) appended to the agent's system message, the
  tools it offers narrowed by rules and bound by argument constraints, with what the agent
  has read so far as the context a copied argument comes from, and `model` set to the
  policy's served model;
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

from ratchet.endpoint.recording import Arm
from ratchet.skills.calls import apply_policy, apply_request, for_task, latest_observation, text_of
from ratchet.skills.rules import call_text, normal
from ratchet.types import ModelCall, ToolCall, Tried

__all__ = ["arm_request", "latest_observation", "reply_call", "reply_message", "system_addition", "text_of"]


def system_addition(arm: Arm) -> str:
    """The policy's text for this rollout: its skills and exemplars ('' when it has none)."""
    view = for_task(arm.policy, arm.skills, arm.exemplars)
    return "\n\n".join(apply_policy(view, ModelCall(model="")).additions)


def tried_before(earlier: list[tuple[str, ToolCall]]) -> list[Tried]:
    """The rollout's earlier (observation, call) pairs, as the `no_repeat` rule reads them."""
    return [Tried(normal(obs), call_text(call)) for obs, call in earlier]


def arm_request(
    body: dict[str, Any], arm: Arm, index: int, earlier: list[tuple[str, ToolCall]]
) -> tuple[dict[str, Any], list[str], list[str] | None]:
    """The request to forward, the rules and constraints that changed its tools, and the
    menu of the tools as the agent offered them (None: no tools)."""
    applied = apply_request(for_task(arm.policy, arm.skills, arm.exemplars), body, tried_before(earlier))
    sent = applied.body
    sent["temperature"] = arm.temperature
    sent["seed"] = arm.seed + index
    sent["stream"] = False
    sent.pop("stream_options", None)
    if arm.max_tokens is not None and not (body.get("max_tokens") or body.get("max_completion_tokens")):
        sent["max_tokens"] = arm.max_tokens
    return sent, applied.fired, applied.menu


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
