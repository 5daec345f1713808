"""Structured answers from a teacher model: a JSON schema in `response_format`, parsed by pydantic.

`response_format` (json_schema) is what OpenAI-compatible servers constrain on (the embedded
server compiles it into a grammar); asking through `bind` rather than LangChain's
`with_structured_output` keeps the scripted test model and real endpoints on one path.
Bound every free-text field with `max_length`: a small model otherwise rambles to its
token limit inside a string. A field with a `pattern` must bound itself in the pattern
(`{m,n}`, never `+` or `*`): the grammar compiler (xgrammar 0.2.9) ignores `maxLength` beside
a `pattern`, and the shipped model, greedy, once filled a `[a-z0-9]+` name with digits until
the token budget ran out (`tests/test_teacher_schemas.py` holds every schema to this).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, TypeVar

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AnyMessage
from openai import LengthFinishReasonError
from pydantic import BaseModel, Field, ValidationError

from ratchet.agents.model import is_transient

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

# A skill's name as a teacher writes it: up to six lowercase words of up to 16 letters or
# digits. The pattern itself is the bound the grammar enforces; `max_length` is what it implies.
NAME_WORD_MAX, NAME_WORDS_MAX = 16, 6
SkillName = Annotated[
    str,
    Field(
        pattern=rf"^[a-z0-9]{{1,{NAME_WORD_MAX}}}(-[a-z0-9]{{1,{NAME_WORD_MAX}}}){{0,{NAME_WORDS_MAX - 1}}}$",
        max_length=NAME_WORDS_MAX * (NAME_WORD_MAX + 1) - 1,
    ),
]


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
    except LengthFinishReasonError as exc:  # a small teacher rambling: an answer like a bad one
        usage = exc.completion.usage
        used = f" ({usage.completion_tokens})" if usage else ""
        log.info("teacher answer for %s ran out of tokens%s before it closed", schema.__name__, used)
        return None
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
