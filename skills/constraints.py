"""Argument constraints: executable interventions for tools that have no menu.

A rule acts on a menu of valid actions; a tool with free arguments (`get_weather(city)`, an
answer to write) has none, and a small model fills such arguments with whatever its
sampling makes: a city the user never named, a runaway string. A constraint
(`ratchet.types.ConstraintSpec`) is data mined from the policy's own successful calls and
written into the tool's JSON schema before each model call, so constrained decoding can
only produce arguments of the shape that succeeded:

* `from_context`: every successful value was words the agent had read (the task, or a result
  seen earlier in the episode). The argument becomes an `enum` of the spans (1 to
  `SPAN_WORDS` words) of what it has read so far; a number argument, of its numbers. Where
  there would be more than `ENUM_MAX` values the argument is left as it was.
* `max_length`: a string ends at twice the longest successful value (the grammar enforces
  `maxLength`), when that is shorter than the schema's own bound.
* `integer`: a number whose successful values were all whole becomes `"type": "integer"`.

An argument with an `enum` already (a menu, or one a rule narrowed) is left alone: the
menu is the rules' (`skills/rules.py`). Each constraint that changed a tool is recorded on
the step (`Step.rules`), as a rule's firing is. Like any candidate, a constraint is gated on
the dev split: one that narrows the wrong way is rejected there.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ratchet.skills.format import Skill
from ratchet.skills.rule_mining import is_train, rule_name
from ratchet.skills.rules import WILDCARD
from ratchet.types import ArgConstraint, ConstraintSpec, ToolSpec, Trajectory, family_of

SPAN_WORDS = 4  # the longest span of words a from-context string may be
ENUM_MAX = 400  # more candidate values than this, and the argument is not narrowed
MIN_TASKS = 2  # a constraint needs successful calls from this many distinct train tasks
_WORD = re.compile(r"[^\W_]+(?:['.\-][^\W_]+)*")  # words, keeping "o'clock", "3.5", "new-york"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


def spans(texts: Sequence[str], max_words: int = SPAN_WORDS) -> list[str]:
    """Every run of 1..`max_words` consecutive words of each text (punctuation between words
    ends a span only where it is not part of a word), first occurrence first."""
    out: dict[str, None] = {}
    for text in texts:
        for line in re.split(r"[\n,;:!?()\[\]{}\"]+", text):
            words = _words(line)
            for i in range(len(words)):
                for n in range(1, max_words + 1):
                    if i + n <= len(words):
                        out.setdefault(" ".join(words[i : i + n]), None)
    return list(out)


def numbers(texts: Sequence[str]) -> list[float | int]:
    """The numbers written in `texts`, first occurrence first (whole ones as int)."""
    out: dict[float | int, None] = {}
    for text in texts:
        for m in _NUMBER.findall(text):
            v = float(m)
            out.setdefault(int(v) if v.is_integer() else v, None)
    return list(out)


def _in_context(value: Any, texts: Sequence[str]) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return any(abs(value - n) < 1e-9 for n in numbers(texts))
    if isinstance(value, str) and value.strip():
        want = " ".join(_words(value)).lower()
        return bool(want) and want == value.strip().lower() and want in {s.lower() for s in spans(texts)}
    return False


# ------------------------------------------------------------------------------ applying


def constrain_args(
    tools: Sequence[ToolSpec], constraints: Sequence[ConstraintSpec], context: Sequence[str]
) -> tuple[list[ToolSpec], list[str]]:
    """`tools` with each constraint written into its tool's parameters, and the names of the
    constraints that changed one. `context` is what the agent has read: the task, then the
    observations so far."""
    if not constraints:
        return list(tools), []
    by_tool: dict[str, list[ConstraintSpec]] = defaultdict(list)
    for c in sorted(constraints, key=lambda c: c.name):
        by_tool[c.tool].append(c)
    found_spans: list[str] | None = None
    found_numbers: list[float | int] | None = None
    out: list[ToolSpec] = []
    fired: list[str] = []
    for tool in tools:
        props = dict(tool.parameters.get("properties") or {})
        changed = False
        for c in by_tool.get(tool.name, ()):
            acted = False
            for arg, rule in c.args.items():
                prop = props.get(arg)
                if not isinstance(prop, dict) or "enum" in prop:
                    continue
                new = dict(prop)
                kind = prop.get("type")
                if rule.from_context and kind == "string":
                    found_spans = spans(context) if found_spans is None else found_spans
                    lo, hi = prop.get("minLength", 0), prop.get("maxLength", 1 << 30)
                    fits = [v for v in found_spans if lo <= len(v) <= hi]  # the schema's own bounds hold
                    if 0 < len(fits) <= ENUM_MAX:
                        new["enum"] = fits
                elif rule.from_context and kind in ("number", "integer"):
                    found_numbers = numbers(context) if found_numbers is None else found_numbers
                    whole = kind == "integer" or rule.integer
                    values = [n for n in found_numbers if not whole or isinstance(n, int)]
                    if 0 < len(values) <= ENUM_MAX:
                        new["enum"] = values
                if rule.max_length and kind == "string" and rule.max_length < prop.get("maxLength", 1 << 30):
                    new["maxLength"] = rule.max_length
                if rule.integer and kind == "number":
                    new["type"] = "integer"
                if new != prop:
                    props[arg], acted = new, True
            if acted:
                fired.append(c.name)
                changed = True
        out.append(
            tool.model_copy(update={"parameters": tool.parameters | {"properties": props}})
            if changed
            else tool
        )
    return out, fired


# ------------------------------------------------------------------------------- mining


def free_tools(trajectories: Sequence[Trajectory]) -> set[str]:
    """Tools the steps of `trajectories` offered without a menu (a `tool: *` entry,
    `skills/rules.py:menu_entries`) and never with one (a tool with an enumerated argument
    is the rules'). Steps that did not record their menu (an expert's) say nothing."""
    free: set[str] = set()
    enumerated: set[str] = set()
    for s in (s for t in trajectories for s in t.steps if s.menu):
        for e in s.menu or ():
            tool, sep, value = e.partition(": ")
            (free if value == WILDCARD else enumerated).add(tool if sep else e)
    return free - enumerated


@dataclass(frozen=True)
class MinedConstraint:
    spec: ConstraintSpec
    trajectory_ids: tuple[str, ...]  # the successes whose calls it holds to


def mine_constraints(family: str, trajectories: Sequence[Trajectory]) -> list[MinedConstraint]:
    """One constraint per free tool (`free_tools`) the family's train successes called, from
    at least `MIN_TASKS` distinct tasks, holding what every successful call of it had in
    common (module docstring). The suite's reference solutions (`kind == "expert"`) count: a
    constraint says what shape an argument has, which a reference call shows as well as the
    policy's own, and on a tool the policy almost never calls right (a currency conversion
    whose source it always guesses) they are all the evidence there is; the gate still
    decides on the policy's own dev rollouts. Failures, other splits and other families are
    not read."""
    own = [
        t
        for t in trajectories
        if t.split == "train" and is_train(t.task_id) and family_of(t.task_id) == family
    ]
    wins = [t for t in own if t.success and t.status == "finished"]
    free = free_tools(own)
    calls: dict[str, list[tuple[str, dict[str, Any], list[str]]]] = defaultdict(list)
    ids: dict[str, set[str]] = defaultdict(set)
    for t in wins:
        seen = [t.instruction]
        for s in t.steps:
            seen.append(s.observation)  # what it acted on (the previous result, or the first view)
            if s.tool_call is not None and s.error is None and s.tool_call.name in free:
                calls[s.tool_call.name].append((t.task_id, s.tool_call.args, list(seen)))
                ids[s.tool_call.name].add(t.id)
    out = []
    for tool, made in sorted(calls.items()):
        if len({task for task, _, _ in made}) < MIN_TASKS:
            continue
        names = set.intersection(*(set(args) for _, args, _ in made))
        args: dict[str, ArgConstraint] = {}
        for arg in sorted(names):
            values = [a[arg] for _, a, _ in made]
            from_context = all(_in_context(a[arg], ctx) for _, a, ctx in made)
            strings = all(isinstance(v, str) for v in values)
            longest = max((len(v) for v in values), default=0) if strings else 0
            whole = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
            rule = ArgConstraint(
                from_context=from_context,
                max_length=max(2 * longest, 8) if strings else None,
                integer=whole,
            )
            if rule.from_context or rule.integer or rule.max_length:
                args[arg] = rule
        if args:
            name = rule_name(family, "args", tool)
            spec = ConstraintSpec(name=name, tool=tool, args=args)
            out.append(MinedConstraint(spec, tuple(sorted(ids[tool]))))
    return out


def constraint_skill(family: str, mined: MinedConstraint, evolution: str, generation: int) -> Skill:
    """A mined constraint as a skill of kind `constraint`: its data in scripts/constraint.json."""
    spec = mined.spec
    body = (
        f"Argument constraints on `{spec.tool}`: ratchet writes them into the tool's schema before "
        "each model call, so constrained decoding can only produce arguments of the shape every "
        f"successful call had (its data is scripts/constraint.json).\n\n{describe(spec)}"
    )
    return Skill(
        name=spec.name,
        description=f"argument constraints for {family}: {spec.tool}({', '.join(spec.args)})",
        body=body,
        kind="constraint",
        family=family,
        evolution=evolution,
        generation=generation,
        provenance=list(mined.trajectory_ids),
        constraint=spec,
    )


def describe(spec: ConstraintSpec) -> str:
    """One line per argument, for a person (the skill's body)."""
    lines = []
    for arg, rule in spec.args.items():
        parts = []
        if rule.from_context:
            parts.append("copied from the task or a result already seen")
        if rule.integer:
            parts.append("a whole number")
        if rule.max_length:
            parts.append(f"at most {rule.max_length} characters")
        lines.append(f"- `{arg}`: {', '.join(parts)}")
    return "\n".join(lines)
