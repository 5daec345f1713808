"""One way to decide on a candidate, for every kind (skills, tools, guardrails, adapters) and
every caller: the CLI, the HTTP API, the `promote`
flow, the stages and the dashboard.

A decision is an action a person (or the gate) takes on a candidate's status; each goes
through its kind's store (`Candidates`: the skill library, the adapter registry), which makes
the change under its lifecycle's lock with the status the caller expects, so two people
deciding at once get one change and one `CandidateStateError`.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from ratchet.lifecycle import TRANSITIONS, Record, Status

Action = Literal["promote", "reject", "retire", "rollback"]
ACTIONS: dict[str, Status] = {"promote": "promoted", "reject": "rejected", "retire": "retired"}
# what a person may do from each status (the dashboard's buttons; the lifecycle allows them)
AVAILABLE: dict[str, list[str]] = {
    status: [a for a, to in ACTIONS.items() if to in TRANSITIONS[status]] for status in TRANSITIONS
}


class Candidates(Protocol):
    """A kind's store, as decisions see it."""

    def transition(
        self,
        name: str,
        to: Status,
        who: str,
        why: str,
        evidence: dict[str, Any] | None = None,
        expect: Status | None = None,
    ) -> Record: ...

    def rollback(self, name: str, who: str, why: str) -> list[str]: ...


def decide(
    candidates: Candidates, name: str, action: Action, who: str, why: str, expect: Status | None = None
) -> list[str]:
    """Apply `action` to candidate `name`; returns every candidate whose status changed (a
    rollback retires the promotion and every later one)."""
    if action == "rollback":
        return candidates.rollback(name, who=who, why=why)
    candidates.transition(name, ACTIONS[action], who=who, why=why, expect=expect)
    return [name]


def verb(action: Action) -> str:
    """What an action did, for messages: 'promoted', 'retired' (also for a rollback)."""
    return "retired" if action == "rollback" else ACTIONS[action]
