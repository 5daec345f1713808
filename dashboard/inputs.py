"""What arrives over HTTP, checked before any store sees it.

The stores and the lifecycle validate what they keep (and raise `RatchetError`s the API
turns into one-line 4xx answers); this module refuses, at the boundary, what is not text
at all or cannot name anything: a lone surrogate (JSON's `"\\ud800"` decodes to a str no
file can hold), control characters (they rewrite a terminal reading the audit log; a
reason may still hold newlines and tabs), bidirectional overrides (they make a reason read differently than it
is stored), and skill names the library could never have filed (a 300-character name
reaches the filesystem as ENAMETOOLONG, a 500).
"""

from __future__ import annotations

import unicodedata

from ratchet.skills.format import NAME_MAX, NAME_RE

# bidirectional marks, embeddings, overrides and isolates (Trojan Source), as the lifecycle's
BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def text_problem(value: str, newlines: bool = False) -> str | None:
    """Why `value` cannot be kept as text, or None; `newlines`: it may hold newlines and tabs
    (a reason may, as the lifecycle allows; a name or `by` may not)."""
    for ch in value:
        category = unicodedata.category(ch)
        if category == "Cs":
            return "contains a lone surrogate (not text)"
        if category == "Cc" and not (newlines and ch in "\n\t"):
            return f"contains a control character (U+{ord(ch):04X})"
        if ch in BIDI:
            return f"contains a bidirectional override (U+{ord(ch):04X})"
    return None


def plain_text(value: str) -> str:
    """A pydantic validator: one line of text (a ValueError names what is wrong)."""
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def plain_lines(value: str) -> str:
    """A pydantic validator: text that may run over lines."""
    problem = text_problem(value, newlines=True)
    if problem is not None:
        raise ValueError(problem)
    return value


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a skill's name (the library's rule), or None."""
    if len(name) <= NAME_MAX and NAME_RE.match(name):
        return None
    rule = f"names are lowercase letters, digits and hyphens, at most {NAME_MAX}"
    return f"no skill can be named {shown(name)}: {rule}"


def shown(value: str, limit: int = 70) -> str:
    """`value` as it may appear in a one-line message: repr (escapes controls and
    surrogates), cut to `limit` characters."""
    cut = value if len(value) <= limit else value[:limit] + "…"
    return repr(cut)


def one_line(text: str) -> str:
    """`text` as one line that any JSON or HTML answer can carry (no newlines, no
    surrogates)."""
    flat = " ".join(text.split())
    return flat.encode("utf-8", "backslashreplace").decode("utf-8")
