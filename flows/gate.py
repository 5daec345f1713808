"""What a stage does with a gate's decision, for every kind: file it, then promote under `auto`.

    gate (flows/verify.py:run_gates) → file_verdict: candidate → verified | rejected, with the
    gate's evidence (`gate_evidence`) → promote_verified: verified → promoted when
    `verify.promotion = "auto"` (otherwise a person decides: `ratchet.decisions`)

`verify_stage` (skills: it promotes only what also survives the set check) and
`finetune_stage` (adapters) both go through here, on their kind's store (a
`ratchet.decisions.Candidates`). MLflow's copy (agent versions, prompts) follows by itself: it
listens to the lifecycle (`agent_versions.follow`), and a stage runs its verdicts and
promotions in one `ratchet.lifecycle.batch`, so it is written once per stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ratchet.decisions import Candidates
from ratchet.lifecycle import Status
from ratchet.skills.intervention import GateDecision

AUTO = "promotion policy 'auto'"  # the reason an auto-promotion records


def verdict(decision: GateDecision) -> Status:
    """Where a gate's decision sends a candidate: accept → verified, anything else → rejected."""
    return "verified" if decision.decision == "accept" else "rejected"


def file_verdict(
    store: Candidates, name: str, decision: GateDecision, evidence: dict[str, Any], who: str
) -> Status:
    """Record the gate's decision on candidate `name` with its evidence (it must still be a
    candidate: a stale view is refused); returns where it went."""
    to = verdict(decision)
    store.transition(name, to, who=who, why=decision.reason, evidence=evidence, expect="candidate")
    return to


def promote_verified(store: Candidates, names: Iterable[str], who: str, promotion: str) -> list[str]:
    """Promote these verified candidates when the policy is `auto` (recorded as `<who>:auto`);
    returns what was promoted (nothing under `manual`: they wait for a person)."""
    if promotion != "auto":
        return []
    done = []
    for name in names:
        store.transition(name, "promoted", who=f"{who}:auto", why=AUTO, expect="verified")
        done.append(name)
    return done
