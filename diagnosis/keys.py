"""What failed, without the task's own values: the key failure clusters are built on.

`Diagnosis.summary()` quotes actions with their arguments. On a suite whose tasks are one
call each (function calling, one answer per question), `get_weather(city="Paris")` failing
on one task and `get_weather(city="Rome")` on another are the same mistake, but their
summaries embed apart: 16 such failures made 8 clusters of 2, none large enough for a
guardrail. A `FailureKey` names what failed instead, in three parts:

* `group`, matched exactly: the mode, the tool called at the diagnosed step ('' for no
  tool call), and for the modes that are about an error (`ERROR_MODES`) the error's class.
  A cluster never mixes tools or error classes: texts equal but for a tool's name embed
  close together, so keeping tools apart is the key's job, not the similarity threshold's.
* `refinement`, matched exactly when known: the tool successful runs of the task called
  there and which arguments the failure got wrong against that call (`missing unit`,
  `extra foo`, `wrong city`: names, never values). The reference call is the
  attribution's first alternative; a rejected call (which attribution skips, since it
  changed nothing) is compared with what successes did from the same state. A failure with
  no successful run to compare with has no refinement (None): it may join any cluster of
  its group, by similarity, where one with a refinement joins only clusters with the same
  (`diagnosis/clusters.py`). Splitting on "no reference" would split a task nobody solved
  from the same mistake on solved ones (three coin loops, one on an unsolved task).
* `text`, embedded and clustered by similarity inside a group: the summary with the task's
  own values masked (`diagnosis/values.py`: the words only one task of the family uses,
  numbers, quoted values; the judge's cause too).

What changes for text games (TextWorldExpress coin), deliberately: the group adds only the
tool (always `act`, so nothing) and, for invalid actions, the error class ("<v> is not a
valid action now" apart from "no tool call": they need different guardrails); their
refinement is always `wrong action` (of `act`) or unknown, which splits nothing. Moves
and objects recur across tasks, so they stay in the text and game clusters still split by
what was done; step numbers and counts are `#` (where in an episode is not what went
wrong), and words a single task uses (a room only one layout has, or, in a family of a
few tasks, a move only one of them made) are `<v>`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ratchet.diagnosis.attribution import normalize_action, state_key
from ratchet.diagnosis.values import Vocabulary, error_class, mask
from ratchet.types import Diagnosis, Step, ToolCall, Trajectory, family_of

ERROR_MODES = ("invalid_action", "tool_error", "environment_error")


@dataclass(frozen=True)
class FailureKey:
    subset: str
    mode: str
    tool: str  # called at the diagnosed step ('' = no tool call)
    error: str  # error class ('' outside ERROR_MODES)
    refinement: tuple[str, tuple[str, ...]] | None  # (tool successes called, argument problems)
    text: str  # what is embedded: the summary, values masked

    @property
    def group(self) -> tuple[str, str, str]:
        return (self.mode, self.tool, self.error)

    @property
    def expected(self) -> str:
        return self.refinement[0] if self.refinement else ""

    @property
    def arguments(self) -> tuple[str, ...]:
        return self.refinement[1] if self.refinement else ()

    def describe(self) -> str:
        """One line for people and the guardrail writer: 'wrong answer; called get_weather; missing unit'."""
        parts = [self.mode.replace("_", " "), f"called {self.tool}" if self.tool else "no tool call"]
        if self.expected and self.expected != self.tool:
            parts.append(f"successful runs called {self.expected}")
        parts.extend(self.arguments)
        if self.error:
            parts.append(f"error: {self.error}")
        return "; ".join(parts)


def failure_keys(diagnoses: Sequence[Diagnosis], trajectories: Iterable[Trajectory]) -> list[FailureKey]:
    """One key per diagnosis. `trajectories`: the generation's (train) trajectories, the
    failures themselves and the successes they are compared with; a diagnosis whose
    trajectory is missing is keyed from its attribution alone."""
    trajs = list(trajectories)
    by_id = {t.id: t for t in trajs}
    successes: dict[str, list[Trajectory]] = defaultdict(list)
    families: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        families[family_of(t.task_id)].append(t)
        if t.success and t.status == "finished":
            successes[t.task_id].append(t)
    vocabs = {f: Vocabulary.of(families[f]) for f in {family_of(d.task_id) for d in diagnoses}}
    return [
        failure_key(d, by_id.get(d.trajectory_id), successes[d.task_id], vocabs[family_of(d.task_id)])
        for d in diagnoses
    ]


def failure_key(
    d: Diagnosis, failure: Trajectory | None, successes: Sequence[Trajectory], vocab: Vocabulary
) -> FailureKey:
    summary = d.summary()
    head = f"{d.subset}: "
    text = head + mask(summary.removeprefix(head), vocab)
    step = _step(failure, d.step) if failure is not None else None
    if failure is None:  # keyed from the attribution alone
        taken = d.attribution.taken.split(": ", 1)[0] if d.attribution else ""
        return FailureKey(d.subset, d.mode, taken, "", None, text)
    call = step.tool_call if step is not None else None
    ref = _reference(d, step, successes)
    refinement = None
    if ref is not None:
        problems = _argument_problems(call, ref) if call is not None and call.name == ref.name else ()
        refinement = (ref.name, problems)
    tool = call.name if call is not None else ""
    return FailureKey(d.subset, d.mode, tool, _error(d, failure, vocab), refinement, text)


def cluster_key(keys: Sequence[FailureKey]) -> FailureKey | None:
    """The key a cluster's members share: its group, and the refinement any of them knows."""
    return next((k for k in keys if k.refinement is not None), keys[0] if keys else None)


def _error(d: Diagnosis, failure: Trajectory, vocab: Vocabulary) -> str:
    if d.mode not in ERROR_MODES:
        return ""
    if d.mode == "environment_error":
        return error_class(failure.error or "", vocab)
    at = next((s.step for s in d.signals if s.mode == d.mode), None)
    step = _step(failure, at)
    return error_class(step.error or "", vocab) if step is not None else ""


def _step(traj: Trajectory, index: int | None) -> Step | None:
    if index is None:
        return traj.steps[-1] if traj.steps else None
    return next((s for s in traj.steps if s.index == index), None)


def _reference(d: Diagnosis, step: Step | None, successes: Sequence[Trajectory]) -> ToolCall | None:
    """The call successful runs made where the failure went wrong, if any."""
    if step is None:
        return None
    state = state_key(step)
    a = d.attribution
    if a is not None and a.alternatives and a.step == step.index:
        want = a.alternatives[0]
        found = [
            (state_key(s) != state, s.tool_call)
            for t in successes
            for s in t.steps
            if s.tool_call is not None and normalize_action(s) == want
        ]
        found.sort(key=lambda f: f[0])  # the same state first
        return found[0][1] if found else None
    if step.error is None:
        return None
    seen: Counter[str] = Counter()
    calls: dict[str, ToolCall] = {}
    for t in successes:
        for s in t.steps:
            action = normalize_action(s)
            if action is not None and s.tool_call is not None and state_key(s) == state:
                seen[action] += 1
                calls.setdefault(action, s.tool_call)
    if not seen:
        return None
    best = min(seen.items(), key=lambda kv: (-kv[1], kv[0]))[0]
    return calls[best]


def _argument_problems(call: ToolCall, ref: ToolCall) -> tuple[str, ...]:
    got, want = _args(call), _args(ref)
    return (
        *(f"missing {k}" for k in sorted(want.keys() - got.keys())),
        *(f"extra {k}" for k in sorted(got.keys() - want.keys())),
        *(f"wrong {k}" for k in sorted(got.keys() & want.keys()) if got[k] != want[k]),
    )


def _args(call: ToolCall) -> dict[str, str]:
    return {k: " ".join(str(v).lower().split()) for k, v in call.args.items()}
