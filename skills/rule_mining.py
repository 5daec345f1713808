"""Mined action rules: what the loop's own evidence says to do, or not, at a menu of actions.

Procedures and guardrails are prose a small policy may ignore; a rule (`RuleSpec`) is data
applied to the menu of valid actions before the model chooses (`ratchet.skills.rules`), so
it acts whatever the model makes of it. Rules are mined here without any model call, from
evidence the diagnose stage already computed, one family at a time and from the train split
only: dev and test trajectories and diagnoses are dropped here, whatever the caller passes
(they are the gate's and the report's, never evidence).

Evidence is counted in distinct *tasks*: many rollouts of one task are one piece of evidence.

* **prefer** — a failure's attribution says what successful runs did where the failure left
  every successful path (its first alternative, the most common). An alternative that recurs
  in at least `min_tasks` tasks becomes a `prefer` pattern. Alternatives are grouped by shape
  as mined patterns are (`skills/mining.py`: tool, first word, word count); inside a group,
  words that differ become `*` (a run of them one `*`) provided a word after the tool stays
  constant and no varying word carries punctuation; a group that cannot be generalized, or
  whose generalization is dropped, falls back to its single actions. A pattern that matches
  the failures' own action at the divergence in more than `TAKEN_SHARE` as many tasks is
  dropped: it does not tell successes from failures. So is one that mostly changed nothing
  where successful runs took it (`NOOP_SHARE`: the next observation was the same, as after
  'look around'): preferred whenever it is on the menu, it would be a loop. A rule's `when`
  is the pattern's constant words that occur, as words, in the raw observation (without the
  options text) of every state it should have acted at, less the words found in every state
  of the family (they narrow nothing); empty when a state's raw observation cannot be told
  from its options.
* **prefer a tool** — where the failures' action at the divergence was a call of another
  tool than the successful runs' alternative (answering where successes calculated first),
  in at least `min_tasks` tasks: prefer every call of that tool (`calculator: *`, the menu
  entry of a tool without enumerated actions, `skills/rules.py`), when the observation has
  the words (at least 4 letters, at most `WHEN_MAX`) that every supporting state has and not
  every state of the family has: the rule picks the tool at such a state and lets go after.
  Where the states share no such word (one request in several phrasings), they are split
  greedily by the word found in the most tasks' states, one rule per group of `min_tasks`
  tasks or more. A `when` must be specific: words found where successful runs called another
  tool, in more than `TAKEN_SHARE` as many tasks as the rule acts for, are passed over ('what'
  of "What is the UTC offset of ..." is also in "What is the weather in ...").
  Only for a tool no kept pattern already covers; dropped like a pattern
  when failures called the tool where successes called another one too often (a failure
  that called it with wrong arguments where successes called it too is no evidence
  against choosing it).
* **avoid** — an action failures took at the divergence in at least `min_tasks` tasks whose
  successful runs are among the trajectories given, when no successful trajectory of the
  family took it, nor any action of its shape, anywhere (stricter than "from a matching
  state": `move south` where successes moved north is a task's particular, not a rule).
  When no successful run called the tool at all, the rule avoids the whole tool
  (`calculator: *`) instead of the calls seen.
* **no-repeat** — failures filed as `stagnation` in at least `min_tasks` tasks.

Each rule is only a candidate: verify A/B-gates it on the family's dev tasks, so the miner
proposes few, well-supported rules (at most `top`, ranked by support) and promises nothing.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from ratchet.diagnosis.attribution import normalize_action, state_key
from ratchet.hashing import content_hash
from ratchet.skills.rules import WILDCARD, matches, tool_entry
from ratchet.types import Diagnosis, RuleSpec, Trajectory, family_of, parse_task_id

TAKEN_SHARE = 0.25  # a prefer pattern the failures took in more than this share as many tasks is dropped
NOOP_SHARE = 0.5  # ... and one that left the state as it was in more than this share of its successful uses
WHEN_MAX = 4  # words a tool-choice rule's `when` keeps (the first seen)
NAME_MAX = 64
NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_KIND_ORDER = {"prefer": 0, "prefer-tool": 0, "avoid": 1, "no-repeat": 2}


@dataclass(frozen=True)
class MinedRule:
    """A candidate rule with its evidence: `support` distinct train tasks, the trajectories it came from."""

    spec: RuleSpec
    kind: str  # "prefer", "prefer-tool", "avoid" or "no-repeat"
    description: str
    support: int  # distinct train tasks of evidence (the ranking key)
    trajectory_ids: tuple[str, ...]  # failures first, then successes, each sorted

    @property
    def name(self) -> str:
        return self.spec.name


def is_train(task_id: str) -> bool:
    """Whether a task id is of the train split (a malformed id is not)."""
    try:
        return parse_task_id(task_id)[2] == "train"
    except ValueError:
        return False


def raw_observation(traj: Trajectory, index: int) -> str | None:
    """What the environment said before step `index`, without the options the actor appended
    (`join_options`): the last tool result before it (the first observation for the first
    action), if the step's observation starts with it; None when they cannot be told apart."""
    pos = next((i for i, s in enumerate(traj.steps) if s.index == index), None)
    return None if pos is None else _raw_at(traj, pos)


def _raw_at(traj: Trajectory, pos: int) -> str | None:
    prev = next((s for s in reversed(traj.steps[:pos]) if s.tool_call is not None), None)
    if prev is not None:
        text = prev.tool_result
    elif traj.prompt is not None:
        text = traj.prompt.first_observation
    else:
        return None
    return text if traj.steps[pos].observation.startswith(text) else None


def rule_name(family: str, kind: str, pattern: str = "") -> str:
    """`<subset>-<kind>[-<pattern words>]`, `*` read as 'any', at most NAME_MAX characters."""
    subset = family.split(":", 1)[-1]
    tool, sep, rest = pattern.partition(": ")
    words = rest.split() if sep else tool.split()
    if words and all(w == WILDCARD for w in words):  # every call of a tool: named by the tool
        words = tool.split()
    words = ["any" if w == WILDCARD else w for w in words]
    name = _slug("-".join([subset, kind, *words])) or "rule"
    if len(name) > NAME_MAX:
        name = name[: NAME_MAX - 9].rstrip("-") + "-" + content_hash([family, kind, pattern], length=8)
    return name


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def mine_rules(
    family: str,
    trajectories: Sequence[Trajectory],
    diagnoses: Sequence[Diagnosis],
    min_tasks: int = 3,
    top: int = 5,
) -> list[MinedRule]:
    """Candidate rules for one family from its train trajectories and their diagnoses, best
    supported first (deterministic: the same evidence in any order gives the same rules)."""
    if min_tasks < 1:
        raise ValueError("min_tasks must be at least 1")
    trajs = sorted(
        (
            t
            for t in trajectories
            if t.split == "train" and is_train(t.task_id) and family_of(t.task_id) == family
        ),
        key=lambda t: t.id,
    )
    diags = sorted(
        (d for d in diagnoses if is_train(d.task_id) and family_of(d.task_id) == family),
        key=lambda d: d.trajectory_id,
    )
    successes = [t for t in trajs if t.success and t.status == "finished"]
    rules = _prefer_rules(family, trajs, successes, diags, min_tasks)
    rules += _avoid_rules(family, successes, diags, min_tasks)
    rules += _no_repeat_rule(family, diags, min_tasks)
    rules.sort(key=lambda r: (-r.support, _KIND_ORDER[r.kind], r.name))
    out: list[MinedRule] = []
    names: set[str] = set()
    for r in rules:
        if r.name in names:  # two tools' actions with the same words: keep both, apart
            name = f"{r.name[: NAME_MAX - 9].rstrip('-')}-{content_hash(r.spec.model_dump(), length=8)}"
            r = replace(r, spec=r.spec.model_copy(update={"name": name}))
        names.add(r.name)
        out.append(r)
    return out[:top]


# ------------------------------------------------------------------ prefer


def _shape(action: str) -> tuple[str, str, int]:
    tool, sep, rest = action.partition(": ")
    words = rest.split() if sep else []
    return (tool, words[0] if words else "", len(words))


def _generalize(actions: Sequence[str]) -> str | None:
    """One pattern for same-shape actions, `*` where words differ; None if nothing constant
    would stay after the tool or a differing word carries punctuation."""
    tool, _, _ = actions[0].partition(": ")
    rows = [a.partition(": ")[2].split() for a in actions]
    words: list[str] = []
    for column in zip(*rows, strict=True):
        if len(set(column)) == 1:
            words.append(column[0])
        elif any(not w.isalnum() for w in column):
            return None
        elif not words or words[-1] != WILDCARD:
            words.append(WILDCARD)
    if all(w == WILDCARD for w in words):
        return None
    return f"{tool}: {' '.join(words)}"


def _candidates(alts: dict[str, set[str]]) -> Iterable[tuple[str, list[str]]]:
    """(pattern, the alternatives it covers): per shape, the generalization first, then each action."""
    groups: dict[tuple[str, str, int], list[str]] = defaultdict(list)
    for alt in sorted(alts):
        groups[_shape(alt)].append(alt)
    for _, members in sorted(groups.items()):
        if len(members) > 1 and (pattern := _generalize(members)) is not None:
            yield pattern, members
        for alt in sorted(members, key=lambda a: (-len(alts[a]), a)):
            yield alt, [alt]


def _prefer_rules(
    family: str,
    trajs: list[Trajectory],
    successes: list[Trajectory],
    diags: list[Diagnosis],
    min_tasks: int,
) -> list[MinedRule]:
    by_alt: dict[str, list[Diagnosis]] = defaultdict(list)
    taken: dict[str, set[str]] = defaultdict(set)  # the failures' action at the divergence -> tasks
    for d in diags:
        a = d.attribution
        if a is None:
            continue
        taken[a.taken].add(d.task_id)
        if a.alternatives and a.alternatives[0] != a.taken:
            by_alt[a.alternatives[0]].append(d)
    alt_tasks = {alt: {d.task_id for d in ds} for alt, ds in by_alt.items()}
    by_id = {t.id: t for t in trajs}
    background = [o for t in trajs for i in range(len(t.steps)) if (o := _raw_at(t, i)) is not None]
    out: list[MinedRule] = []
    covered: set[str] = set()  # alternatives already in a kept pattern
    for pattern, members in _candidates(alt_tasks):
        if covered.intersection(members):
            continue
        support = [d for m in members for d in by_alt[m]]
        tasks = {d.task_id for d in support}
        if len(tasks) < min_tasks:
            continue
        also_taken = {task for action, ts in taken.items() if matches(pattern, action) for task in ts}
        if len(also_taken) > TAKEN_SHARE * len(tasks):
            continue
        if _mostly_noop(pattern, [t for t in successes if t.task_id in tasks]):
            continue
        covered.update(members)
        states = [_state(by_id.get(d.trajectory_id), d) for d in support]
        when = _when(pattern, states, background)
        failed, wins, instead = _evidence(pattern, support, successes, tasks)
        shown = ", ".join(f"`{m}`" for m in members[:4]) + (", ..." if len(members) > 4 else "")
        where = f" and the observation mentions {' and '.join(repr(w) for w in when)}" if when else ""
        description = (
            f"Prefer `{pattern}`: when an action it matches is among the valid actions{where}, "
            f"choose among those only. Evidence from {family} train runs: in {len(tasks)} tasks, "
            f"{len(failed)} failed runs left every successful path by taking something else "
            f"(most often `{instead}`) where successful runs took {shown}; failures took it "
            f"there in {len(also_taken)} tasks."
        )
        spec = RuleSpec(name=rule_name(family, "prefer", pattern), prefer=(pattern,), when=when)
        out.append(MinedRule(spec, "prefer", description, len(tasks), tuple(failed + wins)))
    return out + _prefer_tool_rules(family, by_alt, taken, covered, by_id, successes, background, min_tasks)


def _tool(action: str) -> str:
    return action.partition(": ")[0]


def _evidence(
    pattern: str,
    support: list[Diagnosis],
    successes: list[Trajectory],
    tasks: set[str],
    shown: Callable[[str], str] = str,
) -> tuple[list[str], list[str], str]:
    """A prefer rule's evidence: the failed runs, the successful runs of its tasks that took
    an action the pattern matches, and what the failures most often did instead."""
    failed = sorted({d.trajectory_id for d in support})
    wins = sorted(
        t.id for t in successes if t.task_id in tasks and any(matches(pattern, a) for a in _acted(t))
    )
    instead = Counter(shown(d.attribution.taken) for d in support).most_common(1)[0][0]  # type: ignore[union-attr]
    return failed, wins, instead


def _prefer_tool_rules(
    family: str,
    by_alt: dict[str, list[Diagnosis]],
    taken: dict[str, set[str]],
    covered: set[str],
    by_id: dict[str, Trajectory],
    successes: list[Trajectory],
    background: list[str],
    min_tasks: int,
) -> list[MinedRule]:
    """Prefer a tool where failures called another one and successful runs called it."""
    by_tool: dict[str, list[Diagnosis]] = defaultdict(list)
    for alt, ds in by_alt.items():
        if alt in covered:
            continue
        by_tool[_tool(alt)] += [d for d in ds if _tool(d.attribution.taken) != _tool(alt)]  # type: ignore[union-attr]
    out: list[MinedRule] = []
    for tool, support in sorted(by_tool.items()):
        tasks = {d.task_id for d in support}
        if len(tasks) < min_tasks:
            continue
        has_args = any(": " in a for a in by_alt if _tool(a) == tool)
        pattern = tool_entry(tool, has_args)
        # against forcing the tool: failures that called it where successes called another one
        # (a failure that called it with wrong arguments where successes called it too says
        # nothing about the choice of tool), counted below where the rule would act
        against = [  # each with the state it acted on (None: unknown, counted wherever)
            (d.task_id, _state(by_id.get(d.trajectory_id), d))
            for alt, ds in by_alt.items()
            if _tool(alt) != tool
            for d in ds
            if _tool(d.attribution.taken) == tool  # type: ignore[union-attr]
        ]
        states = [_state(by_id.get(d.trajectory_id), d) for d in support]
        elsewhere = _other_tool_states(tool, successes)
        # one rule per group of states that share words: a tool asked for in several phrasings
        # ("Which time zone is ...", "What is the UTC offset of ...") gets one per phrasing; a
        # group with no word of its own is dropped (forced at every state, the tool would be
        # all the policy ever calls)
        groups = _word_groups(support, states, background, min_tasks, elsewhere)
        for when, group in groups:
            tasks = {d.task_id for d in group}
            also_taken = {task for task, seen in against if seen is None or set(when) <= _words(seen)}
            if len(also_taken) > TAKEN_SHARE * len(tasks):
                continue
            forced_wrong = _tasks_matching(when, elsewhere)
            failed, wins, instead = _evidence(pattern, group, successes, tasks, _tool)
            description = (
                f"Prefer the tool `{tool}`: when the observation mentions "
                f"{' and '.join(repr(w) for w in when)}, call `{tool}` rather than another tool. "
                f"Evidence from {family} train runs: in {len(tasks)} tasks, {len(failed)} failed runs "
                f"called `{instead}` where successful runs called `{tool}`; failures called it where "
                f"successful runs called another tool in {len(also_taken)} tasks, and successful "
                f"runs called another tool at a state with these words in {len(forced_wrong)}."
            )
            # one group keeps the tool's name; several are told apart by their words
            name = rule_name(family, "prefer", pattern if len(groups) == 1 else f"{tool} {' '.join(when)}")
            spec = RuleSpec(name=name, prefer=(pattern,), when=when)
            out.append(MinedRule(spec, "prefer-tool", description, len(tasks), tuple(failed + wins)))
    return out


def _word_groups(
    support: list[Diagnosis],
    states: list[str | None],
    background: list[str],
    min_tasks: int,
    elsewhere: list[tuple[str, set[str]]],
) -> list[tuple[tuple[str, ...], list[Diagnosis]]]:
    """The supporting diagnoses as groups whose states share words (`_state_words`): all of
    them if they do and those words are specific (`_specific`); else, greedily, the specific
    word (4+ letters, not in every state of the family) found in the states of the most
    tasks, with those states' shared words, then the same for the rest, while a group holds
    `min_tasks` tasks. () if any state is unknown.

    Specific, because a `when` acts wherever its words are: 'what' is in the time-zone
    request "What is the UTC offset of ..." and in "What is the weather in ...", so a
    time-zone rule on 'what' would force the wrong tool on weather requests, where one on
    'offset' would not."""
    if any(s is None for s in states):
        return []
    whole = _state_words(states, background)
    if whole and _specific(whole, {d.task_id for d in support}, elsewhere):
        return [(whole, support)]
    everywhere = _everywhere(background)
    left = list(zip(support, [str(s) for s in states], strict=True))
    out: list[tuple[tuple[str, ...], list[Diagnosis]]] = []
    while left:
        tasks_with: dict[str, set[str]] = defaultdict(set)
        for d, s in left:
            for w in _words(s) - everywhere:
                if _when_word(w):
                    tasks_with[w].add(d.task_id)
        specific = [w for w in sorted(tasks_with) if _specific((w,), tasks_with[w], elsewhere)]
        if not specific:
            break
        best = max(specific, key=lambda w: len(tasks_with[w]))
        if len(tasks_with[best]) < min_tasks:
            break
        group = [(d, s) for d, s in left if best in _words(s)]
        when = _state_words([s for _, s in group], background)
        if best not in when:  # more shared words than a `when` keeps: keep the chosen one
            when = when[: WHEN_MAX - 1] + (best,)
        out.append((when, [d for d, _ in group]))
        left = [(d, s) for d, s in left if best not in _words(s)]
    return out


def _other_tool_states(tool: str, successes: list[Trajectory]) -> list[tuple[str, set[str]]]:
    """(task, the words of the raw observation) wherever a successful run called another tool
    than `tool`: a rule for `tool` acting there would force the wrong call."""
    out: list[tuple[str, set[str]]] = []
    for t in successes:
        for pos, step in enumerate(t.steps):
            action = normalize_action(step)
            if action is None or _tool(action) == tool:
                continue
            if (raw := _raw_at(t, pos)) is not None:
                out.append((t.task_id, _words(raw)))
    return out


def _tasks_matching(when: tuple[str, ...], states: list[tuple[str, set[str]]]) -> set[str]:
    """The tasks of the states that hold every word of `when` (where a rule would act)."""
    return {task for task, words in states if set(when) <= words}


def _specific(when: tuple[str, ...], tasks: set[str], elsewhere: list[tuple[str, set[str]]]) -> bool:
    """Whether a `when` acting for `tasks` acts where successful runs called another tool in
    at most `TAKEN_SHARE` as many tasks."""
    return len(_tasks_matching(when, elsewhere)) <= TAKEN_SHARE * len(tasks)


def _state_words(states: list[str | None], background: list[str]) -> tuple[str, ...]:
    """Words (4+ letters) in every state, less those in every state of the family, at most
    WHEN_MAX, in the first state's order; () if any state is unknown."""
    if not states or any(s is None for s in states):
        return ()
    common = set.intersection(*(_words(s) for s in states if s is not None)) - _everywhere(background)
    first = re.findall(r"[a-z0-9]+", str(states[0]).lower())
    words = [w for w in dict.fromkeys(first) if w in common and _when_word(w)]
    return tuple(words[:WHEN_MAX])


def _everywhere(background: list[str]) -> set[str]:
    """Words in every state of the family: they tell no state from another."""
    return set.intersection(*(_words(b) for b in background)) if background else set()


def _when_word(word: str) -> bool:
    """A word a tool-choice rule's `when` may hold: letters only, 4 or more."""
    return word.isalpha() and len(word) >= 4


def _mostly_noop(pattern: str, successes: list[Trajectory]) -> bool:
    """Whether successful runs mostly saw the same observation again after an action the pattern
    matches ('look around'): preferring such an action, always on the menu, is a loop."""
    uses = noops = 0
    for t in successes:
        for s, after in zip(t.steps, t.steps[1:] + [None], strict=True):
            action = normalize_action(s)
            if action is None or not matches(pattern, action):
                continue
            uses += 1
            noops += after is not None and state_key(after) == state_key(s)
    return uses > 0 and noops > NOOP_SHARE * uses


def _state(traj: Trajectory | None, d: Diagnosis) -> str | None:
    """The raw observation the failure acted on at its divergence, if known."""
    if traj is None or d.attribution is None:
        return None
    return raw_observation(traj, d.attribution.step)


def _acted(traj: Trajectory) -> list[str]:
    return [a for s in traj.steps if (a := normalize_action(s)) is not None]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _when(pattern: str, states: list[str | None], background: list[str]) -> tuple[str, ...]:
    """The pattern's constant words found in every supporting state's raw observation, less
    those found in every state of the family; () if any supporting state is unknown."""
    if not states or any(s is None for s in states):
        return ()
    rest = pattern.partition(": ")[2] if ": " in pattern else ""
    wanted = list(dict.fromkeys(w for token in rest.split() if token != WILDCARD for w in _words(token)))
    seen = [_words(s) for s in states if s is not None]
    everywhere = _everywhere(background)
    return tuple(w for w in wanted if all(w in s for s in seen) and w not in everywhere)


# ------------------------------------------------------------------ avoid, no-repeat


def _avoid_rules(
    family: str, successes: list[Trajectory], diags: list[Diagnosis], min_tasks: int
) -> list[MinedRule]:
    done_by_wins = {_shape(a) for t in successes for a in _acted(t)}
    tools_of_wins = {_tool(a) for t in successes for a in _acted(t)}
    known = {t.task_id for t in successes}  # tasks whose successful runs are here to compare against
    by_taken: dict[str, list[Diagnosis]] = defaultdict(list)
    for d in diags:
        if (
            d.attribution is not None
            and d.task_id in known
            and _shape(d.attribution.taken) not in done_by_wins
        ):
            by_taken[d.attribution.taken].append(d)
    by_tool: dict[str, list[Diagnosis]] = defaultdict(list)  # tools no successful run ever called
    for action in [a for a in by_taken if _tool(a) not in tools_of_wins]:
        by_tool[tool_entry(_tool(action), ": " in action)] += by_taken.pop(action)
    out = []
    for action, ds in sorted(by_taken.items()) + sorted(by_tool.items()):
        tasks = {d.task_id for d in ds}
        if len(tasks) < min_tasks:
            continue
        failed = sorted({d.trajectory_id for d in ds})
        what = f"the tool `{_tool(action)}`" if action in by_tool else f"`{action}`"
        description = (
            f"Avoid {what}: take it off the valid actions. Evidence from {family} train runs: "
            f"in {len(tasks)} tasks, {len(failed)} failed runs left every successful path by taking "
            f"it, and none of {len(successes)} successful runs ever took it or an action like it."
        )
        spec = RuleSpec(name=rule_name(family, "avoid", action), avoid=(action,))
        out.append(MinedRule(spec, "avoid", description, len(tasks), tuple(failed)))
    return out


def _no_repeat_rule(family: str, diags: list[Diagnosis], min_tasks: int) -> list[MinedRule]:
    stuck = [d for d in diags if d.mode == "stagnation"]
    tasks = {d.task_id for d in stuck}
    if len(tasks) < min_tasks:
        return []
    failed = sorted({d.trajectory_id for d in stuck})
    description = (
        "No repeats: at an observation already seen in this episode, do not take an action "
        f"already taken from there. Evidence from {family} train runs: {len(failed)} failed runs "
        f"in {len(tasks)} tasks were filed as stagnation (a repeated action loop or a revisited "
        "observation)."
    )
    spec = RuleSpec(name=rule_name(family, "no-repeat"), no_repeat=True)
    return [MinedRule(spec, "no-repeat", description, len(tasks), tuple(failed))]
