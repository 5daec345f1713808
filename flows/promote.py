"""Prefect flow `promote`: a person decides on verified candidates in the Prefect UI.

The flow lists every verified candidate with its evidence, then pauses with a form
(`PromotionForm`, a Prefect RunInput). Whoever resumes it (the Prefect UI's form, the REST
endpoint `POST /api/flow_runs/{id}/resume`, or `prefect.flow_runs.resume_flow_run(id,
run_input={...})`) names what to promote and what to reject, and why. Each change goes
through the library with `expect="verified"`, so a candidate someone else decided on
meanwhile (CLI, dashboard) is reported as a conflict, never changed twice. Unanswered
within `timeout_s`, the flow ends and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect import flow, get_run_logger
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput

from ratchet.config import Settings, settings_from
from ratchet.errors import SkillStateError
from ratchet.flows.runtime import open_library
from ratchet.runtime_env import prepare_environment
from ratchet.skills.decisions import decide, evidence_of
from ratchet.skills.library import SkillLibrary


class PromotionForm(RunInput):
    promote: list[str] = []
    reject: list[str] = []
    reason: str = ""
    by: str = "prefect-ui"


@dataclass
class PromotionResult:
    promoted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    conflicts: dict[str, str] = field(default_factory=dict)  # name -> one-line reason
    waiting: list[str] = field(default_factory=list)  # verified candidates nobody decided on


def apply_decisions(
    library: SkillLibrary, promote: list[str], reject: list[str], who: str, why: str
) -> PromotionResult:
    """Promote and reject verified candidates; what cannot change is a conflict, not an error."""
    out = PromotionResult()
    for names, action, to, done in (
        (promote, "promote", "promoted", out.promoted),
        (reject, "reject", "rejected", out.rejected),
    ):
        for name in names:
            try:
                decide(library, name, action, who=who, why=why or f"{to} by {who}", expect="verified")
                done.append(name)
            except SkillStateError as exc:
                out.conflicts[name] = str(exc)
    out.waiting = [s.name for s in library.list(status="verified")]
    return out


def describe(library: SkillLibrary) -> str:
    """The form's description: each verified candidate with the gate's evidence (markdown)."""
    rows = [
        "| candidate | kind | family | repairs | regressions | p | gate |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in library.list(status="verified"):
        ev = evidence_of(library, s.name)
        rows.append(
            f"| {s.name} | {s.kind} | {s.family} | {ev.get('repairs', '?')} | {ev.get('regressions', '?')} "
            f"| {ev.get('p_value', float('nan')):.3g} | {ev.get('reason', '')} |"
        )
    return "Verified candidates waiting for a decision:\n\n" + "\n".join(rows)


@flow(name="promote", validate_parameters=False)
def promote_flow(
    settings: Settings | None = None,
    timeout_s: int = 24 * 3600,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> PromotionResult:
    """Wait for a person's decision on the verified candidates (`config`: see `evolve_flow`)."""
    settings = settings or settings_from(config, overrides)
    prepare_environment(settings)
    library = open_library(settings)
    verified = [s.name for s in library.list(status="verified")]
    if not verified:
        get_run_logger().info("no verified candidates: nothing to decide")
        return PromotionResult()
    form = PromotionForm.with_initial_data(description=describe(library), promote=verified)
    answer = pause_flow_run(wait_for_input=form, timeout=timeout_s, poll_interval=2)
    return apply_decisions(library, answer.promote, answer.reject, answer.by, answer.reason)
