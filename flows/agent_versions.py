"""Agent versions and prompt versions: the live policy as MLflow's GenAI side shows it.

ratchet's own stores stay the truth (the skill library and its audit log, the adapter
registry's lifecycle: `ratchet/lifecycle.py`). This module writes a mirror of them into
MLflow after every change to what is live, the way a SKILL.md mirrors its audit record:

* **Agent versions.** Each live policy version (`Policy.version`: model, adapter, the live
  skills, rules, tools and exemplars) is one LoggedModel of type `agent`, named
  `policy-<version>`, in the evolution's experiment. Its source run is the generation run
  that made it live (the stage that promoted, or the first stage that played it: generation
  0's baseline), or the evolution's parent run when a person made it live outside a stage
  (tag `ratchet.made_live_by`). Its params say what it is made of; the live texts are linked
  to it as prompt versions. Exactly one carries `ratchet.live = true`: the champion.
  Traces of its rollouts (`flows/traces.py`) and its evaluations (`flows/evaluations.py`)
  attach to it by model id.
* **Prompt versions.** `ratchet-<evolution>.system` is the actor's system prompt with every
  live prompt skill (a rollout shows the `skills.k` nearest of them), and
  `ratchet-<evolution>.skill.<name>` is each live skill's text (procedures and guardrails as
  the prompt shows them, a rule's description and its data, a tool's description and
  schema, an exemplar set's solved tasks). The alias `champion` points at the live text: it
  moves when the text changes, and a retired skill's prompt keeps its versions and loses
  the alias.

* **Your agent** (`agent.entry`). The model receives your agent's own prompt, not ratchet's
  actor's, so its agent version shows that instead: what the agent sent, as first seen in the
  version's rollouts (`ratchet-<evolution>.agent.system` and `.agent.tools`, found again by
  hash; `record_sent`), and what ratchet added (`ratchet-<evolution>.additions`: the live
  skills and exemplars appended to its system message; rules and argument constraints are the
  skills' own prompts). Its params name the entry point and its kind.

`sync` rewrites the whole mirror from the stores, so it can run after any change by anyone
(a stage, the CLI, the HTTP API, the `promote` flow) and converges after a kill. It never
raises: a failure to write MLflow is a warning, and ratchet's own record stands.

Nobody calls it after a decision by hand: `follow` subscribes it to the lifecycle
(`ratchet.lifecycle.subscribe`) once per data dir, where the skill library is opened
(`flows/runtime.py:open_library`: the runtime of every stage, the CLI, the HTTP API, the
`promote` flow). It syncs after every batch of records that holds a decision on a gated
candidate (from verified, promoted or retired: a person's, or a stage's auto-promotion or
set check); a filing, a merge's amendment or the gate's verdict on a candidate changes
nothing live. Inside a stage's generation run the new agent version is linked to that run.
A failure is the lifecycle's warning line, reported with the decision ("promoted: a; the
MLflow mirror (agent versions, prompts) failed: …; it is retried by the next decision or
stage") and logged in a stage; any later sync repairs it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ratchet.agents.prompts import system_prompt
from ratchet.config import Settings
from ratchet.endpoint.apply import system_addition
from ratchet.endpoint.recording import Arm
from ratchet.flows.runtime import champion_policy, model_policy, policy_with
from ratchet.flows.tracking import EVOLUTION, GENERATION, evolution_run_id, setup_experiment
from ratchet.flows.tracking import KIND as KIND_TAG
from ratchet.hashing import content_hash
from ratchet.kinds import kind_of
from ratchet.lifecycle import Change, Listener, subscribe
from ratchet.skills.format import Skill
from ratchet.skills.library import SkillLibrary
from ratchet.training.registry import AdapterRegistry, may_have_adapters
from ratchet.types import Policy, PromptRecord

log = logging.getLogger(__name__)

AGENT = "agent"  # the LoggedModel type of a policy version
POLICY, LIVE, MADE_BY = "ratchet.policy_version", "ratchet.live", "ratchet.made_live_by"
CHAMPION = "champion"  # the prompt alias of the live text
HASH, KIND, FAMILY = "ratchet.content_hash", "ratchet.kind", "ratchet.family"
PARAM_MAX = 500
NOTHING_ADDED = "(nothing: ratchet appends no text to your agent's system message under this policy)"
SENT_SYSTEM, SENT_TOOLS = "ratchet.agent.system_sha", "ratchet.agent.tools_sha"  # your agent's, first seen


def model_name(version: str) -> str:
    return f"policy-{version}"


def system_prompt_name(evolution: str) -> str:
    return f"ratchet-{evolution}.system"


def additions_prompt_name(evolution: str) -> str:
    """What ratchet appends to your agent's system message (`agent.entry`)."""
    return f"ratchet-{evolution}.additions"


def sent_prompt_name(evolution: str, part: str) -> str:
    """Your agent's own `part` ('system' or 'tools'), as it sent it."""
    return f"ratchet-{evolution}.agent.{part}"


def skill_prompt_name(evolution: str, skill: str) -> str:
    return f"ratchet-{evolution}.skill.{skill}"


def skill_template(skill: Skill) -> str:
    """A skill's live text, as the policy carries it (its kind says how: `ratchet.kinds`)."""
    return kind_of(skill.kind).template(skill)


def sync(
    settings: Settings,
    library: SkillLibrary | None,
    policy: Policy | None = None,
    run_id: str | None = None,
    generation: int | None = None,
    by: str = "",
) -> str:
    """Mirror the live policy (`policy`, else the recorded champion) into MLflow: its agent
    version (created on first sight, linked to `run_id`, else the evolution's parent run),
    the `ratchet.live` tags, the prompts and their `champion` aliases. Returns the agent
    version's model id ('' when MLflow could not be written: a warning says why)."""
    try:
        return sync_or_raise(settings, library, policy, run_id, generation, by)
    except Exception as exc:  # noqa: BLE001 - a mirror must never break a run or a decision
        log.warning("MLflow's copy of the live policy was not updated (ratchet's own record stands): %s", exc)
        return ""


def sync_or_raise(
    settings: Settings,
    library: SkillLibrary | None,
    policy: Policy | None = None,
    run_id: str | None = None,
    generation: int | None = None,
    by: str = "",
) -> str:
    """`sync` that raises what failed, for a caller that reports it itself."""
    with library.lifecycle.locked() if library is not None else nullcontext():  # one writer
        if policy is None:
            if library is None:
                raise ValueError("the live policy needs the skill library")
            policy = champion_policy(settings, library)
        return _sync(settings, library, policy, run_id, generation, by)


MIRROR = "MLflow mirror (agent versions, prompts)"
MIRROR_RETRY = "it is retried by the next decision or stage"
LIVE_FROM = frozenset({"verified", "promoted", "retired"})  # a move from these is a decision


def follow(settings: Settings, library: SkillLibrary) -> None:
    """Keep MLflow's agent versions and prompts in line with every decision on this data dir's
    candidates, skills and adapters (module docstring): subscribed once per data dir (a later
    call, e.g. the next command in the same process, replaces it)."""
    roots = {settings.skills_dir.resolve(), settings.adapters_dir.resolve()}

    def notify(changes: Sequence[Change]) -> None:
        ours = [c.record for c in changes if c.store.root.resolve() in roots]
        if not any(r.from_status in LIVE_FROM and not r.is_amendment for r in ours):
            return
        run_id, generation = generation_of(settings)
        sync_or_raise(settings, library, run_id=run_id, generation=generation, by=ours[0].who)

    subscribe(Listener(MIRROR, notify, MIRROR_RETRY), key=(MIRROR, str(settings.data_dir.resolve())))


def generation_of(settings: Settings) -> tuple[str | None, int | None]:
    """The active MLflow run and its generation, if it is a generation run of this evolution
    (a stage): the agent version a decision there makes live is linked to it; elsewhere (a
    person's decision) to the evolution's parent run."""
    run = mlflow.active_run()
    tags = run.data.tags if run is not None else {}
    if tags.get(KIND_TAG) != "generation" or tags.get(EVOLUTION) != settings.evolution:
        return None, None
    return run.info.run_id, int(tags[GENERATION])


def _sync(
    settings: Settings,
    library: SkillLibrary | None,
    policy: Policy,
    run_id: str | None,
    generation: int | None,
    by: str,
) -> str:
    mlflow.set_tracking_uri(settings.mlflow_uri)
    client = MlflowClient(settings.mlflow_uri)
    exp_id = setup_experiment(settings)
    mlflow.set_experiment(experiment_id=exp_id)  # registered prompts are listed under the experiment
    prompts = mirror_prompts(
        client, settings.evolution, library, policy, your_agent=bool(settings.agent.name)
    )
    model = find_model(client, exp_id, policy.version)
    if model is None:
        tags = {POLICY: policy.version, EVOLUTION: settings.evolution, LIVE: "true", MADE_BY: by or "unknown"}
        if generation is not None:
            tags[GENERATION] = str(generation)
        model = mlflow.create_external_model(
            name=model_name(policy.version),
            source_run_id=run_id or evolution_run_id(settings),
            tags=tags,
            params=params(policy, prompts) | agent_params(settings),
            model_type=AGENT,
            experiment_id=exp_id,
        )
        for pv in prompts:
            client.link_prompt_version_to_model(pv.name, str(pv.version), model.model_id)
    for other in client.search_logged_models([exp_id], filter_string=f"tags.`{LIVE}` = 'true'"):
        if other.model_id != model.model_id:
            client.set_logged_model_tags(other.model_id, {LIVE: "false"})
    client.set_logged_model_tags(model.model_id, {LIVE: "true"})
    return model.model_id


def params(policy: Policy, prompts: list[Any]) -> dict[str, str]:
    """What a policy version is made of, as the agent version's params."""

    def names(items: Any) -> str:
        text = ", ".join(sorted(i.name for i in items)) or "none"
        return text if len(text) <= PARAM_MAX else text[: PARAM_MAX - 1] + "…"

    system = next((p for p in prompts if p.name.endswith(".system")), None)
    added = next((p for p in prompts if p.name.endswith(".additions")), None)
    return {
        "policy_version": policy.version,
        "model": policy.model,
        "adapter": policy.adapter or "none",
        "adapter_sha256": policy.adapter_hash or "none",
        "skills": names(policy.skills),
        "tools": names(policy.tools),
        "rules": names(policy.rules),
        "exemplars": str(len(policy.exemplars)),
        "system_prompt": f"prompts:/{system.name}/{system.version}" if system is not None else "none",
    } | ({"ratchet_additions": f"prompts:/{added.name}/{added.version}"} if added is not None else {})


def agent_params(settings: Settings) -> dict[str, str]:
    """Your agent's entry point and kind ({} for ratchet's actor): the code that ran."""
    a = settings.agent
    return {"agent_entry": a.name, "agent_kind": a.kind} if a.name else {}


def find_model(client: MlflowClient, exp_id: str, version: str) -> Any | None:
    """The agent version of policy `version` in the experiment (None: not recorded yet)."""
    found = client.search_logged_models(
        [exp_id], filter_string=f"tags.`{POLICY}` = '{version}'", max_results=1
    )
    return found[0] if found else None


def agent_versions(settings: Settings) -> dict[str, Any]:
    """policy version -> its agent version (LoggedModel) in the evolution's experiment ({} if
    the store or the experiment does not exist yet). Reads only: never creates the store."""
    if not may_have_adapters(settings):  # no MLflow store in the data dir yet
        return {}
    client = MlflowClient(settings.mlflow_uri)
    try:
        exp = client.get_experiment_by_name(f"ratchet-{settings.evolution}")
        if exp is None:
            return {}
        models, token = [], None
        while True:  # every page: a long evolution has many versions
            page = client.search_logged_models([exp.experiment_id], max_results=100, page_token=token)
            models += list(page)
            token = page.token
            if not token:
                break
    except MlflowException:
        return {}
    return {m.tags[POLICY]: m for m in models if m.tags.get(POLICY)}


def mirror_prompts(
    client: MlflowClient,
    evolution: str,
    library: SkillLibrary | None,
    policy: Policy,
    your_agent: bool = False,
) -> list[Any]:
    """The live texts at their `champion` alias (registered where new), and no alias on the
    prompt of a skill that is no longer live; returns the live prompt versions. For your agent
    the first is what ratchet appends to its system message, not the actor's system prompt
    (which your agent's model never reads)."""
    if your_agent:
        first = ensure_prompt(
            client,
            additions_prompt_name(evolution),
            system_addition(Arm(policy)) or NOTHING_ADDED,
            {POLICY: policy.version},
            f"appended to your agent's system message: {len(policy.skills)} skill(s), "
            f"{len(policy.exemplars)} exemplar set(s)",
        )
    else:
        first = ensure_prompt(
            client,
            system_prompt_name(evolution),
            system_prompt(policy.skills),
            {POLICY: policy.version},
            f"the system prompt with {len(policy.skills)} live prompt skill(s)",
        )
    live = [first]
    if library is None:
        return live
    promoted = library.list(status="promoted")
    for skill in promoted:
        tags = {KIND: skill.kind, FAMILY: skill.family, "ratchet.skill": skill.name}
        why = f"{skill.kind} {skill.name} ({skill.family}), promoted"
        live.append(
            ensure_prompt(client, skill_prompt_name(evolution, skill.name), skill_template(skill), tags, why)
        )
    gone = {r.name for r in library.history() if r.to_status == "promoted"} - {s.name for s in promoted}
    for name in sorted(gone):
        drop_alias(client, skill_prompt_name(evolution, name))
    return live


def record_sent(settings: Settings, model_id: str, sent: PromptRecord) -> None:
    """On agent version `model_id`, what your agent sent (its system text and tools, from a
    rollout it played), unless the version already has it: the first seen stays. The texts are
    prompts found again by hash, so an agent unchanged across versions is one prompt version.
    Never raises (a warning): ratchet's own record stands."""
    try:
        _record_sent(settings, model_id, sent)
    except Exception as exc:  # noqa: BLE001 - a mirror must never break a run
        log.warning("MLflow's agent version does not show what your agent sent: %s", exc)


def _record_sent(settings: Settings, model_id: str, sent: PromptRecord) -> None:
    client = MlflowClient(settings.mlflow_uri)
    if client.get_logged_model(model_id).tags.get(SENT_SYSTEM):
        return
    evolution, tools = settings.evolution, sent.sent_tools or []
    names = ", ".join(str((t.get("function") or {}).get("name", "?")) for t in tools) or "none"
    system = ensure_prompt(
        client,
        sent_prompt_name(evolution, "system"),
        sent.sent_system or "(your agent sent no system message)",
        {"ratchet.agent.entry": settings.agent.name},
        f"{settings.agent.name}'s system message, as it sent it",
    )
    offered = ensure_prompt(
        client,
        sent_prompt_name(evolution, "tools"),
        json.dumps(tools, indent=2, sort_keys=True, ensure_ascii=False),
        {"ratchet.agent.entry": settings.agent.name},
        f"{settings.agent.name}'s tools, as it offered them: {names}",
    )
    for pv in (system, offered):
        client.link_prompt_version_to_model(pv.name, str(pv.version), model_id)
    client.log_model_params(
        model_id,
        {
            "agent_system_prompt": f"prompts:/{system.name}/{system.version}",
            "agent_tools": f"prompts:/{offered.name}/{offered.version}",
        },
    )
    names = names if len(names) <= PARAM_MAX else names[: PARAM_MAX - 1] + "…"
    tags = {SENT_SYSTEM: system.tags[HASH], SENT_TOOLS: offered.tags[HASH], "ratchet.agent.tools": names}
    client.set_logged_model_tags(model_id, tags)


def ensure_prompt(client: MlflowClient, name: str, template: str, tags: dict[str, str], why: str) -> Any:
    """The version of prompt `name` holding `template` (registered if none does yet), with the
    `champion` alias on it."""
    digest = content_hash(template)
    try:
        current = client.get_prompt_version_by_alias(name, CHAMPION)
    except MlflowException:
        current = None
    if current is not None and current.tags.get(HASH) == digest:
        return current
    try:
        versions = list(client.search_prompt_versions(name))
    except MlflowException:
        versions = []
    found = next((v for v in versions if v.tags.get(HASH) == digest), None)
    if found is None:
        found = client.register_prompt(name, template, commit_message=why, tags=tags | {HASH: digest})
    client.set_prompt_alias(name, CHAMPION, int(found.version))
    return found


def drop_alias(client: MlflowClient, name: str) -> None:
    """No `champion` alias on prompt `name` (its text is not live)."""
    try:
        client.get_prompt_version_by_alias(name, CHAMPION)
    except MlflowException:
        return
    client.delete_prompt_alias(name, CHAMPION)


def live_over_time(settings: Settings, library: SkillLibrary) -> list[tuple[str, Any, str]]:
    """Every status change of a skill or an adapter, oldest first, as (kind, record, the live
    policy version right after it): the audit logs replayed (promoted skills are live, the
    newest promoted adapter is), so the dashboard can link each change to its agent version."""
    skills = {s.name: s for s in library.scan()[0]}
    registry = AdapterRegistry(settings) if may_have_adapters(settings) else None
    adapters = {v.name: v for v in registry.list()} if registry is not None else {}
    events = [("skill", r) for r in library.history()]
    events += [("adapter", r) for r in registry.audit()] if registry is not None else []
    promoted: dict[str, dict[str, None]] = {"skill": {}, "adapter": {}}  # in the order they went live

    def live_version() -> str:
        champion = next(reversed(promoted["adapter"]), None)
        base = model_policy(settings, adapters.get(champion) if champion is not None else None)
        return policy_with(base, [skills[n] for n in sorted(promoted["skill"]) if n in skills]).version

    out, version = [], live_version()
    for kind, record in sorted(events, key=lambda e: e[1].at):
        if record.is_amendment:  # provenance joined by a merge: no change to what is live
            continue
        order = promoted[kind]
        if record.to_status == "promoted" or record.name in order:
            order.pop(record.name, None)
            if record.to_status == "promoted":
                order[record.name] = None
            version = live_version()
        out.append((kind, record, version))
    return out
