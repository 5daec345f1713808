"""`ratchet export`: the live champion as plain files a user applies without ratchet.

The export holds what the champion changes in a model call, as data, and a stdlib-only
`apply.py` (`flows/export_apply.py`, copied verbatim) that applies it to an OpenAI
chat-completions body exactly as `ratchet.skills.calls.apply_request` does:

    manifest.json         policy version, evolution, model, each candidate with its gate evidence
                          and who promoted it when (the audit logs), provenance, files' sha256
    README.md             what each file is and how to use it
    system_addition.md    what the policy appends to the agent's system message (every text)
    prompt.json           the prompt skills and solved examples, each with the embedding and token
                          count that pick it per task, and the selection's settings
    tools.json            action rules (menu values removed or preferred) and argument
                          constraints (an argument must be what the agent has read), as data
    apply.py              applies all of it to a request body, or as a proxy in front of a server
    adapter/              the champion LoRA adapter as a peft folder (when there is one)
    tools/, mcp.json      the promoted MCP tools as skill folders, and the command that serves them

Decisions, written down:

* Exemplars and prompt skills are chosen per task (the nearest `skills.exemplars` /
  `skills.k` to the task's input by MiniLM embedding, within a token budget:
  `memory/retrieval.py`). The export keeps every text with the very embedding ratchet ranks it
  by (the live index's, or computed as the index would), so `apply.py` given the task's
  embedding picks what ratchet picks; given none it shows every text (`system_addition.md`),
  which is what ratchet shows where it has no retriever. bench/export_roundtrip.py measures
  both on the units agent.
* Tools are served over MCP by ratchet (`ratchet tools serve --from <export>/tools`): distilled
  code is untrusted and runs only in ratchet's sandbox, so the export ships the tool skills
  (hash-checked when served), not code to run bare.
* A candidate kind `apply.py` cannot express (a plug-in's) is refused in one line: an export
  that silently dropped part of the champion would score otherwise than the champion.

The export is written to a hidden directory beside the target and renamed into place at the
end, so an export killed midway leaves nothing at the target (its hidden leftover is removed
by the next export there). Reading the data dir writes nothing to it (but what Chroma writes
when the live index, where there is one, is opened); an evolution without a champion is one
line, with nothing written.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ratchet import __version__
from ratchet.config import Settings
from ratchet.errors import RatchetError
from ratchet.flows import export_apply
from ratchet.lifecycle import Record, latest_evidence
from ratchet.skills.calls import apply_policy
from ratchet.skills.format import FILE, Skill, load, write_files
from ratchet.skills.library import SkillLibrary
from ratchet.training.registry import ADAPTER_FILES, AdapterRegistry, AdapterVersion, may_have_adapters
from ratchet.types import ModelCall, Policy, SkillText

FORMAT = export_apply.FORMAT
# the kinds apply.py can express (prompt text, rules, constraints, exemplars), or the export ships
# otherwise (tools over MCP, the adapter as a peft folder)
EXPORTABLE = frozenset({"procedure", "guardrail", "rule", "constraint", "exemplar", "tool", "adapter"})
GATE_KEYS = ("decision", "reason", "repairs", "regressions", "unchanged", "p_value", "tasks", "rollouts")


class ExportError(RatchetError):
    """The export cannot be written (no champion, an output in the way, a kind it cannot hold)."""


@dataclass(frozen=True)
class Champion:
    """The live policy and the records that say why each part of it is live."""

    settings: Settings
    policy: Policy
    skills: list[Skill]  # promoted, in the library's order (the policy's)
    skill_records: list[Record]
    adapter: AdapterVersion | None
    adapter_path: Path | None
    adapter_records: list[Record]


@dataclass(frozen=True)
class ExportResult:
    path: Path
    policy_version: str
    candidates: list[str]
    files: list[str]


# ------------------------------------------------------------------------------------ reading


def read_champion(settings: Settings) -> Champion:
    """The evolution's champion from the data dir's stores, creating nothing there; one line if
    there is none, or if a live part of it cannot be read or exported."""
    where = f"evolution {settings.evolution!r} in {settings.data_dir}"
    if not settings.data_dir.is_dir():
        raise ExportError(
            f"no data dir at {settings.data_dir}", "pass --data-dir (or set data_dir) to a run's"
        )
    skills: list[Skill] = []
    skill_records: list[Record] = []
    if (settings.skills_dir / "audit.jsonl").is_file():
        library = SkillLibrary(settings.skills_dir, settings.index_dir)
        skill_records = library.history()
        found, _ = library.scan()
        skills = [s for s in found if s.status == "promoted"]
        unread = sorted(set(library.lifecycle.promoted()) - {s.name for s in skills})
        if unread:
            raise ExportError(
                f"promoted skill {unread[0]!r} of {where} cannot be read",
                "see `ratchet skills list` for why, and restore or retire it",
            )
    adapter = adapter_path = None
    adapter_records: list[Record] = []
    if may_have_adapters(settings):
        registry = AdapterRegistry(settings)
        adapter = registry.champion()
        if adapter is not None:
            adapter_path = registry.checked_path(adapter)  # refuses files that changed since the gate
            adapter_records = [r for r in registry.audit() if r.name == adapter.name]
    if not skills and adapter is None:
        raise ExportError(
            f"{where} has no champion: nothing is promoted",
            "run `ratchet evolve`, or promote a verified candidate (`ratchet skills list`), then export",
        )
    odd = sorted({s.kind for s in skills} - EXPORTABLE)
    if odd:
        raise ExportError(
            f"the champion holds a candidate of kind {odd[0]!r}, which an export cannot express as files",
            "apply it through ratchet's intervention endpoint instead, or retire that candidate",
        )
    from ratchet.flows.runtime import model_policy, policy_with  # the runtime's own policy, as it plays

    policy = policy_with(model_policy(settings, adapter), skills)
    return Champion(settings, policy, skills, skill_records, adapter, adapter_path, adapter_records)


def check_output(out: Path, force: bool) -> None:
    """Refuse a target that is not a directory, or holds files, unless `force`."""
    if out.is_symlink():
        raise ExportError(f"{out} is a symbolic link", "give the export a real directory path")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file", "choose another directory for the export")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} is not empty", "choose a new directory, or pass --force to replace it")


# ------------------------------------------------------------------------------------ writing


def export_champion(settings: Settings, out: Path, force: bool = False, by: str = "") -> ExportResult:
    """Write the champion of `settings.evolution` to `out` (module docstring)."""
    out = Path(out).absolute()
    check_output(out, force)
    champion = read_champion(settings)
    prompt = prompt_data(settings, champion.policy)  # the embedding model loads before anything is made
    with staged(out) as tmp:
        write_export(champion, prompt, tmp, out, by)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    names = [s.name for s in champion.skills] + (
        [f"adapter v{champion.adapter.version}"] if champion.adapter else []
    )
    return ExportResult(out, champion.policy.version, names, files)


def write_export(champion: Champion, prompt: dict[str, Any], tmp: Path, final: Path, by: str) -> None:
    """Every file of the export into `tmp` (`final` is where it will be)."""
    write_policy(champion.policy, prompt, tmp)
    if champion.adapter_path is not None:
        (tmp / "adapter").mkdir()
        for name in ADAPTER_FILES:
            shutil.copyfile(champion.adapter_path / name, tmp / "adapter" / name)
    tools = [s for s in champion.skills if s.kind == "tool"]
    mcp = mcp_command(final, bool(tools), champion.settings.evolution)
    for skill in tools:
        write_files(skill, tmp / "tools" / skill.name)
    if mcp is not None:
        _write_json(tmp / "mcp.json", {"mcpServers": {mcp["name"]: {k: mcp[k] for k in ("command", "args")}}})
    manifest = manifest_of(champion, prompt, mcp, by)
    _write(tmp / "README.md", readme(manifest))
    manifest["files"] = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    _write_json(tmp / "manifest.json", manifest)


def write_policy(policy: Policy, prompt: dict[str, Any], tmp: Path) -> None:
    """What `apply.py` reads of a policy (but the manifest), and apply.py itself."""
    additions = apply_policy(policy, ModelCall(model="")).additions
    _write(tmp / "system_addition.md", "\n\n".join(additions) + "\n" if additions else "")
    _write_json(tmp / "prompt.json", prompt)
    _write_json(tmp / "tools.json", tool_changes(policy))
    shutil.copyfile(export_apply.__file__, tmp / "apply.py")


def tool_changes(policy: Policy) -> dict[str, Any]:
    """What the policy writes into the tools the agent offers, as data `apply.py` interprets."""
    return {
        "rules": [r.model_dump(mode="json") for r in policy.rules],
        "constraints": [c.model_dump(mode="json") for c in policy.constraints],
        "how": {
            "rules": "before each call, every tool with one enumerated parameter (or all parameters "
            "enumerated) is a menu of 'tool: value' entries; each rule, in name order, whose `when` "
            "phrases are all in the latest observation removes the entries matching `avoid` (and, "
            "with `no_repeat`, those already taken from this same observation), then keeps only "
            "those matching `prefer` if any do; a rule that would empty the menu does nothing; "
            "`*` in a pattern is one or more words",
            "constraints": "for each named tool argument without an enum: `from_context` makes it "
            "an enum of the spans of up to 4 words (`whole_line`: the whole lines) of the user and "
            "tool messages so far (numbers: the numbers written there), kept to `shape`, "
            "`min_length` and `max_length` (left alone over 400 values); `max_length` bounds a "
            "string; `integer` makes a number whole",
        },
    }


def prompt_data(
    settings: Settings, policy: Policy, vectors: dict[str, list[float]] | None = None
) -> dict[str, Any]:
    """The prompt skills and solved examples, each with what picks it for a task: the embedding
    ratchet ranks it by (`vectors` by content hash, else the live index's) and its token
    estimate; and the selection's settings."""
    texts = [*policy.skills, *policy.exemplars]
    if vectors is None:
        vectors = _embeddings(settings, texts) if texts else {}
    from ratchet.memory.retrieval import estimate_tokens, skill_document
    from ratchet.memory.vector_index import MODEL_NAME

    def item(s: SkillText) -> dict[str, Any]:
        return {
            "name": s.name,
            "description": s.description,
            "body": s.body,
            "id": s.content_hash,
            "tokens": estimate_tokens(skill_document(s)),
            "embedding": vectors[s.content_hash],
        }

    k = settings.skills
    return {
        "selection": {
            "skills_k": k.k,
            "skills_token_budget": k.token_budget,
            "exemplars_k": k.exemplars,
            "exemplars_token_budget": k.exemplar_budget,
            "query": "the task's input as text (your agent's first user message)",
            "embedding": f"{MODEL_NAME}, normalized to unit length, of 'name\\ndescription\\nbody'",
            "rank": "cosine distance (1 - dot product) rounded to 6 places, then name, then id; "
            "the nearest k, each kept while the shown texts' tokens (ceil(characters / 4)) fit the budget",
            "without_a_query": "every text is shown (system_addition.md)",
        },
        "skills": [item(s) for s in policy.skills],
        "exemplars": [item(s) for s in policy.exemplars],
    }


def _embeddings(settings: Settings, texts: Sequence[SkillText]) -> dict[str, list[float]]:
    """content hash -> the embedding the live retriever ranks it by: the live index's stored
    one, else computed as the index would store it (missing ones together, in order)."""
    from ratchet.flows.runtime import live_retriever
    from ratchet.memory.retrieval import skill_document
    from ratchet.memory.vector_index import embed

    ids = list(dict.fromkeys(s.content_hash for s in texts))
    out: dict[str, list[float]] = {}
    known: set[str] = set()
    if settings.index_dir.is_dir():  # a data dir that never played a rollout has none: not made here
        index = live_retriever(settings).index
        known = set(index.ids()) & set(ids)
        stored = [i for i in ids if i in known]
        out = {i: [float(x) for x in v] for i, v in zip(stored, index.embeddings(stored), strict=True)}
    missing = {s.content_hash: s for s in texts if s.content_hash not in known}
    for lo in range(0, len(missing), 256):  # `SkillRetriever.sync`'s batches
        batch = list(missing.values())[lo : lo + 256]
        vs = embed([skill_document(s) for s in batch])
        out.update((s.content_hash, [float(x) for x in v]) for s, v in zip(batch, vs, strict=True))
    return out


def mcp_command(final: Path, has_tools: bool, evolution: str) -> dict[str, Any] | None:
    """What serves the exported tools to an MCP client (None: the champion has no tools)."""
    if not has_tools:
        return None
    return {
        "name": f"ratchet-{evolution}-tools",
        "command": "ratchet",
        "args": ["tools", "serve", "--from", str(final / "tools")],
        "why": "distilled tool code is untrusted: it runs only in ratchet's sandbox (no network, "
        "read-only system, resource limits), so the export ships the tools as skill folders and "
        "ratchet serves them over MCP (stdio; add --transport http --port N for HTTP)",
    }


def manifest_of(
    champion: Champion, prompt: dict[str, Any], mcp: dict[str, Any] | None, by: str
) -> dict[str, Any]:
    """manifest.json without its `files` (added once every file is written)."""
    s, policy = champion.settings, champion.policy
    candidates = [_skill_entry(skill, champion.skill_records) for skill in champion.skills]
    if champion.adapter is not None:
        candidates.append(_adapter_entry(champion.adapter, champion.adapter_records, champion.adapter_path))
    return {
        "format": FORMAT,
        "policy_version": policy.version,
        "evolution": s.evolution,
        "model": policy.model,
        "served_model": policy.served_model,
        "candidates": candidates,
        "counts": {
            "prompt_skills": len(policy.skills),
            "exemplars": len(policy.exemplars),
            "rules": len(policy.rules),
            "constraints": len(policy.constraints),
            "tools": len(policy.tools),
            "adapter": int(champion.adapter is not None),
        },
        "exemplar_selection": {
            "decision": "every prompt skill and solved example is exported with the embedding ratchet "
            "ranks it by; apply.py given the task's embedding (all-MiniLM-L6-v2, normalized) picks "
            "the same nearest few as ratchet, given none it shows every one (system_addition.md)",
        }
        | {k: v for k, v in prompt["selection"].items() if k.endswith(("_k", "_budget"))},
        "mcp": mcp,
        "provenance": {
            "exported_at": datetime.now(UTC).isoformat(),
            "exported_by": by or "unknown",
            "ratchet_version": __version__,
            "data_dir": str(s.data_dir.resolve()),
            "agent": s.agent.name or None,
            "mlflow_agent_version": _agent_version(s, policy.version),
        },
    }


def _skill_entry(skill: Skill, records: list[Record]) -> dict[str, Any]:
    own = [r for r in records if r.name == skill.name]
    return {
        "kind": skill.kind,
        "name": skill.name,
        "content_hash": skill.content_hash,
        "family": skill.family,
        "generation": skill.generation,
        "description": skill.description,
        **_decisions(skill.name, own),
        "provenance": {"evolution": skill.evolution, "trajectories": list(skill.provenance)},
    }


def _adapter_entry(v: AdapterVersion, records: list[Record], path: Path | None) -> dict[str, Any]:
    config: dict[str, Any] = {}
    if path is not None:
        try:
            config = json.loads((path / "adapter_config.json").read_text())
        except (OSError, ValueError):
            config = {}
    config = config if isinstance(config, dict) else {}
    return {
        "kind": "adapter",
        "name": v.name,
        "content_hash": v.sha256,
        "served_name": v.served_name,
        "base_model": config.get("base_model_name_or_path"),
        "rank": config.get("r"),
        "dataset": v.dataset,
        "config": v.config,
        **_decisions(v.name, records),
        "provenance": {"mlflow_run": v.run_id, "source": v.source},
        "files": [f"adapter/{n}" for n in ADAPTER_FILES],
    }


def _decisions(name: str, records: list[Record]) -> dict[str, Any]:
    """When and by whom a candidate went live (its last promotion), and the gate's evidence."""
    live = next((r for r in reversed(records) if r.to_status == "promoted" and not r.is_amendment), None)
    gated = next((r for r in reversed(records) if "decision" in r.evidence), None)
    evidence = latest_evidence(records).get(name, {})
    return {
        "promoted_at": live.at.isoformat() if live else None,
        "promoted_by": live.who if live else None,
        "promoted_why": live.why if live else None,
        "gate": (
            {k: evidence.get(k) for k in GATE_KEYS}
            | {"at": gated.at.isoformat(), "by": gated.who, "against": evidence.get("champion")}
            if gated is not None
            else None
        ),
    }


def _agent_version(settings: Settings, version: str) -> str | None:
    """The MLflow agent version (LoggedModel id) of this policy version, if one was recorded."""
    try:
        from ratchet.flows.agent_versions import agent_versions

        model = agent_versions(settings).get(version)
    except Exception:  # noqa: BLE001 - provenance only: an export does not need MLflow
        return None
    return getattr(model, "model_id", None)


def readme(m: dict[str, Any]) -> str:
    """README.md of an export: what each file is and how to use it."""
    from ratchet.flows.export_readme import render

    return render(m)


# ------------------------------------------------------------------------ the tools it serves


def exported_tools(directory: Path) -> list[Skill]:
    """The tool skills of an export's `tools/` folder, each checked against its own hashes and,
    where the export's manifest is beside the folder, the content hash it lists."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ExportError(f"{directory} is not a directory", "pass an export's tools/ folder")
    manifest = directory.parent / "manifest.json"
    listed: dict[str, str] | None = None
    if manifest.is_file():
        try:
            entries = json.loads(manifest.read_text(encoding="utf-8"))["candidates"]
            listed = {c["name"]: c["content_hash"] for c in entries if c.get("kind") == "tool"}
        except (OSError, ValueError, KeyError, TypeError):
            raise ExportError(
                f"{manifest} is not an export's manifest", "export the champion again"
            ) from None
    skills = []
    for path in sorted(p.parent for p in directory.glob(f"*/{FILE}")):
        skill = load(path)  # refuses a file changed after it was written
        if skill.kind != "tool":
            raise ExportError(f"{path} is a {skill.kind}, not a tool", "pass an export's tools/ folder")
        if listed is not None and listed.get(skill.name) != skill.content_hash:
            raise ExportError(
                f"{path} is not the tool {manifest} lists (content hash {skill.content_hash})",
                "export the champion again",
            )
        skills.append(skill)
    if not skills:
        raise ExportError(f"no tool skills in {directory}", "pass an export's tools/ folder")
    return skills


# ------------------------------------------------------------------------------ atomic writes


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh hidden directory beside `out`, renamed to `out` when the block succeeds (a
    non-empty `out` is moved aside first and removed after). On an error nothing is left; a
    kill leaves only the hidden directory, which the next export to `out` removes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    tmp = out.parent / f"{_partial_prefix(out)}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        if out.is_dir() and any(out.iterdir()):
            old = out.parent / f"{_partial_prefix(out)}{os.getpid()}-{secrets.token_hex(4)}-old"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)  # onto an empty directory, or where there is none
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove_leftovers(out: Path) -> None:
    """Hidden directories an export to `out` left when it was killed (its process is gone)."""
    pattern = re.compile(re.escape(_partial_prefix(out)) + r"(\d+)-[0-9a-f]+(-old)?$")
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _write_json(path: Path, data: Any) -> None:
    _write(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


__all__ = ["ExportError", "ExportResult", "export_champion", "exported_tools", "read_champion"]
