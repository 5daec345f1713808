"""Replaying a recorded trajectory under more rules: which rollouts a rule cannot change.

Verify plays every candidate against the champion on the same dev tasks, greedy, with the
same seeds. A candidate that only adds rules changes neither the prompt's skills nor the
model: it narrows the menu. Walk the champion's recorded (baseline) trajectory step by step
with the candidate's rules. If at no step the rules change what the model would have
answered, the candidate's rollout is the baseline's, call for call: the environment is
deterministic given the task and seed, so by induction over the steps the same calls meet
the same observations and end in the same outcome. Then verify stores that trajectory for
the candidate's arm (`Trajectory.replayed_from`) instead of playing it.

When a step is unchanged, precisely:

* **strict** (any endpoint): the rules leave exactly the menu the champion's rules left, so
  the request is byte for byte the one the champion sent;
* **loose** (`same_choice`, only for an endpoint that does not render enum values into the
  prompt, as ratchet's embedded server does not): the same tools remain, so the prompt is
  the same; the recorded call is still on the narrowed menu; and every enumerated tool keeps
  the longest common prefix of its values (the server forces that prefix without decoding).
  Greedy constrained decoding picks, at every token, the best token the grammar allows; the
  narrowed grammar allows a subset of the tokens the champion's allowed, and still allows
  the one the champion picked (its whole answer is still valid), so it picks the same one.

The replay does not apply, and the rollout is played, when: decoding is not greedy (a
sampled arm draws from the narrowed distribution, a different one); the candidate changes
anything besides rules; a step was not the model's (epsilon, expert) or did not record its
menu (stored before menus were); or the rollout ended in an error. Logits of the same
request can differ in their last float bits between batches of different shapes (see
`server.engine`), as they can between two plays of the baseline itself; the replayed
outcome is a draw of that same process, and the gate's A/A guarantee is unchanged (a
replayed pair is never discordant, so it can only make the gate more conservative).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime

from ratchet.skills.rules import apply_rules, call_text, matches, normal, normal_entry
from ratchet.types import Policy, RuleSpec, Step, Trajectory, Tried


def rules_only(champion: Policy, policy: Policy) -> bool:
    """Does `policy` differ from `champion` by added rules alone?"""
    if policy.rules[: len(champion.rules)] != champion.rules:
        return False
    return policy.model_copy(update={"rules": champion.rules}) == champion


def replay(
    baseline: Trajectory, champion_rules: Sequence[RuleSpec], rules: Sequence[RuleSpec], same_choice: bool
) -> list[list[str]] | None:
    """The rules that would fire at each step if `rules` (the champion's plus the candidate's)
    had been live in `baseline`'s rollout, or None if the rollout could have gone otherwise.

    `same_choice`: the endpoint shows the model the same prompt whatever the enum values
    (the loose condition above); otherwise a step must keep the champion's menu exactly."""
    if baseline.status != "finished" or baseline.prompt is None:
        return None
    state = baseline.prompt.first_observation
    tried: list[Tried] = []
    fired_at: list[list[str]] = []
    for step in baseline.steps:
        if step.source != "model" or step.menu is None:
            return None
        fired = _step_fired(step, state, tried, champion_rules, rules, same_choice)
        if fired is None:
            return None
        fired_at.append(fired)
        if step.moves_on:  # the actor: a played call or text reply (even a refused one) is the next state
            if step.tool_call is not None and step.error is None:
                tried.append(Tried(normal(state), call_text(step.tool_call)))
            state = step.tool_result
    return fired_at


def _step_fired(
    step: Step,
    state: str,
    tried: list[Tried],
    champion_rules: Sequence[RuleSpec],
    rules: Sequence[RuleSpec],
    same_choice: bool,
) -> list[str] | None:
    assert step.menu is not None
    menu = list(dict.fromkeys(normal_entry(e) for e in step.menu))
    before, _ = apply_rules(champion_rules, state, menu, tried)
    after, fired = apply_rules(rules, state, menu, tried)
    if after == before:
        return fired
    if not same_choice or step.tool_call is None:
        return None
    if _tools(after) != _tools(before):
        return None  # a tool left: the prompt lists the tools
    if not any(matches(e, call_text(step.tool_call)) for e in after):
        return None  # the champion's call is off the candidate's menu
    if _forced_prefixes(step.menu, after) != _forced_prefixes(step.menu, before):
        return None
    if _combinations_changed(step.tool_call.name, before, after):
        return None
    return fired


def _combinations_changed(tool: str, before: Sequence[str], after: Sequence[str]) -> bool:
    """Did the rules change which combinations of values the called tool accepts (a tool whose
    parameters are all enumerated, `tool: a, b` entries)? Its grammar is then another `anyOf`,
    and whether greedy decoding still spells the same call through it is not decided here:
    the arm is played (an entry of a one-parameter tool whose value holds ", " counts too,
    which only plays an arm that could have been replayed)."""
    name = normal(tool)
    changed = set(before) ^ set(after)
    return any(e.partition(": ")[0] == name and ", " in e.partition(": ")[2] for e in changed)


def _tools(entries: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(e.partition(":")[0] for e in entries))


def _forced_prefixes(raw_menu: Sequence[str], kept: Sequence[str]) -> dict[str, str]:
    """Per tool, the longest common prefix of its values still on the menu, as spelled."""
    keep = set(kept)
    values: dict[str, list[str]] = {}
    for raw in raw_menu:
        if normal_entry(raw) in keep:
            tool, _, value = raw.partition(": ")
            values.setdefault(tool, []).append(value)
    return {tool: os.path.commonprefix(vs) for tool, vs in values.items()}


def replayed(
    baseline: Trajectory, fired_at: list[list[str]], traj_id: str, arm: str, policy: Policy
) -> Trajectory:
    """The candidate arm's trajectory: the baseline's, with the candidate's rule firings."""
    steps = [s.model_copy(update={"rules": f}) for s, f in zip(baseline.steps, fired_at, strict=True)]
    return baseline.model_copy(
        update={
            "id": traj_id,
            "arm": arm,
            "policy_version": policy.version,
            "steps": steps,
            "replayed_from": baseline.id,
            "seconds": 0.0,
            "created_at": datetime.now(UTC),
        }
    )
