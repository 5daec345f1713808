"""Prefect flow `promote`: a person decides on verified candidates in the Prefect UI.

The flow lists every verified candidate (skills, tools, guardrails and adapters, named
`adapter:N`) with its gate evidence, then pauses with a form
(`PromotionForm`, a Prefect RunInput). Whoever resumes it (the Prefect UI's form, the REST
endpoint `POST /api/flow_runs/{id}/resume`, or `prefect.flow_runs.resume_flow_run(id,
run_input={...})`) names what to promote and what to reject, and why. Each change goes
through `ratchet.decisions.apply` with `expect="verified"`, so a candidate someone else decided on
meanwhile (CLI, dashboard) is reported as a conflict, never changed twice. `apply` is the same
transaction the CLI and the HTTP API use: a decision is refused with nothing changed (a
conflict line: a stale view, bad input, changed files), or applied, a mirror that failed
after its record being a warning. Unanswered within `timeout_s`, the flow ends and nothing
changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect import flow, get_run_logger
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput

from ratchet.config import Settings, settings_from
from ratchet.decisions import Action, Candidates, apply
from ratchet.errors import AdapterStateError, RatchetError
from ratchet.flows.runtime import open_library
from ratchet.lifecycle import batch
from ratchet.runtime_env import prepare_environment
from ratchet.skills.library import SkillLibrary
from ratchet.training.registry import AdapterRegistry, may_have_adapters


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
    warnings: list[str] = field(default_factory=list)  # mirrors that failed after a decision


ADAPTER = "adapter:"  # how the form names an adapter version ("adapter:3"); no skill name has a colon


def apply_decisions(
    library: SkillLibrary,
    promote: list[str],
    reject: list[str],
    who: str,
    why: str,
    registry: AdapterRegistry | None = None,
) -> PromotionResult:
    """Promote and reject verified candidates of either kind; what cannot change (a stale
    view, bad input, changed files) is a conflict, not an error. The decisions are one batch
    of the lifecycle: its listeners (MLflow's agent versions, subscribed by `open_library`)
    are written once, after every decision; one that fails is a warning."""
    out = PromotionResult()
    plan: tuple[tuple[list[str], Action, str, list[str]], ...] = (
        (promote, "promote", "promoted", out.promoted),
        (reject, "reject", "rejected", out.rejected),
    )
    with batch(out.warnings.append):
        for names, action, to, done in plan:
            for name in names:
                try:
                    candidates, key = _kind_of(name, library, registry)
                    outcome = apply(
                        candidates, key, action, who=who, why=why or f"{to} by {who}", expect="verified"
                    )
                except RatchetError as exc:
                    out.conflicts[name] = str(exc)
                    continue
                done.append(name)
                out.warnings += [f"{to} {name}; {w}" for w in outcome.warnings]
    out.waiting = _verified(library, registry)
    return out


def _kind_of(name: str, library: SkillLibrary, registry: AdapterRegistry | None) -> tuple[Candidates, str]:
    if not isinstance(name, str) or not name.startswith(ADAPTER):
        return library, name
    if registry is None:
        raise AdapterStateError(f"{name}: this evolution has no adapters")
    return registry, name.removeprefix(ADAPTER)


def _verified(library: SkillLibrary, registry: AdapterRegistry | None) -> list[str]:
    skills = [s.name for s in library.list(status="verified")]
    adapters = (
        [f"{ADAPTER}{v.version}" for v in registry.list() if v.status == "verified"] if registry else []
    )
    return skills + adapters


def describe(library: SkillLibrary, registry: AdapterRegistry | None = None) -> str:
    """The form's description: each verified candidate with the gate's evidence (markdown)."""
    rows = [
        "| candidate | kind | family | repairs | regressions | p | gate |",
        "|---|---|---|---|---|---|---|",
    ]
    found = [
        (s.name, s.kind, s.family, library.lifecycle.evidence(s.name))
        for s in library.list(status="verified")
    ]
    if registry is not None:
        found += [
            (f"{ADAPTER}{v.version}", "adapter", "all", v.evidence)
            for v in registry.list()
            if v.status == "verified"
        ]
    for name, kind, family, ev in found:
        rows.append(
            f"| {name} | {kind} | {family} | {ev.get('repairs', '?')} | {ev.get('regressions', '?')} "
            f"| {ev.get('p_value', float('nan')):.3g} | {ev.get('reason', '')} |"
        )
    note = f"Name an adapter as `{ADAPTER}N`; promoting one makes it the champion."
    return "Verified candidates waiting for a decision:\n\n" + "\n".join(rows) + "\n\n" + note


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
    registry = AdapterRegistry(settings) if may_have_adapters(settings) else None
    verified = _verified(library, registry)
    if not verified:
        get_run_logger().info("no verified candidates: nothing to decide")
        return PromotionResult()
    form = PromotionForm.with_initial_data(description=describe(library, registry), promote=verified)
    answer = pause_flow_run(wait_for_input=form, timeout=timeout_s, poll_interval=2)
    result = apply_decisions(library, answer.promote, answer.reject, answer.by, answer.reason, registry)
    logger = get_run_logger()
    for line in result.warnings:
        logger.warning("%s", line)
    for name, why in result.conflicts.items():
        logger.warning("%s: not changed: %s", ascii(name)[:80], why)
    return result
