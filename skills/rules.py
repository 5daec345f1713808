"""Action rules: executable guardrails that act on the menu of valid actions, not on the
model's attention.

A small policy does not read advice in its prompt (greedy outcomes do not move when text is
appended), but it can only choose what its constrained decoder lets it choose. A rule
(`ratchet.types.RuleSpec`) is data that ratchet interprets here; nothing else runs. Before
each model call the actor passes every environment tool whose parameter has an `enum` (the
actions valid now) through the policy's rules, in name order:

* `when`: phrases that must all appear in the observation (lowercased) for the rule to act;
* `avoid`: actions matching these patterns leave the menu;
* `no_repeat`: back at an observation it has seen before, the agent does not take an action
  it already took from there (untried actions first; in a deterministic world the same
  action from the same state leads where it led before, which is how loops are made);
* `prefer`: if any action on the menu matches, the menu becomes just those (forced, not a
  bias: a 135M model ignores a nudge, and the gate judges whether forcing helps).

A rule that would empty the menu does not act (the model always has a legal move). Each
rule that changed the menu is recorded on the step (`Step.rules`) and shown by the
trajectory viewer. Where a suite exposes no enumerated actions (reasoning-gym), rules have
nothing to act on.

Patterns are actions in the attribution's normal form (`act: take coin`, lowercased, single
spaces); `*` stands for one or more words (`act: open door to *`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ratchet.types import RuleSpec, ToolCall, ToolSpec


def normal(text: str) -> str:
    """Lowercase, single-spaced: the form patterns and observations are compared in."""
    return " ".join(str(text).lower().split())


WILDCARD = "*"  # a word of a pattern that stands for one or more words


def matches(pattern: str, action: str) -> bool:
    """Does `action` fit `pattern` (`*` = one or more words)? Both are compared in normal form."""
    return _regex(normal(pattern)).fullmatch(normal(action)) is not None


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern[str]:
    parts = [r"\S+(?: \S+)*" if w == WILDCARD else re.escape(w) for w in pattern.split()]
    return re.compile(" ".join(parts))


def call_text(call: ToolCall) -> str:
    """A tool call in the attribution's normal form (`diagnosis.attribution.normalize_action`)."""
    values = [normal(v) for _, v in sorted(call.args.items())]
    return f"{call.name}: {', '.join(values)}" if values else call.name


@dataclass(frozen=True)
class Tried:
    """One earlier step of the episode, as `no_repeat` sees it."""

    state: str  # the observation acted from (normal form, without the options)
    action: str  # the action (normal form, 'tool: value')


def apply_rules(
    rules: Sequence[RuleSpec], observation: str, menu: Sequence[str], tried: Sequence[Tried] = ()
) -> tuple[list[str], list[str]]:
    """The menu after the rules, and the names of the rules that changed it.

    `menu` holds actions in normal form; the result keeps their order."""
    seen = normal(observation)
    current = list(menu)
    fired: list[str] = []
    for rule in sorted(rules, key=lambda r: r.name):
        if not all(normal(w) in seen for w in rule.when):
            continue
        kept = [a for a in current if not any(matches(p, a) for p in rule.avoid)]
        if rule.no_repeat:
            done = {t.action for t in tried if t.state == seen}
            kept = [a for a in kept if a not in done]
        preferred = [a for a in kept if any(matches(p, a) for p in rule.prefer)]
        if preferred:
            kept = preferred
        if kept and kept != current:
            current = kept
            fired.append(rule.name)
    return current, fired


def constrain_tools(
    tools: Sequence[ToolSpec], rules: Sequence[RuleSpec], observation: str, tried: Sequence[Tried] = ()
) -> tuple[list[ToolSpec], list[str]]:
    """`tools` with each enumerated action parameter narrowed by the rules; the rules that fired."""
    if not rules:
        return list(tools), []
    out: list[ToolSpec] = []
    fired: list[str] = []
    for tool in tools:
        key, values = _enum(tool)
        if key is None:
            out.append(tool)
            continue
        by_action = {f"{normal(tool.name)}: {normal(v)}": v for v in values}
        kept, names = apply_rules(rules, observation, list(by_action), tried)
        fired += [n for n in names if n not in fired]
        if len(kept) == len(by_action):
            out.append(tool)
            continue
        props = dict(tool.parameters.get("properties", {}))
        props[key] = props[key] | {"enum": [by_action[a] for a in kept]}
        out.append(tool.model_copy(update={"parameters": tool.parameters | {"properties": props}}))
    return out, fired


def _enum(tool: ToolSpec) -> tuple[str | None, list[Any]]:
    """The tool's one string parameter with an enum (the valid actions), if it has exactly one."""
    found = [
        (k, v["enum"])
        for k, v in tool.parameters.get("properties", {}).items()
        if isinstance(v, dict) and isinstance(v.get("enum"), list)
    ]
    return found[0] if len(found) == 1 else (None, [])
