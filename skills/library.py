"""The skill library: SKILL.md folders under the data dir, their lifecycle, a Chroma index.

    <data_dir>/skills/<name>/SKILL.md (+ scripts/)   one folder per skill
    <data_dir>/skills/audit.jsonl                    every status change: who, when, why, evidence
    <data_dir>/index/                                Chroma collection `skills` (name, description, body)

Status lives in the skill lifecycle (`ratchet.lifecycle`, the same store adapters use): its
audit log says a skill's status, not its file. Each change first appends an audit record
(fsynced), then rewrites the SKILL.md's `ratchet-status` to mirror it, under the lifecycle's
lock, so two concurrent promotions of one skill cannot both win: the second finds the status
already changed and gets a SkillStateError. Reading checks the file against the log:

* no audit record at all: the folder was not filed by ratchet (planted or copied by hand):
  refused, never live;
* content hash differs from the one last audited: the text was edited: refused;
* the file's status is the last record's `from_status`: a status change was killed
  between its two writes; the log wins (the change happened) and the next change under
  the lock rewrites the file;
* any other disagreement: a hand edit: refused.

A damaged audit log (a torn line from a kill mid-append, or an edit) is reported in one
line that says how to recover; it is never rewritten behind anyone's back. What this does
not stop: someone who can write the data dir can append a forged record too. The data
dir is trusted storage; distilled text and tool code are not.

A new candidate that is a near-duplicate of an existing skill of the same kind and family
(cosine similarity >= `merge_similarity`) is merged into it (provenance joined) instead
of piling up; a near-duplicate of a rejected skill stays rejected.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ratchet import faults
from ratchet.errors import SkillFileError, SkillStateError
from ratchet.lifecycle import AUDIT, Lifecycle, Record, read_log
from ratchet.memory.vector_index import VectorIndex
from ratchet.skills.format import FILE, Skill, SkillKind, SkillStatus, load, render, write_files

MERGE_SIMILARITY = 0.92
__all__ = ["AUDIT", "AddResult", "SkillLibrary", "read_audit"]


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
        on_change: Callable[[Record], None] | None = None,
    ) -> None:
        self.on_change = on_change  # told of every status change once it is on disk (e.g. MLflow)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.index_dir = index_dir or self.root / ".index"
        self.merge_similarity = merge_similarity
        self.lifecycle = Lifecycle(self.root, "skill", SkillStateError, "ratchet skills list")
        self._index: VectorIndex | None = None

    @property
    def index(self) -> VectorIndex:
        if self._index is None:  # opened on first use: listing skills needs no embedding model
            self._index = VectorIndex(self.index_dir, "skills")
        return self._index

    # -- reading

    def names(self) -> list[str]:
        """Skill folders (hidden ones are half-written staging folders of a killed `add`)."""
        return sorted(p.parent.name for p in self.root.glob(f"*/{FILE}") if not p.parent.name.startswith("."))

    def get(self, name: str) -> Skill:
        """The skill with the status its audit log gives it; refused if the file disagrees."""
        return self._checked(name, self._last_records())

    def _checked(self, name: str, last: dict[str, Record]) -> Skill:
        path = self.root / name / FILE
        if not path.exists():
            raise SkillStateError(f"no skill named {name!r}", "see `ratchet skills list`")
        skill = load(self.root / name)
        record = last.get(name)
        if record is None:
            raise SkillFileError(
                f"{path} has no record in the audit log: ratchet did not file it, so it is not live",
                f"remove {path.parent}; skills enter the library only through `ratchet distill`",
            )
        if record.content_hash != skill.content_hash:
            raise SkillFileError(
                f"{path} was changed after it was filed (its content hash is not the audited one)",
                "restore the file, or distill a new candidate instead of editing one",
            )
        if skill.status == record.to_status:
            return skill
        if skill.status == record.from_status:  # killed between the record and the file: the log wins
            return skill.model_copy(update={"status": record.to_status})
        raise SkillFileError(
            f"{path} says status {skill.status!r} but its audit log says {record.to_status!r}",
            "change status only with `ratchet skills promote|reject|retire`; restore the file",
        )

    def scan(self) -> tuple[list[Skill], list[str]]:
        """Every loadable skill, and one error line for each skill that is refused."""
        skills, errors = [], []
        last = self._last_records()
        for name in self.names():
            try:
                skills.append(self._checked(name, last))
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

    def history(self, name: str | None = None) -> list[Record]:
        return self.lifecycle.records(name)

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
            why = f"distilled from {len(skill.provenance)} trajectories"
            self._write(skill, new=True, filed=(who, why))
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
    ) -> Record:
        """Move a skill along its lifecycle; `expect` guards against acting on a stale view."""
        with self._locked():
            skill = self.get(name)  # the file must still be the one filed
            record = self.lifecycle.transition(
                name, to, who, why, evidence=evidence, expect=expect, content_hash=skill.content_hash
            )  # the log first: from here on the change has happened
            faults.point("skill.recorded")
            self._write(skill.model_copy(update={"status": to}))
            self.index.upsert([name], [_document(skill)], [_metadata(skill) | {"status": to}])
        if self.on_change is not None:
            self.on_change(record)
        faults.point("skill.transition")
        return record

    def rollback(self, name: str, who: str, why: str) -> list[str]:
        """Undo the promotion of `name` and of every skill promoted after it (newest first), so
        the live set is exactly what it was just before `name` went live; returns the retired."""
        with self._locked():
            undone = self.lifecycle.rollback_set(name)
            for n in undone:
                self.transition(n, "retired", who=who, why=f"rollback of {name}: {why}", expect="promoted")
        return undone

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
                if (existing.tool == skill.tool or skill.tool is None) and _acts_alike(existing, skill):
                    return existing
        return None

    def _free_name(self, name: str) -> str:
        # names in the log are taken too: a killed `add` may have recorded one without its folder
        taken = set(self.names()) | set(self._last_records())
        if name not in taken:
            return name
        i = 2
        while f"{name}-{i}" in taken:
            i += 1
        return f"{name}-{i}"[:64]

    def _write(self, skill: Skill, new: bool = False, filed: tuple[str, str] | None = None) -> None:
        """Write a skill folder (new: staged, then filed (who, why) in the lifecycle, then
        renamed into place) or its SKILL.md (update) so that readers never see half."""
        target = self.root / skill.name
        if new:
            staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{skill.name}."))
            try:
                write_files(skill, staging)
                if filed is not None:
                    self.lifecycle.file(skill.name, *filed, content_hash=skill.content_hash)
                    faults.point("skill.filing")
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

    def _last_records(self) -> dict[str, Record]:
        return self.lifecycle.last()

    def _locked(self) -> AbstractContextManager[None]:
        return self.lifecycle.locked()


def read_audit(root: Path) -> list[Record]:
    """The library's audit log at `root` (read strictly: a damaged line is a StateFileError);
    creates nothing, so a preflight can check it before any state is written."""
    return read_log(root, "the skill audit log")


def _document(skill: Skill) -> str:
    return f"{skill.name}\n{skill.description}\n{skill.body}"


def _metadata(skill: Skill) -> dict[str, Any]:
    return {"kind": skill.kind, "status": skill.status, "family": skill.family, "hash": skill.content_hash}


def _acts_alike(a: Skill, b: Skill) -> bool:
    """Two rules are one only if they act alike (their names may differ), two exemplar sets
    only if they show the same solved tasks; other kinds carry neither."""
    if a.exemplars != b.exemplars:
        return False
    if a.rule is None or b.rule is None:
        return a.rule is b.rule
    return a.rule.model_dump(exclude={"name"}) == b.rule.model_dump(exclude={"name"})


def _union(a: list[str], b: list[str]) -> list[str]:
    return list(dict.fromkeys([*a, *b]))


def dump_audit(records: list[Record]) -> str:
    return json.dumps([r.model_dump(mode="json") for r in records], indent=2)
