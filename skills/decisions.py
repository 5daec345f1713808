"""One way to decide on a skill and one way to read its gate's evidence, for every caller:
the CLI, the HTTP API, the `promote` flow, the `verify` stage and the dashboard.

A decision is an action a person (or the gate, for `verify`) takes on a skill's status;
each goes through `SkillLibrary.transition`, under its lock, with the status the caller
expects, so two people deciding at once get one change and one `SkillStateError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from ratchet.skills.format import SkillStatus
from ratchet.skills.library import AuditRecord, SkillLibrary

Action = Literal["promote", "reject", "retire", "rollback"]
# action -> (the status it moves to, the status it expects unless the caller says otherwise)
ACTIONS: dict[str, tuple[SkillStatus, SkillStatus | None]] = {
    "promote": ("promoted", "verified"),
    "reject": ("rejected", None),  # a candidate or a verified skill
    "retire": ("retired", "promoted"),
}
# what a person may do from each status (the dashboard's buttons)
AVAILABLE: dict[str, list[str]] = {
    "candidate": ["reject"],
    "verified": ["promote", "reject"],
    "promoted": ["retire"],
}


def decide(
    library: SkillLibrary, name: str, action: Action, who: str, why: str, expect: SkillStatus | None = None
) -> list[str]:
    """Apply `action` to skill `name`; returns every skill whose status changed (a rollback
    retires the promotion and every later one)."""
    if action == "rollback":
        return library.rollback(name, who=who, why=why)
    to, usual = ACTIONS[action]
    library.transition(name, to, who=who, why=why, expect=expect or usual)
    return [name]


def latest_evidence(records: Iterable[AuditRecord]) -> dict[str, dict[str, Any]]:
    """skill -> the evidence of its latest gate decision (the audit records carry it)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if "repairs" in r.evidence:
            out[r.skill] = r.evidence
    return out


def evidence_of(library: SkillLibrary, name: str) -> dict[str, Any]:
    """The evidence of `name`'s latest gate decision ({} if it was never gated)."""
    return latest_evidence(library.history(name)).get(name, {})
