"""A string's length bound the grammar keeps, where the schema also gives it a pattern.

xgrammar (0.2.9) compiles a string with a `pattern` from the pattern alone: `maxLength` and
`minLength` beside it are ignored, so a constrained reply can run past the bound its schema
states until the token budget ends it (a tool argument an argument constraint narrowed, a
user's tool schema). Where the pattern is one repeated atom (`^[a-z]+$`, `\\d*`, `.+`), the
bound is moved into the pattern as a counted repetition (`^[a-z]{1,40}$`), which the grammar
does enforce. Any other pattern is left as it is: intersecting a general regular expression
with a length is not something the grammar's regex dialect can say (no lookahead), so there
the bound is only the validator's (docs/server.md).
"""

from __future__ import annotations

import re
from typing import Any

# ^? atom (+ or *) $?: the atom a character class, an escaped class (\d, \w, \s and their
# negations), the wildcard, or one plain character
_DATA = frozenset({"enum", "const", "default", "examples"})  # values, not schemas: left as written
_REPEATED = re.compile(r"^(\^?)(\[(?:\\.|[^\]\\])+\]|\\[dwsDWS]|\.|[^\\\[\](){}|^$*+?.])([+*])(\$?)$")


def bounded_pattern(pattern: str, min_length: int | None, max_length: int | None) -> str | None:
    """`pattern` with the length bounds as its repetition count, or None where it is not one
    repeated atom (or no bound is given)."""
    if max_length is None and min_length is None:
        return None
    m = _REPEATED.match(pattern)
    if m is None:
        return None
    start, atom, op, end = m.groups()
    lo = max(min_length or 0, 1 if op == "+" else 0)
    if max_length is not None and lo > max_length:
        return None  # no string satisfies both: the schema's own contradiction, left to the validator
    hi = "" if max_length is None else str(max_length)
    return f"{start}{atom}{{{lo},{hi}}}{end}"


def bound_patterns(node: Any) -> Any:
    """A copy of a JSON schema with every pattern-and-length string bounded by its pattern."""
    if isinstance(node, list):
        return [bound_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA else bound_patterns(v) for k, v in node.items()}
    pattern = out.get("pattern")
    if isinstance(pattern, str):
        lo, hi = out.get("minLength"), out.get("maxLength")
        bounded = bounded_pattern(
            pattern, lo if isinstance(lo, int) else None, hi if isinstance(hi, int) else None
        )
        if bounded is not None:
            out["pattern"] = bounded
    return out
