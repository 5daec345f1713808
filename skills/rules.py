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
trajectory viewer.

The menu holds every tool of the step, the environment's and the policy's: one entry per
valid value of a tool with an enumerated parameter (`act: take coin`); one entry per
combination of values of a tool whose parameters are all enumerated (a macro of two moves,
`macro: east, north`, values in the order of their parameters' names, as `call_text` writes
a call), up to `MAX_GRID` combinations; and one entry for each other tool, `calculator: *`
(any call of it; `look` for a tool without parameters). A combination a rule removed leaves
the tool's schema as an `anyOf` of the combinations kept, which the server's grammar
enforces: without it a macro that walks there and back (`east, west`) was one `*` entry that
`no_repeat` could not take off the menu, and the policy called it again from the same state
until its budget ran out (every held-out failure of three coin generations,
bench/RESULTS.md).
So where a suite exposes no enumerated actions (reasoning-gym), rules act on tool choice:
`prefer: ["calculator: *"]` with `when` words of the question makes the first move a
calculation; `avoid: ["calculator: *"]` takes the tool away. A tool whose entries all leave
the menu is not offered at all.

Patterns are actions in the attribution's normal form (`act: take coin`, lowercased, single
spaces); `*` stands for one or more words (`act: open door to *`).

The menu also binds tools to the step (`bind_to_menu`): a parameter annotated with
`MENU_KEY` (a macro's first action as a template, `act: move {a}`) gets as its enum the
values that make an action on this step's menu, so constrained decoding can only produce
a call whose first action is playable; a tool left with no such value is not offered.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ratchet.types import RuleSpec, ToolCall, ToolSpec, Tried


def normal(text: str) -> str:
    """Lowercase, single-spaced: the form patterns and observations are compared in."""
    return " ".join(str(text).lower().split())


WILDCARD = "*"  # a word of a pattern that stands for one or more words
MENU_KEY = "x-ratchet-menu"  # a parameter's annotation: the action template its value must complete
# combinations of an all-enumerated tool listed on the menu one by one (a two-move macro over
# four directions has 16); a tool with more stays one `tool: *` entry
MAX_GRID = 64


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
    """`tools` after the rules: enumerated parameters narrowed, tools left without an entry
    dropped, every other tool as it was; and the names of the rules that fired."""
    if not rules:
        return list(tools), []
    entries = [_entries(tool) for tool in tools]
    kept, fired = apply_rules(rules, observation, list(dict.fromkeys(e for es in entries for e in es)), tried)
    if not fired:
        return list(tools), []
    keep = set(kept)
    out: list[ToolSpec] = []
    for tool, es in zip(tools, entries, strict=True):
        if (grid := _grid(tool)) is not None:
            keys, combos = grid
            left = [c for c, e in zip(combos, es, strict=True) if e in keep]
            if len(left) == len(combos):
                out.append(tool)
            elif left:
                out.append(_narrow_grid(tool, keys, left))
            continue
        key, values = _enum(tool)
        if key is None:
            if es[0] in keep:
                out.append(tool)
            continue
        narrowed = [v for v, e in zip(values, es, strict=True) if e in keep]
        if len(narrowed) == len(values):
            out.append(tool)
        elif narrowed:
            props = dict(tool.parameters.get("properties", {}))
            props[key] = props[key] | {"enum": narrowed}
            out.append(tool.model_copy(update={"parameters": tool.parameters | {"properties": props}}))
    return out, fired


def bind_to_menu(tools: Sequence[ToolSpec]) -> list[ToolSpec]:
    """`tools` with every `MENU_KEY` parameter's enum set to the values that complete its
    template into an action on this step's menu (the enumerated actions of the other tools);
    a tool with such a parameter and no value is dropped. The annotation is removed, so
    what reaches an endpoint is plain JSON schema."""
    menu = [e for t in tools if _enum(t)[0] is not None for e in _entries(t)]
    out: list[ToolSpec] = []
    for tool in tools:
        props = tool.parameters.get("properties", {})
        bound = {k: v for k, v in props.items() if isinstance(v, dict) and MENU_KEY in v}
        if not bound:
            out.append(tool)
            continue
        narrowed = dict(props)
        for key, prop in bound.items():
            plain = {k: v for k, v in prop.items() if k != MENU_KEY}
            narrowed[key] = plain | {"enum": _completions(str(prop[MENU_KEY]), key, menu)}
        if all(narrowed[k]["enum"] for k in bound):
            out.append(tool.model_copy(update={"parameters": tool.parameters | {"properties": narrowed}}))
    return out


def _completions(template: str, key: str, menu: Sequence[str]) -> list[str]:
    """The values of `{key}` that turn `template` into an entry of `menu`, in menu order."""
    before, hole, after = normal(template).partition("{" + key + "}")
    if not hole or "{" + key + "}" in after:
        return []
    rx = re.compile(re.escape(before) + r"(\S+(?: \S+)*)" + re.escape(after))
    return list(dict.fromkeys(m.group(1) for e in menu if (m := rx.fullmatch(e))))


def tool_entry(tool: str, has_args: bool = True) -> str:
    """The menu entry that stands for every call of a tool without enumerated actions."""
    return f"{normal(tool)}: {WILDCARD}" if has_args else normal(tool)


def menu_entries(tools: Sequence[ToolSpec]) -> list[str]:
    """The step's menu as the model was offered it, before any rule: `tool: value` per valid
    value of an enumerated tool, `tool: *` (or the bare name) per other tool, values as the
    environment spelled them (`normal` gives the form rules compare in). Recorded on every
    step (`Step.menu`) so a trajectory can be replayed under other rules (`skills.replay`)."""
    return [e for t in tools for e in _raw_entries(t)]


def _raw_entries(tool: ToolSpec) -> list[str]:
    if (grid := _grid(tool)) is not None:
        return [f"{tool.name}: {', '.join(str(v) for v in combo)}" for combo in grid[1]]
    key, values = _enum(tool)
    if key is None:
        return [f"{tool.name}: {WILDCARD}" if tool.parameters.get("properties") else tool.name]
    return [f"{tool.name}: {v}" for v in values]


def normal_entry(entry: str) -> str:
    """A menu entry in the form rules compare in: `tool: value`, each part in normal form."""
    tool, sep, value = entry.partition(": ")
    return f"{normal(tool)}: {normal(value)}" if sep else normal(entry)


def _entries(tool: ToolSpec) -> list[str]:
    """The tool's menu entries: one per valid value of its enum, else one for the whole tool."""
    return [normal_entry(e) for e in _raw_entries(tool)]


def _enum(tool: ToolSpec) -> tuple[str | None, list[Any]]:
    """The tool's one string parameter with an enum (the valid actions), if it has exactly one."""
    found = [
        (k, v["enum"])
        for k, v in tool.parameters.get("properties", {}).items()
        if isinstance(v, dict) and isinstance(v.get("enum"), list)
    ]
    return found[0] if len(found) == 1 else (None, [])


def _grid(tool: ToolSpec) -> tuple[tuple[str, ...], list[tuple[Any, ...]]] | None:
    """A tool with two or more parameters, all required and each an enum: its parameter names
    (sorted, the order `call_text` writes values in) and the combinations of values it
    accepts, where there are at most `MAX_GRID`; None for any other tool.

    The combinations are the product of the enums, or, once a rule narrowed the tool
    (`_narrow_grid`), the union of its `anyOf` branches' products."""
    params = tool.parameters
    props = params.get("properties") or {}
    keys = tuple(sorted(props))
    if len(keys) < 2 or set(params.get("required") or ()) != set(keys):
        return None
    branches = params.get("anyOf") or [params]
    combos: list[tuple[Any, ...]] = []
    for branch in branches:
        enums = [((branch.get("properties") or {}).get(k) or {}).get("enum") for k in keys]
        if not all(
            isinstance(e, list) and e and all(isinstance(v, str | int | float) for v in e) for e in enums
        ):
            return None  # an enum of objects or lists is not a menu (and its values do not hash)
        if len(combos) + math.prod(len(e) for e in enums) > MAX_GRID:
            return None
        combos += itertools.product(*enums)
    return keys, list(dict.fromkeys(combos))


def _narrow_grid(tool: ToolSpec, keys: tuple[str, ...], combos: list[tuple[Any, ...]]) -> ToolSpec:
    """`tool` accepting only `combos`. Where they are every combination of some values of each
    parameter, those values are its enums; otherwise an `anyOf` beside the properties (which
    stay as they were, for the prompt's list of parameters) has one branch per combination
    of the other parameters' values, with the last parameter's values kept for it."""
    props = tool.parameters.get("properties") or {}
    params = {k: v for k, v in tool.parameters.items() if k != "anyOf"}
    values = [list(dict.fromkeys(c[i] for c in combos)) for i in range(len(keys))]
    if math.prod(len(v) for v in values) == len(combos):
        params["properties"] = props | {k: props[k] | {"enum": v} for k, v in zip(keys, values, strict=True)}
        return tool.model_copy(update={"parameters": params})
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for combo in combos:
        groups.setdefault(combo[:-1], []).append(combo[-1])
    shape = {k: v for k, v in params.items() if k in ("type", "required", "additionalProperties")}
    params["anyOf"] = [
        shape
        | {
            "properties": {k: props[k] | {"enum": [v]} for k, v in zip(keys, head, strict=False)}
            | {keys[-1]: props[keys[-1]] | {"enum": last}}
        }
        for head, last in groups.items()
    ]
    return tool.model_copy(update={"parameters": params})
