"""Text a small model degenerated into: a phrase repeated until the token budget ran out.

SmolLM2-135M, asked for a cause or a skill step, sometimes loops ("one sentence error
revised one sentence error revised …"). Such text says nothing new after its first round: a
judge's cause that loops is discarded, a teacher's draft that loops is refused, and wherever
stored text is shown it is cut after the first round with a mark, so a person never reads a
loop as a diagnosis.

A loop is a unit of 1 to `MAX_UNIT` words repeated back to back, at least 3 times and over
at least 6 words (so "very very" or "again and again" are prose, not loops). Words are
compared case-insensitively, whatever separates them (spaces, hyphens, punctuation).
"""

from __future__ import annotations

import re

MAX_UNIT = 24  # words in the longest repeated unit looked for
MIN_REPEATS = 3
MIN_WORDS = 6
CUT_MARK = " […repeats]"
_WORD = re.compile(r"\w+")


def repetition(text: str) -> tuple[int, int] | None:
    """Where the first loop starts in `text` and where its first round ends (character
    offsets), or None if there is none."""
    words = list(_WORD.finditer(text[:20_000]))  # a loop shows long before that
    toks = [m.group().lower() for m in words]
    for unit in range(1, MAX_UNIT + 1):
        need = max(unit * (MIN_REPEATS - 1), MIN_WORDS - unit)  # matches after the first round
        run = 0
        for i in range(unit, len(toks)):
            run = run + 1 if toks[i] == toks[i - unit] else 0
            if run >= need:
                start = i - run - unit + 1
                return words[start].start(), words[start + unit - 1].end()
    return None


def repeats_itself(text: str) -> bool:
    """Whether `text` holds a loop (see the module docstring)."""
    return repetition(text) is not None


def cut_repetition(text: str) -> str:
    """`text` up to the end of its loop's first round, marked; unchanged if it has no loop."""
    found = repetition(text)
    return text if found is None else text[: found[1]] + CUT_MARK
