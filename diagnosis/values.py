"""The task's own values, told apart from a family's shared words, and masked.

A failure cluster must not split on the values a task carries (the city asked about, the
number to answer), and what a value is, is the suite's business, not ratchet's: so values
are told from the family's own trajectories. A word is the task's own when, of the words
of the family's instructions, first observations and call arguments, it occurs in exactly
one task (`Vocabulary`). Own words become `<v>` outside quotes; inside quotes (the summary
quotes actions, errors quote what was refused) every word the family does not share and
that is no tool or parameter name becomes `<v>`. Numbers are always `#`. A family of one
task shares every word: with one task there is nothing to tell apart. The judge's cause
is masked like the rest of a summary.

An error's class (`error_class`) is stricter, as it groups failures exactly: an exception's
class name, else the first sentence with every quoted word but names masked.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ratchet.types import Trajectory

ERROR_WORDS = 10  # an error class keeps the first sentence, at most this many words
VALUE, NUMBER = "<v>", "#"

_WORD = re.compile(r"\w+")
_QUOTED = re.compile(r"(?<!\w)'[^']*'(?!\w)|\"[^\"]*\"|`[^`]*`")
_DIGITS = re.compile(r"\d+")
_VALUES = re.compile(r"<v>(?:[\s,]+<v>)+")
_EXCEPTION = re.compile(r"^([A-Z]\w*(?:Error|Exception|Exit|Interrupt|Timeout))\b")
_SENTENCE = re.compile(r"(?<=[.!?;])\s")


@dataclass(frozen=True)
class Vocabulary:
    """A family's words: those one task alone uses (`own`), those several share, and names."""

    own: frozenset[str]
    shared: frozenset[str]
    names: frozenset[str]  # tools and their parameters: never a task's value

    @classmethod
    def of(cls, trajectories: Iterable[Trajectory]) -> Vocabulary:
        per_task: dict[str, set[str]] = defaultdict(set)
        names: set[str] = set()
        for t in trajectories:
            words = per_task[t.task_id]
            words |= _words(t.instruction)
            first = t.prompt.first_observation if t.prompt else (t.steps[0].observation if t.steps else "")
            words |= _words(first)
            if t.prompt is not None:
                names |= _tool_names(t.prompt.tools)
            for s in t.steps:
                if s.tool_call is not None:
                    names.add(s.tool_call.name.lower())
                    names |= {k.lower() for k in s.tool_call.args}
                    for v in s.tool_call.args.values():
                        words |= _words(str(v))
        counts = Counter(w for ws in per_task.values() for w in ws)
        if len(per_task) < 2:
            return cls(frozenset(), frozenset(counts), frozenset(names))
        own = frozenset(w for w, n in counts.items() if n == 1) - names
        return cls(own, frozenset(w for w, n in counts.items() if n > 1), frozenset(names))


def mask(text: str, vocab: Vocabulary, quoted_keep: frozenset[str] | None = None) -> str:
    """`text` without the task's own values (see the module docstring); `quoted_keep` are
    the words a quote may keep (default: the family's shared words and the names)."""
    keep = vocab.shared | vocab.names if quoted_keep is None else quoted_keep
    out, pos = [], 0
    for m in _QUOTED.finditer(text):
        out.append(_mask_words(text[pos : m.start()], lambda w: w in vocab.own))
        out.append(_mask_words(m.group(), lambda w: w not in keep))
        pos = m.end()
    out.append(_mask_words(text[pos:], lambda w: w in vocab.own))
    return _VALUES.sub(VALUE, "".join(out))


def error_class(error: str, vocab: Vocabulary) -> str:
    """An exception's class name, else the error's first sentence masked (quotes keep only names)."""
    error = " ".join(error.split())
    if m := _EXCEPTION.match(error):
        return m.group(1)
    first = _SENTENCE.split(error, maxsplit=1)[0]
    return " ".join(mask(first, vocab, quoted_keep=vocab.names).split()[:ERROR_WORDS])


def _words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text) if not w.isdigit()}


def _tool_names(tools: list[dict[str, Any]]) -> set[str]:
    out: set[str] = set()
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.add(fn["name"].lower())
            props = (fn.get("parameters") or {}).get("properties") or {}
            out |= {str(k).lower() for k in props}
    return out


def _mask_words(text: str, hide: Any) -> str:
    def one(m: re.Match[str]) -> str:
        w = m.group()
        if w.isdigit():
            return NUMBER
        return VALUE if hide(w.lower()) else _DIGITS.sub(NUMBER, w)

    return _WORD.sub(one, text)
