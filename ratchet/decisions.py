"""One way to decide on a candidate, for every kind (skills, tools, guardrails, adapters) and
every caller: the CLI, the HTTP API, the `promote` flow, the stages and the dashboard.

A decision is an action a person (or the gate) takes on a candidate's status; each goes
through its kind's store (`Candidates`: the skill library, the adapter registry), which makes
the change under its lifecycle's lock with the status the caller expects, so two people
deciding at once get one change and one `CandidateStateError`.

A decision is one transaction, `apply`: its input is checked (`ratchet.lifecycle.check_input`)
and the kind checks everything it can (status, file hashes) before the record is written; any
failure up to there is an error and nothing changed. Once the record is on disk the decision
has happened: the kind's mirrors (SKILL.md status, vector index, MLflow tags and alias) and
the lifecycle's listeners (every copy kept outside the kind, `ratchet.lifecycle.subscribe`:
MLflow's agent versions and prompts, subscribed once where the library is opened,
`ratchet.flows.agent_versions.follow`) are written after it, and one that fails is a warning
in the `Outcome` ("the vector index mirror failed: …; it is retried …"), never an error. A
decision is one `ratchet.lifecycle.batch`: a rollback that retires three candidates tells the
listeners once. After its record, every `apply` brings all of the kind's mirrors in line
(`Candidates.mirror`), so a mirror that failed before is retried by the next decision.

The CLI (`cli/common.py:change`), the `promote` flow (`flows/promote.py:apply_decisions`) and
the HTTP API call `apply` (the API through `decide`, which logs the warnings instead of
returning them); none of them writes MLflow's copy by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ratchet.lifecycle import TRANSITIONS, Record, Status, Warn, batch, check_input

log = logging.getLogger(__name__)

Action = Literal["promote", "reject", "retire", "rollback"]
ACTIONS: dict[str, Status] = {"promote": "promoted", "reject": "rejected", "retire": "retired"}
# what a person may do from each status (the dashboard's buttons; the lifecycle allows them)
AVAILABLE: dict[str, list[str]] = {
    status: [a for a, to in ACTIONS.items() if to in TRANSITIONS[status]] for status in TRANSITIONS
}


class Candidates(Protocol):
    """A kind's store, as decisions see it. `transition` and `rollback` raise only before
    their first record; after it, a mirror that fails goes to `warn`."""

    def transition(
        self,
        name: str,
        to: Status,
        who: str,
        why: str,
        evidence: dict[str, Any] | None = None,
        expect: Status | None = None,
        warn: Warn | None = None,
    ) -> Record: ...

    def rollback(self, name: str, who: str, why: str, warn: Warn | None = None) -> list[str]: ...

    def mirror(self, warn: Warn) -> None:
        """Bring every mirror of the log in line (never raises: a failure goes to `warn`)."""
        ...


@dataclass
class Outcome:
    """What a decision did: every candidate whose status changed (a rollback retires the
    promotion and every later one), and one line per mirror that failed after the record."""

    action: Action
    changed: list[str]
    warnings: list[str] = field(default_factory=list)


def check_decision(name: str, who: str, why: str) -> None:
    """A decision's input, checked before anything is opened (an `InvalidInputError`)."""
    check_input(name, who, why)


def apply(
    candidates: Candidates,
    name: str,
    action: Action,
    who: str,
    why: str,
    expect: Status | None = None,
) -> Outcome:
    """Apply `action` to candidate `name` as one transaction (module docstring): raises only
    if nothing was recorded; a mirror that failed afterwards is a warning in the outcome."""
    check_decision(name, who, why)
    warnings: list[str] = []

    def warn(line: str) -> None:
        if line not in warnings:  # the same mirror failing again on the retry is one warning
            warnings.append(line)

    with batch(warn):  # the listeners hear the decision once, after the kind's mirrors
        if action == "rollback":
            changed = candidates.rollback(name, who=who, why=why, warn=warn)
        else:
            candidates.transition(name, ACTIONS[action], who=who, why=why, expect=expect, warn=warn)
            changed = [name]
        candidates.mirror(warn)  # also retries whatever an earlier change failed to mirror
    return Outcome(action, changed, warnings)


def decide(
    candidates: Candidates, name: str, action: Action, who: str, why: str, expect: Status | None = None
) -> list[str]:
    """`apply` for callers that only need what changed; mirror warnings go to the log."""
    outcome = apply(candidates, name, action, who, why, expect)
    for line in outcome.warnings:
        log.warning("%s %s; %s", verb(action), ", ".join(outcome.changed), line)
    return outcome.changed


def verb(action: Action) -> str:
    """What an action did, for messages: 'promoted', 'retired' (also for a rollback)."""
    return "retired" if action == "rollback" else ACTIONS[action]
