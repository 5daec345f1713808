"""The skill library: SKILL.md folders under the data dir, their lifecycle, a Chroma index.

    <data_dir>/skills/<name>/SKILL.md (+ scripts/)   one folder per skill
    <data_dir>/skills/audit.jsonl                    every status change: who, when, why, evidence
    <data_dir>/index/                                Chroma collection `skills` (name, description, body)

Status moves only along `TRANSITIONS`; each change rewrites the SKILL.md atomically and
appends an audit record, under an exclusive `flock` on the library, so two concurrent
promotions of one skill cannot both win: the second finds the status already changed and
gets a SkillStateError. The audit log is also the check on hand edits: a SKILL.md whose
status disagrees with its last audit record is refused.

A new candidate that is a near-duplicate of an existing skill of the same kind and family
(cosine similarity >= `merge_similarity`) is merged into it (provenance joined) instead
of piling up; a near-duplicate of a rejected skill stays rejected.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from memory.vector_index import VectorIndex
from ratchet import faults
from ratchet.errors import SkillFileError, SkillStateError
from skills.format import FILE, TRANSITIONS, Skill, SkillKind, SkillStatus, load, render, write_files

AUDIT = "audit.jsonl"
MERGE_SIMILARITY = 0.92


class AuditRecord(BaseModel):
    skill: str
    from_status: SkillStatus | None
    to_status: SkillStatus
    who: str
    why: str
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    content_hash: str
    evidence: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class AddResult:
    name: str
    action: Literal["added", "merged"]
    into_status: SkillStatus


class SkillLibrary:
    """Skills on disk plus their index. One writer process at a time (Chroma's rule too)."""

    def __init__(
        self,
        root: Path,
        index_dir: Path | None = None,
        merge_similarity: float = MERGE_SIMILARITY,
        on_change: Callable[[AuditRecord], None] | None = None,
    ) -> None:
        self.on_change = on_change  # told of every status change once it is on disk (e.g. MLflow)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.index_dir = index_dir or self.root / ".index"
        self.merge_similarity = merge_similarity
        self._index: VectorIndex | None = None

    @property
    def index(self) -> VectorIndex:
        if self._index is None:  # opened on first use: listing skills needs no embedding model
            self._index = VectorIndex(self.index_dir, "skills")
        return self._index

    # -- reading

    def names(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob(f"*/{FILE}"))

    def get(self, name: str) -> Skill:
        if not (self.root / name / FILE).exists():
            raise SkillStateError(f"no skill named {name!r}", "see `ratchet skills list`")
        skill = load(self.root / name)
        last = self._last_status().get(name)
        if last is not None and last != skill.status:
            raise SkillFileError(
                f"{self.root / name / FILE} says status {skill.status!r} but its audit log says {last!r}",
                "change status only with `ratchet skills promote|reject|retire`; restore the file",
            )
        return skill

    def scan(self) -> tuple[list[Skill], list[str]]:
        """Every loadable skill, and one error line for each skill that is refused."""
        skills, errors = [], []
        for name in self.names():
            try:
                skills.append(self.get(name))
            except (SkillFileError, SkillStateError) as exc:
                errors.append(str(exc))
        return skills, errors

    def list(
        self, status: SkillStatus | None = None, kind: SkillKind | None = None, family: str | None = None
    ) -> list[Skill]:
        skills, _ = self.scan()
        return [
            s
            for s in skills
            if (status is None or s.status == status)
            and (kind is None or s.kind == kind)
            and (family is None or s.family == family)
        ]

    def history(self, name: str | None = None) -> list[AuditRecord]:
        path = self.root / AUDIT
        if not path.exists():
            return []
        records = [AuditRecord.model_validate_json(line) for line in path.read_text().splitlines() if line]
        return [r for r in records if name is None or r.skill == name]

    # -- writing

    def add(self, skill: Skill, who: str = "distill") -> AddResult:
        """File a new candidate, or merge it into a near-duplicate already in the library."""
        if skill.status != "candidate":
            raise SkillStateError(f"new skills enter as candidates, not {skill.status!r}")
        with self._locked():
            twin = self._near_duplicate(skill)
            if twin is not None:
                merged = twin.model_copy(update={"provenance": _union(twin.provenance, skill.provenance)})
                self._write(merged)
                return AddResult(twin.name, "merged", twin.status)
            name = self._free_name(skill.name)
            skill = skill.model_copy(update={"name": name})
            self._write(skill, new=True)
            self._append(
                AuditRecord(
                    skill=name,
                    from_status=None,
                    to_status="candidate",
                    who=who,
                    why=f"distilled from {len(skill.provenance)} trajectories",
                    content_hash=skill.content_hash,
                )
            )
            self.index.upsert([name], [_document(skill)], [_metadata(skill)])
        if self.on_change is not None:
            self.on_change(self.history(name)[-1])
        faults.point("skill.added")
        return AddResult(name, "added", "candidate")

    def transition(
        self,
        name: str,
        to: SkillStatus,
        who: str,
        why: str,
        evidence: dict[str, Any] | None = None,
        expect: SkillStatus | None = None,
    ) -> AuditRecord:
        """Move a skill along its lifecycle; `expect` guards against acting on a stale view."""
        with self._locked():
            skill = self.get(name)
            if expect is not None and skill.status != expect:
                raise SkillStateError(
                    f"skill {name!r} is {skill.status}, not {expect} (someone else changed it)",
                    "reload and decide again",
                )
            if to not in TRANSITIONS[skill.status]:
                allowed = ", ".join(sorted(TRANSITIONS[skill.status])) or "nothing"
                problem = f"skill {name!r} is {skill.status}: it can move to {allowed}, not {to}"
                raise SkillStateError(problem)
            record = AuditRecord(
                skill=name,
                from_status=skill.status,
                to_status=to,
                who=who,
                why=why,
                content_hash=skill.content_hash,
                evidence=evidence or {},
            )
            self._write(skill.model_copy(update={"status": to}))
            self._append(record)
            self.index.upsert([name], [_document(skill)], [_metadata(skill) | {"status": to}])
        if self.on_change is not None:
            self.on_change(record)
        faults.point("skill.transition")
        return record

    def rollback(self, name: str, who: str, why: str) -> list[str]:
        """Undo the promotion of `name` and of every skill promoted after it (newest first), so
        the live set is exactly what it was just before `name` went live; returns the retired."""
        promotions = [r.skill for r in self.history() if r.to_status == "promoted"]
        if name not in promotions or self.get(name).status != "promoted":
            raise SkillStateError(
                f"skill {name!r} is not live", "rollback undoes a promotion: see `skills list`"
            )
        since = promotions[promotions.index(name) :]
        live = [n for n in dict.fromkeys(reversed(since)) if self.get(n).status == "promoted"]
        for n in live:
            self.transition(n, "retired", who=who, why=f"rollback of {name}: {why}", expect="promoted")
        return live

    def search(self, text: str, k: int = 5) -> list[tuple[Skill, float]]:
        """Skills most similar to `text` (cosine similarity), for `ratchet skills list --like`."""
        out = []
        for hit in self.index.query(text, k):
            if (self.root / hit.id / FILE).exists():
                out.append((self.get(hit.id), 1.0 - hit.distance))
        return out

    # -- internals

    def _near_duplicate(self, skill: Skill) -> Skill | None:
        if not self.names():
            return None
        where = {"$and": [{"kind": skill.kind}, {"family": skill.family}]}
        for hit in self.index.query(_document(skill), 3, where=where):
            if 1.0 - hit.distance >= self.merge_similarity and (self.root / hit.id / FILE).exists():
                existing = self.get(hit.id)
                if existing.tool == skill.tool or skill.tool is None:
                    return existing
        return None

    def _free_name(self, name: str) -> str:
        taken = set(self.names())
        if name not in taken:
            return name
        i = 2
        while f"{name}-{i}" in taken:
            i += 1
        return f"{name}-{i}"[:64]

    def _write(self, skill: Skill, new: bool = False) -> None:
        """Write a skill folder (new) or its SKILL.md (update) so that readers never see half."""
        target = self.root / skill.name
        if new:
            staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{skill.name}."))
            try:
                write_files(skill, staging)
                os.rename(staging, target)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".SKILL.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(render(skill))
            os.replace(tmp, target / FILE)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _append(self, record: AuditRecord) -> None:
        with open(self.root / AUDIT, "a", encoding="utf-8") as f:
            f.write(record.model_dump_json() + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _last_status(self) -> dict[str, str]:
        return {r.skill: r.to_status for r in self.history()}

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _document(skill: Skill) -> str:
    return f"{skill.name}\n{skill.description}\n{skill.body}"


def _metadata(skill: Skill) -> dict[str, Any]:
    return {"kind": skill.kind, "status": skill.status, "family": skill.family, "hash": skill.content_hash}


def _union(a: list[str], b: list[str]) -> list[str]:
    return list(dict.fromkeys([*a, *b]))


def dump_audit(records: list[AuditRecord]) -> str:
    return json.dumps([r.model_dump(mode="json") for r in records], indent=2)
