"""The scoring function ratchet calls on each answer: `score(item, answer)`."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def score(item: dict, answer: object) -> bool:
    """Right when the last number in the answer is within 1% of the item's answer."""
    found = NUMBER.findall(str(answer))
    if not found:
        return False
    value = float(found[-1].replace(",", ""))
    return abs(value - item["answer"]) <= 0.01 * abs(item["answer"])
