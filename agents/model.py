"""The one place chat models are made: ChatOpenAI against any OpenAI-compatible endpoint."""

from __future__ import annotations

from langchain_openai import ChatOpenAI

from ratchet.errors import TransientModelError


def chat_model(
    base_url: str, model: str, api_key: str = "not-needed", timeout_s: float = 120.0, max_tokens: int = 96
) -> ChatOpenAI:
    """A ChatOpenAI client. Retries are left to Prefect (task retries), so `max_retries=0`.

    `disable_streaming=True`: the actor never needs tokens as they come, and servers that
    don't stream still work with LangGraph's message streaming.
    """
    return ChatOpenAI(
        model=model,
        base_url=base_url,
        api_key=api_key,  # type: ignore[arg-type]
        timeout=timeout_s,
        max_retries=0,
        max_tokens=max_tokens,  # type: ignore[call-arg]
        disable_streaming=True,
    )


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: connection problems, timeouts, rate limits and 5xx answers."""
    import openai

    if isinstance(exc, TransientModelError):
        return True
    if isinstance(exc, openai.APIConnectionError | openai.APITimeoutError | openai.RateLimitError):
        return True
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500
