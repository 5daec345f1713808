"""Replay a stored trajectory into the exact model calls the actor made: one example per step.

Each example is the prompt of one call (system prompt with the skills shown, the task, the
windowed history, the step's options on the latest message) and the tool call that followed
as the target. The prompt is rebuilt by the actor's own `build_prompt` and converted by the
same function ChatOpenAI uses to send it, then rendered by the embedded server's own
template code, so the fine-tuning data is token for token what the model was shown.

A step is an example if it called a tool, or if its text reply was the turn of an episode
that takes text replies. A reply that called no tool where one was needed is not an example,
but it stays in the history with the note the actor answered it with, as the actor kept it.
Epsilon-random steps are examples too: they are part of the path that succeeded, and the
quality filter (training/dataset.py) has already refused lucky paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_openai.chat_models.base import _convert_message_to_dict

from ratchet.agents.actor import build_prompt, text_turn
from ratchet.hashing import content_hash
from ratchet.toolcalls import render_tools, to_chatml_messages
from ratchet.types import Trajectory


class ReplayError(ValueError):
    """A stored trajectory whose steps do not fit its prompt record (it was edited or truncated)."""


@dataclass(frozen=True)
class ChatExample:
    """One model call to learn from, in OpenAI chat format."""

    messages: list[dict[str, Any]]  # the prompt, as sent
    tools: list[dict[str, Any]]
    target: dict[str, Any]  # the assistant message with its tool call
    trajectory_id: str
    task_id: str
    step: int

    @property
    def key(self) -> str:
        """Identity for deduplication: the same prompt and the same answer."""
        return content_hash({"messages": self.messages, "tools": self.tools, "target": self.target})

    def turns(self) -> tuple[list[dict[str, str]], dict[str, str]]:
        """Prompt and target as the plain role/content turns the chat template renders."""
        tools_text = render_tools(self.tools) if self.tools else None
        prompt = to_chatml_messages(self.messages, tools_text)
        (target,) = to_chatml_messages([self.target], None)
        return prompt, target

    def openai_finetune(self) -> dict[str, Any]:
        """One line of an OpenAI chat fine-tuning file: only the last assistant turn is learned."""
        history = [dict(m, weight=0) if m["role"] == "assistant" else m for m in self.messages]
        return {"messages": [*history, self.target], "tools": self.tools}

    @classmethod
    def from_openai_finetune(cls, line: dict[str, Any], source: str = "") -> ChatExample:
        """The example one line of `openai_finetune` wrote (same `key`); `source` names where it
        came from, since the file keeps no trajectory ids."""
        *history, target = line["messages"]
        messages = [{k: v for k, v in m.items() if k != "weight"} for m in history]
        return cls(messages, line.get("tools") or [], target, source, source, len(history))


def replay(traj: Trajectory) -> list[ChatExample]:
    """Every model call of `traj` that produced a tool call; [] if it has no prompt record."""
    if any(step.call is not None for step in traj.steps):
        return recorded(traj)
    rec = traj.prompt
    if rec is None:
        return []
    history: list[AnyMessage] = []
    shown = rec.first_observation  # what the latest message says, before options are appended
    out: list[ChatExample] = []
    for step in traj.steps:
        if not step.moves_on:  # a reply that called no tool: not learned
            history += text_turn(step)  # ...but the actor kept it (with its note) in the history
            continue
        options = _options(step.observation, shown, traj.id, step.index)
        prompt = build_prompt(rec.system, rec.task, history, rec.window, options, rec.compact_repeats)
        call_id = f"call_{step.index}"
        if step.tool_call is None:  # a text reply an episode took as its turn (`Episode.text_replies`)
            ai = AIMessage(content=step.message)
            turn: list[AnyMessage] = text_turn(step)
        else:
            call = step.tool_call
            ai = AIMessage(
                content="",
                tool_calls=[{"name": call.name, "args": call.args, "id": call_id, "type": "tool_call"}],
            )
            turn = [ai, ToolMessage(content=step.tool_result, tool_call_id=call_id)]
        out.append(
            ChatExample(
                messages=[_convert_message_to_dict(m) for m in prompt],
                tools=rec.tools,
                target=_convert_message_to_dict(ai),
                trajectory_id=traj.id,
                task_id=traj.task_id,
                step=step.index,
            )
        )
        history += turn
        shown = step.tool_result
    return out


def recorded(traj: Trajectory) -> list[ChatExample]:
    """The model calls of your own agent (`endpoint/`), as the endpoint forwarded them: each
    call's prompt is rebuilt from what it added to the previous call's, and its reply (a tool
    call, or the answer in words) is the target."""
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    out: list[ChatExample] = []
    for step in traj.steps:
        call = step.call
        if call is None:
            continue
        if not call.continues:
            messages = []
        elif not messages:
            raise ReplayError(f"trajectory {traj.id} step {step.index}: continues a call that was not stored")
        messages = [*messages, *call.messages]
        tools = tools if call.tools is None else call.tools
        target = {k: v for k, v in call.reply.items() if k in ("role", "content", "tool_calls")}
        if target.get("content") or target.get("tool_calls"):
            out.append(ChatExample(list(messages), list(tools), target, traj.id, traj.task_id, step.index))
    return out


def _options(observation: str, shown: str, traj_id: str, index: int) -> str:
    """The options the actor appended to `shown` to make the step's recorded observation."""
    if observation == shown:
        return ""
    if observation.startswith(shown + "\n"):
        return observation[len(shown) + 1 :]
    raise ReplayError(
        f"trajectory {traj_id} step {index}: the observation does not follow the previous result"
    )
