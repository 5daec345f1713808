"""A scripted chat model for unit tests of graph logic (never for measuring a policy).

Shipped in the package so every test suite (ours and plug-ins') scripts models the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import Field

Script = Callable[[list[BaseMessage], list[dict[str, Any]]], AIMessage]


class ScriptedChatModel(BaseChatModel):
    """Answers from a script: a list of replies (used in order) or a function of (messages, tools).

    Records every call's messages, offered tools and call kwargs in `calls`.
    """

    script: Any
    calls: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        return self.bind(tools=list(tools), **kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        tools = kwargs.get("tools", [])
        self.calls.append({"messages": messages, "tools": tools, "kwargs": kwargs})
        if callable(self.script):
            reply = self.script(messages, tools)
        else:
            reply = self.script[len(self.calls) - 1]
        if isinstance(reply, BaseException):
            raise reply
        return ChatResult(generations=[ChatGeneration(message=reply)])


def call(name: str, **args: Any) -> AIMessage:
    """An AIMessage with one tool call, as a model would return it."""
    return AIMessage(
        content="", tool_calls=[{"name": name, "args": args, "id": f"call_{name}", "type": "tool_call"}]
    )
