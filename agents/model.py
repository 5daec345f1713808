"""The one place chat models are made: ChatOpenAI against any OpenAI-compatible endpoint.

Two ways a tool call can travel (`model.tool_calls`):

* **native**: OpenAI `tools` + `tool_choice`; the server renders the tools and returns
  `tool_calls` (the embedded server, vLLM with a tool parser, hosted APIs);
* **json**: the client renders the tools into the system prompt and asks for a reply that
  matches one call's JSON schema (`response_format`), then reads the call out of the reply.
  For servers that constrain JSON but do not turn `tools` into calls for this model: llama.cpp's
  `llama-server` answers a SmolLM2 request with tools in plain text and ignores
  `tool_choice="required"`. The prompt and the schema are the embedded server's own
  (`ratchet.toolcalls`), so the model reads the same text on either kind of server.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_openai import ChatOpenAI
from langchain_openai.chat_models.base import _convert_message_to_dict

from ratchet.config import REQUEST_TIMEOUT_S
from ratchet.errors import TransientModelError
from ratchet.toolcalls import read_cut_text, read_reply, render_tools, to_chatml_messages, tool_call_schema

ToolCallMode = Literal["native", "json"]


def chat_model(
    base_url: str,
    model: str,
    api_key: str = "not-needed",
    timeout_s: float = REQUEST_TIMEOUT_S,
    max_tokens: int = 96,
    tool_calls: ToolCallMode = "native",
) -> ChatOpenAI:
    """A ChatOpenAI client. Retries are left to Prefect (task retries), so `max_retries=0`.

    `disable_streaming=True`: the actor never needs tokens as they come, and servers that
    don't stream still work with LangGraph's message streaming.
    """
    cls = JsonToolChatOpenAI if tool_calls == "json" else ChatOpenAI
    return cls(
        model=model,
        base_url=base_url,
        api_key=api_key,  # type: ignore[arg-type]
        timeout=timeout_s,
        max_retries=0,
        max_tokens=max_tokens,  # type: ignore[call-arg]
        disable_streaming=True,
    )


class JsonToolChatOpenAI(ChatOpenAI):
    """ChatOpenAI whose tool calls travel as schema-constrained JSON (module docstring)."""

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        messages, kwargs, tools = as_json_request(messages, kwargs)
        result = super()._generate(messages, stop, run_manager, **kwargs)
        return read_tool_calls(result) if tools else result

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        messages, kwargs, tools = as_json_request(messages, kwargs)
        result = await super()._agenerate(messages, stop, run_manager, **kwargs)
        return read_tool_calls(result) if tools else result


_ROLES = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}


def as_json_request(
    messages: list[BaseMessage], kwargs: dict[str, Any]
) -> tuple[list[BaseMessage], dict[str, Any], list[dict[str, Any]]]:
    """The request without `tools`: tools rendered into the system prompt, earlier calls and
    results as the text the model saw, and the reply constrained to one call's schema."""
    kwargs = dict(kwargs)
    tools: list[dict[str, Any]] = kwargs.pop("tools", None) or []
    choice = kwargs.pop("tool_choice", None)
    kwargs.pop("parallel_tool_calls", None)
    if not tools or choice == "none":
        return messages, kwargs, []
    if isinstance(choice, dict):  # a named function
        name = choice.get("function", {}).get("name")
        tools = [t for t in tools if t.get("function", t).get("name") == name] or tools
    turns = to_chatml_messages([_convert_message_to_dict(m) for m in messages], render_tools(tools))
    schema = tool_call_schema(tools, allow_text=choice in (None, "auto"))
    kwargs["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "tool_call", "schema": schema},
    }
    return [_ROLES[t["role"]](content=t["content"]) for t in turns], kwargs, tools


def read_tool_calls(result: ChatResult) -> ChatResult:
    """Each reply `{"name": ..., "arguments": {...}}` becomes a tool call; `{"content": ...}`
    becomes text; anything else stays as it came (the actor records it as "no tool call")."""
    return ChatResult(
        generations=[
            ChatGeneration(message=_read(g.message), generation_info=g.generation_info)
            for g in result.generations
        ],
        llm_output=result.llm_output,
    )


def _read(msg: BaseMessage) -> BaseMessage:
    reply = read_reply(str(msg.content))
    if isinstance(reply, tuple):
        name, arguments = reply
        call = {"name": name, "args": arguments, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "tool_call"}
        return AIMessage(
            content="",
            tool_calls=[call],
            id=msg.id,
            usage_metadata=getattr(msg, "usage_metadata", None),
            response_metadata=msg.response_metadata,
        )
    if isinstance(reply, str):
        return msg.model_copy(update={"content": reply})
    if (cut := read_cut_text(str(msg.content))) is not None:  # a text reply cut off by the limit
        return msg.model_copy(update={"content": cut})
    return msg


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: connection problems, timeouts, rate limits and 5xx answers."""
    import openai

    if isinstance(exc, TransientModelError):
        return True
    if isinstance(exc, openai.APIConnectionError | openai.APITimeoutError | openai.RateLimitError):
        return True
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500
