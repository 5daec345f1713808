"""Argument constraints: executable interventions for tools that have no menu.

A rule acts on a menu of valid actions; a tool with free arguments (`get_weather(city)`, an
answer to write) has none, and a small model fills such arguments with whatever its
sampling makes: a city the user never named, a currency it always guesses, a runaway
string. A constraint (`ratchet.types.ConstraintSpec`, one per family, covering each tool
its successes called) is data mined from successful train calls and written into the
tools' JSON schemas before each model call, so constrained decoding can only produce
arguments of the shape that succeeded:

* `from_context`: every successful value (all but one, from `ONE_MISS_FROM` on) was words the
  agent had read (the task, or a result seen earlier in the episode). The argument becomes
  an `enum` of the spans (1 to `SPAN_WORDS` words) of what it has read so far, kept to the
  `shape` the copied words had in the text (all capitals: `EUR`; each word capitalized:
  `New York`) and to their length where every success had the same one (a code); a number
  argument, an `enum` of its numbers. Where there would be more than `ENUM_MAX` values the
  argument is left as it was.
* `whole_line`: every successful string (all but one, as above) was a whole line of what the
  agent had read, its list marker dropped (`lines`): one of a tool result's listed items (a
  path, an id, a title: not words alone, so no span holds it) or a premise restated
  (`(Q ∧ P)` of "2. (Q ∧ P)"). The `enum` is those lines. Where the values were both lines
  and spans, lines win, as the narrower menu.
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
from functools import cached_property
from typing import Any

from ratchet.skills.format import Skill
from ratchet.skills.rule_mining import is_train, rule_name
from ratchet.skills.rules import WILDCARD
from ratchet.types import ArgConstraint, ConstraintSpec, ToolSpec, Trajectory, family_of

SPAN_WORDS = 4  # the longest span of words a from-context string may be
ENUM_MAX = 400  # more candidate values than this, and the argument is not narrowed
MIN_TASKS = 2  # a constraint needs successful calls from this many distinct train tasks
ONE_MISS_FROM = 6  # from this many successful values on, one not copied still binds (`_copied`)
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


# a list's marker: "1. ", "2) ", ".3. " (reasoning-gym's), "- ", "* "; not "-5" or "./a"
_LIST_MARK = re.compile(r"^\s*(?:\.?\d+[.)]|[-*•])(?=\s|$)\s*")


def lines(texts: Sequence[str]) -> list[str]:
    """Every non-empty line of each text, its list marker ("1.", "- ") and outer spaces
    dropped and inner runs of spaces made one, first occurrence first."""
    out: dict[str, None] = {}
    for text in texts:
        for line in text.splitlines():
            if seg := " ".join(_LIST_MARK.sub("", line).split()):
                out.setdefault(seg, None)
    return list(out)


def numbers(texts: Sequence[str]) -> list[float | int]:
    """The numbers written in `texts`, first occurrence first (whole ones as int)."""
    out: dict[float | int, None] = {}
    for text in texts:
        for m in _NUMBER.findall(text):
            v = float(m)
            out.setdefault(int(v) if v.is_integer() else v, None)
    return list(out)


def _number_read(value: Any, texts: Sequence[str]) -> bool:
    """Whether a number value is one of the numbers `texts` write (a bool is no number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return any(abs(value - n) < 1e-9 for n in numbers(texts))


def _copied(read: Sequence[bool]) -> bool:
    """Whether an argument's successful values were copied from what the agent read: all of
    them, or all but one of at least `ONE_MISS_FROM`. A small model's successes include a
    value the task accepted though it was not copied ("meter" for the question's "meters");
    one such success among many does not unbind the argument (the constraint then makes the
    model copy there too, and the gate judges whether that costs anything)."""
    misses = len(read) - sum(read)
    return misses == 0 or (misses == 1 and len(read) >= ONE_MISS_FROM)


def _as_read(value: Any, texts: Sequence[str]) -> str | None:
    """The span of `texts` a string value copied (compared without case), as written there."""
    if not isinstance(value, str) or not value.strip():
        return None
    want = " ".join(_words(value)).lower()
    if not want or want != value.strip().lower():
        return None
    return next((s for s in spans(texts) if s.lower() == want), None)


def _as_line(value: Any, texts: Sequence[str]) -> str | None:
    """The line of `texts` (`lines`) a string value restated whole, spaces aside."""
    if not isinstance(value, str) or not (want := " ".join(value.split())):
        return None
    return want if want in lines(texts) else None


# ------------------------------------------------------------------------------ applying

_SHAPES = {
    "upper": re.compile(r"[A-Z]+"),
    "title": re.compile(r"[A-Z][^\s\d]*(?: [A-Z][^\s\d]*)*"),
}


def shape_of(values: Sequence[str]) -> str | None:
    """The narrowest shape every value has (`ArgConstraint.shape`), or None."""
    for name, rx in _SHAPES.items():
        if values and all(rx.fullmatch(v.strip()) for v in values):
            return name
    return None


def _narrow(prop: dict[str, Any], rule: ArgConstraint, found: _Read) -> dict[str, Any]:
    """One argument's schema `prop` under `rule` (a copy; `prop` itself is not changed)."""
    new = dict(prop)
    kind = prop.get("type")
    if rule.from_context and kind == "string":
        lo = max(prop.get("minLength", 0), rule.min_length or 0)
        hi = min(prop.get("maxLength", 1 << 30), rule.max_length or 1 << 30)  # the bound set below
        shape = _SHAPES.get(rule.shape or "")
        read = found.lines if rule.whole_line else found.spans
        fits = [  # the schema's own bounds hold, and the shape successes had
            v for v in read if lo <= len(v) <= hi and (shape is None or shape.fullmatch(v))
        ]
        if 0 < len(fits) <= ENUM_MAX:
            new["enum"] = fits
    elif rule.from_context and kind in ("number", "integer"):
        whole = kind == "integer" or rule.integer
        values = [n for n in found.numbers if not whole or isinstance(n, int)]
        if 0 < len(values) <= ENUM_MAX:
            new["enum"] = values
    if rule.max_length and kind == "string" and rule.max_length < prop.get("maxLength", 1 << 30):
        new["maxLength"] = rule.max_length
    if rule.integer and kind == "number":
        new["type"] = "integer"
    return new


class _Read:
    """What the agent has read, split into spans and numbers once, when first asked."""

    def __init__(self, context: Sequence[str]) -> None:
        self.context = context

    @cached_property
    def spans(self) -> list[str]:
        return spans(self.context)

    @cached_property
    def lines(self) -> list[str]:
        return lines(self.context)

    @cached_property
    def numbers(self) -> list[float | int]:
        return numbers(self.context)


def constrain_args(
    tools: Sequence[ToolSpec], constraints: Sequence[ConstraintSpec], context: Sequence[str]
) -> tuple[list[ToolSpec], list[str]]:
    """`tools` with each constraint written into the parameters of the tools it names, and
    the names of the constraints that changed one. `context` is what the agent has read: the
    task, then the observations so far. An argument with an `enum` already is left alone."""
    if not constraints:
        return list(tools), []
    found = _Read(context)
    ordered = sorted(constraints, key=lambda c: c.name)
    out: list[ToolSpec] = []
    fired: dict[str, None] = {}
    for tool in tools:
        props = dict(tool.parameters.get("properties") or {})
        changed = False
        for c in ordered:
            for arg, rule in c.tools.get(tool.name, {}).items():
                prop = props.get(arg)
                if not isinstance(prop, dict) or "enum" in prop:
                    continue
                new = _narrow(prop, rule, found)
                if new != prop:
                    props[arg], changed = new, True
                    fired[c.name] = None
        params = tool.parameters | {"properties": props}
        out.append(tool.model_copy(update={"parameters": params}) if changed else tool)
    return out, list(fired)


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
    """The family's constraint (none, or one covering every free tool, `free_tools`, that
    its train successes called from at least `MIN_TASKS` distinct tasks), holding what every
    successful call of a tool had in common (module docstring). One candidate per family,
    not one per tool: each tool is called on a part of the family's tasks only, and the gate
    judges a candidate on all of them.

    The suite's reference solutions (`kind == "expert"`) count: a constraint says what
    shape an argument has, which a reference call shows as well as the policy's own, and on
    a tool the policy almost never calls right (a currency conversion whose source it always
    guesses) they are all the evidence there is; the gate still decides on the policy's own
    dev rollouts. Failures, other splits and other families are not read."""
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
    tools: dict[str, dict[str, ArgConstraint]] = {}
    for tool, made in sorted(calls.items()):
        if len({task for task, _, _ in made}) < MIN_TASKS:
            continue
        args = {
            arg: rule
            for arg in sorted(set.intersection(*(set(a) for _, a, _ in made)))
            if (rule := _mine_arg([(a[arg], ctx) for _, a, ctx in made])) is not None
        }
        if args:
            tools[tool] = args
    if not tools:
        return []
    spec = ConstraintSpec(name=rule_name(family, "args"), tools=tools)
    return [MinedConstraint(spec, tuple(sorted(i for tool in tools for i in ids[tool])))]


def _mine_arg(calls: Sequence[tuple[Any, list[str]]]) -> ArgConstraint | None:
    """What every successful value of one argument had in common (each with what the agent
    had read when it wrote it), or None when nothing."""
    values = [v for v, _ in calls]
    if all(isinstance(v, str) for v in values):
        lengths = {len(v.strip()) for v in values}
        # the shape of what was copied, as the text wrote it: a success may have lowercased
        # "Paris" (the suite compared without case), the enum offers the text's spelling
        read = [_as_read(v, ctx) for v, ctx in calls]
        whole = [_as_line(v, ctx) for v, ctx in calls]
        if _copied([w is not None for w in whole]):  # the narrower menu of the two
            return ArgConstraint(from_context=True, whole_line=True, max_length=max(2 * max(lengths), 8))
        from_context = _copied([r is not None for r in read])
        return ArgConstraint(
            from_context=from_context,
            max_length=max(2 * max(lengths), 8),
            # only a fixed length (a code: EUR, USD) is a format; the shortest of some cities
            # is not a bound, and would take "Rome" off a menu built from "Lima" and "Oslo"
            min_length=lengths.pop() if from_context and len(lengths) == 1 else None,
            shape=shape_of([r for r in read if r is not None]) if from_context else None,
        )
    from_context = _copied([_number_read(v, ctx) for v, ctx in calls])
    whole = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    return ArgConstraint(from_context=from_context, integer=whole) if from_context or whole else None


def constraint_skill(family: str, mined: MinedConstraint, evolution: str, generation: int) -> Skill:
    """A mined constraint as a skill of kind `constraint`: its data in scripts/constraint.json."""
    spec = mined.spec
    body = (
        "Argument constraints: ratchet writes them into each tool's schema before each model "
        "call, so constrained decoding can only produce arguments of the shape every successful "
        f"call had (its data is scripts/constraint.json).\n\n{describe(spec)}"
    )
    calls = ", ".join(f"{tool}({', '.join(args)})" for tool, args in spec.tools.items())
    return Skill(
        name=spec.name,
        description=f"argument constraints for {family}: {calls}",
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
    for tool, args in spec.tools.items():
        for arg, rule in args.items():
            parts = []
            if rule.from_context:
                what = "a whole line" if rule.whole_line else "copied"
                parts.append(f"{what} from the task or a result already seen")
            if rule.shape:
                parts.append({"upper": "in capitals", "title": "each word capitalized"}[rule.shape])
            if rule.min_length:
                parts.append(f"at least {rule.min_length} characters")
            if rule.integer:
                parts.append("a whole number")
            if rule.max_length:
                parts.append(f"at most {rule.max_length} characters")
            lines.append(f"- `{tool}.{arg}`: {', '.join(parts)}")
    return "\n".join(lines)
