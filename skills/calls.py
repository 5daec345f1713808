"""A policy applied to one model call: the one place that does it.

Ratchet's actor, the intervention endpoint in front of a user's agent during a run, and the
gateway in front of it in use all change a model call the same way, by `apply_policy`: the
call in, as a `ModelCall`; the call as the policy changes it out, with the names of the
candidates that changed its tools. What each kind does is its registered
`CandidateKind.on_call` (`ratchet/kinds.py`; the built-in kinds' are in `skills/kinds.py`),
so a new kind changes calls without an edit here or in any caller.

`apply_request` is the same for an OpenAI chat-completions body (the endpoint's and the
gateway's wire format): the policy's sections appended to the agent's system message (one is
added where it sent none), its tools narrowed and their schemas bound, the model set to the
policy's served model (the champion adapter by name, vLLM's multi-LoRA convention).
Everything else the agent sent is passed on unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from ratchet.kinds import call_steps
from ratchet.skills import kinds as _kinds  # noqa: F401 - the built-in kinds, registered before any call
from ratchet.skills.rules import menu_entries
from ratchet.types import ModelCall, Policy, SkillText, ToolSpec, Tried


def apply_policy(policy: Policy, call: ModelCall) -> ModelCall:
    """`call` as `policy` changes it: served model, system sections, narrowed tools, and what
    fired (kinds in the order they were registered, `ratchet.kinds.call_steps`)."""
    call = replace(call, model=policy.served_model)
    for step in call_steps():
        call = step(policy, call)
    return call


def for_task(
    policy: Policy, skills: tuple[SkillText, ...] | None, exemplars: tuple[SkillText, ...] | None
) -> Policy:
    """`policy` showing only the skills and exemplars chosen for a task (None: all of its own).
    A view for one rollout's calls; its version is not the policy's, so never record it."""
    update: dict[str, Any] = {}
    if skills is not None:
        update["skills"] = skills
    if exemplars is not None:
        update["exemplars"] = exemplars
    return policy.model_copy(update=update) if update else policy


# ------------------------------------------------------------------ the OpenAI wire format


@dataclass(frozen=True)
class AppliedRequest:
    """A chat-completions body after the policy: what to forward, the candidates that changed
    its tools, and the menu of the tools as the agent offered them (None: no tools)."""

    body: dict[str, Any]
    fired: list[str]
    menu: list[str] | None


def apply_request(policy: Policy, body: dict[str, Any], tried: Sequence[Tried] = ()) -> AppliedRequest:
    """`apply_policy` on an OpenAI chat-completions request body (module docstring). `tried`
    is the episode's earlier (state, action) pairs where the caller knows them (the endpoint
    does, for the `no_repeat` rules); the body itself is not changed."""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    tools = body.get("tools")
    specs = tool_specs(tools) if isinstance(tools, list) and tools else None
    call = apply_policy(
        policy,
        ModelCall(
            model=str(body.get("model") or ""),
            tools=tuple(specs or ()),
            observation=latest_observation(messages),
            reads=tuple(read_so_far(messages)),
            tried=tuple(tried),
        ),
    )
    sent = dict(body)
    sent["messages"] = with_system_text(messages, "\n\n".join(call.additions))
    sent["model"] = call.model
    if specs and call.fired:
        sent["tools"] = [_merge(orig, spec) for orig, spec in _pair(tools, call.tools)]  # type: ignore[arg-type]
    return AppliedRequest(sent, list(call.fired), menu_entries(specs) if specs else None)


def task_text(messages: list[Any]) -> str:
    """What the task is: the text of the first user message ('' if there is none). The gateway
    chooses a request's skills by it, and a request learned from use is this task."""
    users = (m for m in messages if isinstance(m, dict) and m.get("role") == "user")
    return next((text_of(m.get("content")) for m in users), "")


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


def with_system_text(messages: list[dict[str, Any]], extra: str) -> list[dict[str, Any]]:
    """`messages` with `extra` appended to the first system (or developer) message, or in a
    system message of its own at the front where there is none."""
    if not extra:
        return messages
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") in ("system", "developer"):
            m["content"] = f"{text_of(m.get('content'))}\n\n{extra}"
            return out
    return [{"role": "system", "content": extra}, *out]


def tool_specs(tools: list[Any]) -> list[ToolSpec] | None:
    """The request's function tools as ToolSpecs (None if any is not a plain function tool, or
    not one a ToolSpec can hold: then the tools are passed on as they are)."""
    specs = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            return None
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            return None
        try:
            spec = ToolSpec(name=f["name"], description=str(f.get("description") or ""), parameters=params)
        except ValidationError:
            return None
        specs.append(spec)
    return specs


def _pair(tools: list[dict[str, Any]], narrowed: Sequence[ToolSpec]) -> list[tuple[dict[str, Any], ToolSpec]]:
    """Each kept tool beside the request's own definition of it (a rule may drop tools)."""
    by_name = {t["function"]["name"]: t for t in tools}
    return [(by_name[s.name], s) for s in narrowed]


def _merge(original: dict[str, Any], spec: ToolSpec) -> dict[str, Any]:
    """The agent's tool definition with the narrowed parameters (any other key it set kept)."""
    return original | {"function": original["function"] | {"parameters": spec.parameters}}
