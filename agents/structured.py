"""Structured answers from a teacher model: a JSON schema in `response_format`, parsed by pydantic.

`response_format` (json_schema) is what OpenAI-compatible servers constrain on (the embedded
server compiles it into a grammar); asking through `bind` rather than LangChain's
`with_structured_output` keeps the scripted test model and real endpoints on one path.
Bound every free-text field with `max_length`: a small model otherwise rambles to its
token limit inside a string.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AnyMessage
from pydantic import BaseModel, ValidationError

from ratchet.agents.model import is_transient

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def response_format(schema: type[BaseModel]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": schema.__name__, "schema": schema.model_json_schema(), "strict": True},
    }


def ask_json(llm: BaseChatModel, messages: list[AnyMessage], schema: type[M], **kwargs: Any) -> M | None:
    """The model's answer as `schema`, or None if it did not produce one (logged, not raised).

    Transient endpoint errors propagate so the caller's Prefect task can retry; a malformed
    answer is the teacher's failure and the algorithmic result stands without it.
    """
    try:
        msg = llm.bind(response_format=response_format(schema)).invoke(messages, **kwargs)
    except Exception as exc:
        if is_transient(exc):
            raise
        log.warning("teacher call failed: %s: %s", type(exc).__name__, exc)
        return None
    try:
        return schema.model_validate_json(str(msg.content))
    except ValidationError as exc:
        log.info("teacher answer did not match %s: %s", schema.__name__, str(exc).splitlines()[0])
        return None
