"""The skill library: SKILL.md folders under the data dir, their lifecycle, a Chroma index.

    <data_dir>/skills/<name>/SKILL.md (+ scripts/)   one folder per skill
    <data_dir>/skills/audit.jsonl                    every status change: who, when, why, evidence
    <data_dir>/index/                                Chroma collection `skills` (name, description, body)

Status lives in the skill lifecycle (`ratchet.lifecycle`, the same store adapters use): its
audit log says a skill's status, not its file. Each change first appends an audit record
(fsynced), then rewrites the SKILL.md's `ratchet-status` and the index entry to mirror it,
under the lifecycle's lock (then the lifecycle's listeners hear of it: MLflow's agent
versions, `ratchet.lifecycle.subscribe`), so two concurrent promotions of one skill cannot both win: the
second finds the status already changed and gets a SkillStateError. Everything that can
refuse a change (the file's hashes, the status) is checked before the record; a mirror that
fails after it is a warning (the change happened) and is written again by the next decision
(`mirror`). Reading checks the file against the log:

* no audit record at all: the folder was not filed by ratchet (planted or copied by hand):
  refused, never live;
* the file's record hash (content and metadata: kind, family, provenance, generation, …;
  `skills/format.py`) is not the one the log pins: the file was edited: refused. (A skill
  filed before record hashes existed is pinned by its content hash only.)
* the file is one mirror write behind the log (its status is one the log gave it earlier, or
  a merge's amendment record holds provenance the file does not have yet): a change was killed
  or its mirror failed between the record and the file; the log wins and the next change
  rewrites the file;
* any other disagreement: a hand edit: refused.

A damaged audit log (a torn line from a kill mid-append, an edit, or a line that does not
follow from the one before it: `ratchet.lifecycle`) is reported in one line that says how
to recover; it is never rewritten behind anyone's back. What this does not stop: someone
who can write the data dir can append a complete forged history. The data dir is trusted
storage; distilled text and tool code are not.

A new candidate that is a near-duplicate of an existing skill of the same kind and family
(cosine similarity >= `merge_similarity`) is merged into it (provenance joined, pinned by an
amendment record that keeps its status) instead of piling up; a near-duplicate of a rejected
skill stays rejected.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from ratchet import faults
from ratchet.errors import SkillFileError, SkillStateError
from ratchet.lifecycle import (
    AUDIT,
    Lifecycle,
    Record,
    Warn,
    batch,
    check_input,
    log_warning,
    mirror_failed,
    read_log,
    shown,
)
from ratchet.memory.vector_index import VectorIndex
from ratchet.skills.format import (
    FILE,
    NAME_MAX,
    NAME_RE,
    Skill,
    SkillStatus,
    load,
    render,
    write_files,
)
from ratchet.types import ConstraintSpec, RuleSpec

MERGE_SIMILARITY = 0.92
INDEX_RETRY = "it is retried by the next decision"
FILE_RETRY = "the audit log holds the change; the file is retried by the next decision"
__all__ = ["AUDIT", "AddResult", "SkillLibrary", "read_audit"]


@dataclass(frozen=True)
class Filed:
    """What the audit log says of one skill: its latest record and every status it has had."""

    last: Record
    statuses: frozenset[str]


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
        self._index_error: Exception | None = None

    @property
    def index(self) -> VectorIndex:
        if self._index is None:  # opened on first use: listing skills needs no embedding model
            if self._index_error is not None:  # Chroma keeps a failed open broken for the process
                raise self._index_error
            try:
                self._index = VectorIndex(self.index_dir, "skills")
            except Exception as exc:
                self._index_error = exc
                raise
        return self._index

    # -- reading

    def names(self) -> list[str]:
        """Skill folders (hidden ones are half-written staging folders of a killed `add`)."""
        return sorted(p.parent.name for p in self.root.glob(f"*/{FILE}") if not p.parent.name.startswith("."))

    def get(self, name: str) -> Skill:
        """The skill with the status its audit log gives it; refused if the file disagrees."""
        return self._checked(name, self._state())

    def _checked(self, name: str, state: dict[str, Filed]) -> Skill:
        return self._view(name, state)[0]

    def _view(self, name: str, state: dict[str, Filed]) -> tuple[Skill, bool]:
        """The skill as the log says it is, and whether its file lags behind the log."""
        if not isinstance(name, str) or len(name) > NAME_MAX or not NAME_RE.match(name):
            size = f"{len(name)} characters" if isinstance(name, str) else type(name).__name__
            raise SkillStateError(f"no skill named {shown(str(name))} ({size})", "see `ratchet skills list`")
        path = self.root / name / FILE
        if not path.exists():
            raise SkillStateError(f"no skill named {name!r}", "see `ratchet skills list`")
        skill = load(self.root / name)
        filed = state.get(name)
        if filed is None:
            raise SkillFileError(
                f"{path} has no record in the audit log: ratchet did not file it, so it is not live",
                f"remove {path.parent}; skills enter the library only through `ratchet distill`",
            )
        record, lagging = filed.last, False
        if not _pinned(record.content_hash, skill):
            amended = record.evidence.get("provenance") if record.is_amendment else None
            joined = skill.model_copy(update={"provenance": amended}) if isinstance(amended, list) else None
            if joined is None or not _pinned(record.content_hash, joined):
                raise SkillFileError(
                    f"{path} was changed after it was filed (its record hash is not the audited one)",
                    "restore the file, or distill a new candidate instead of editing one",
                )
            skill, lagging = joined, True  # killed between a merge's record and its file: the log wins
        if skill.status == record.to_status:
            return skill, lagging
        if skill.status in filed.statuses:  # a status mirror not (yet) written: the log wins
            return skill.model_copy(update={"status": record.to_status}), True
        raise SkillFileError(
            f"{path} says status {skill.status!r} but its audit log says {record.to_status!r}",
            "change status only with `ratchet skills promote|reject|retire`; restore the file",
        )

    def scan(self) -> tuple[list[Skill], list[str]]:
        """Every loadable skill, and one error line for each skill that is refused."""
        skills, errors = [], []
        state = self._state()
        for name in self.names():
            try:
                skills.append(self._checked(name, state))
            except (SkillFileError, SkillStateError) as exc:
                errors.append(str(exc))
        return skills, errors

    def list(
        self, status: SkillStatus | None = None, kind: str | None = None, family: str | None = None
    ) -> list[Skill]:
        skills, _ = self.scan()
        return [
            s
            for s in skills
            if (status is None or s.status == status)
            and (kind is None or s.kind == kind)
            and (family is None or s.family == family)
        ]

    def history(self, name: str | None = None, amendments: bool = False) -> list[Record]:
        """Every status change, oldest first (of `name` only, if given); with `amendments`, also
        the records that re-pinned a skill without moving it (a merge's joined provenance)."""
        return [r for r in self.lifecycle.records(name) if amendments or not r.is_amendment]

    # -- writing

    def add(self, skill: Skill, who: str = "distill", warn: Warn | None = None) -> AddResult:
        """File a new candidate, or merge it into a near-duplicate already in the library (its
        joined provenance pinned by an amendment record)."""
        if skill.status != "candidate":
            raise SkillStateError(f"new skills enter as candidates, not {skill.status!r}")
        warn = warn or log_warning
        with batch(warn):  # listeners hear of the filing once the folder and its index entry are there
            return self._add(skill, who, warn)

    def _add(self, skill: Skill, who: str, warn: Warn) -> AddResult:
        record = None
        with self._locked():
            twin = self._near_duplicate(skill)  # needs the index: a broken one refuses before any record
            if twin is not None:
                merged = twin.model_copy(update={"provenance": _union(twin.provenance, skill.provenance)})
                if merged.provenance != twin.provenance:
                    why = f"merged a near-duplicate distilled from {len(skill.provenance)} trajectories"
                    record = self.lifecycle.amend(
                        twin.name, who, why, merged.record_hash, evidence={"provenance": merged.provenance}
                    )
                    self._mirror_file(merged, warn)
                if record is not None:
                    self._tell(record, warn)
                return AddResult(twin.name, "merged", twin.status)
            name = self._free_name(skill.name)
            skill = skill.model_copy(update={"name": name})
            why = f"distilled from {len(skill.provenance)} trajectories"
            self._write(skill, new=True, filed=(who, why))
            self._mirror_index([skill], warn)
        self._tell(self.history(name)[-1], warn)
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
        warn: Warn | None = None,
    ) -> Record:
        """Move a skill along its lifecycle; `expect` guards against acting on a stale view.
        Raises only before the record; a mirror failing after it goes to `warn` (default: the
        log), since the change has happened."""
        check_input(name, who, why, "skill")
        warn = warn or log_warning
        with batch(warn):  # the lifecycle's listeners hear of it after the mirrors below
            with self._locked():
                skill = self.get(name)  # the file must still be the one filed
                record = self.lifecycle.transition(
                    name, to, who, why, evidence=evidence, expect=expect
                )  # the log first (it keeps the pin): from here on the change has happened
                faults.point("skill.recorded")
                moved = skill.model_copy(update={"status": to})
                self._mirror_file(moved, warn)
                self._mirror_index([moved], warn)
            self._tell(record, warn)
        faults.point("skill.transition")
        return record

    def rollback(self, name: str, who: str, why: str, warn: Warn | None = None) -> list[str]:
        """Undo the promotion of `name` and of every skill promoted after it (newest first), so
        the live set is exactly what it was just before `name` went live; returns the retired.
        Every one of them is checked before the first is retired (`Lifecycle.rollback`)."""

        def check(undone: list[str]) -> None:
            state = self._state()
            for n in undone:
                self._checked(n, state)  # each file is still the one filed

        retire = partial(self.transition, warn=warn)
        return self.lifecycle.rollback(name, who, why, retire, check, warn=warn)

    def mirror(self, warn: Warn = log_warning) -> None:
        """Bring every mirror of the log in line: each SKILL.md whose status (or merged
        provenance) lags, and every index entry that is missing or stale. Never raises: a
        failure goes to `warn`. Refused skills are left as they are."""
        try:
            with self._locked():
                state = self._state()
                skills = []
                for name in self.names():
                    try:
                        skill, lagging = self._view(name, state)
                    except (SkillFileError, SkillStateError):
                        continue
                    skills.append(skill)
                    if lagging:
                        self._mirror_file(skill, warn)
                try:
                    known = {h.id: h.metadata for h in self.index.get([s.name for s in skills])}
                except Exception as exc:  # noqa: BLE001 - reported, the log stands
                    warn(mirror_failed("vector index mirror", exc, INDEX_RETRY))
                    return
                self._mirror_index([s for s in skills if known.get(s.name) != _metadata(s)], warn)
        except Exception as exc:  # noqa: BLE001 - reported, the log stands
            warn(mirror_failed("skill library's mirror", exc))

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
                    self.lifecycle.file(skill.name, *filed, content_hash=skill.record_hash)
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

    def _mirror_file(self, skill: Skill, warn: Warn) -> None:
        """Rewrite a SKILL.md after its record; a failure is a warning (the reader believes the log)."""
        try:
            self._write(skill)
        except Exception as exc:  # noqa: BLE001 - the record stands
            warn(mirror_failed(f"SKILL.md mirror of {skill.name}", exc, FILE_RETRY))

    def _mirror_index(self, skills: list[Skill], warn: Warn) -> None:
        """Upsert these skills' index entries; a failure is a warning (`mirror` retries)."""
        if not skills:
            return
        try:
            self.index.upsert(
                [s.name for s in skills], [_document(s) for s in skills], [_metadata(s) for s in skills]
            )
        except Exception as exc:  # noqa: BLE001 - the record stands
            warn(mirror_failed("vector index mirror", exc, INDEX_RETRY))

    def _tell(self, record: Record, warn: Warn | None) -> None:
        """`on_change` (MLflow's audit copy) of a record on disk; a failure is a warning."""
        if self.on_change is None:
            return
        try:
            self.on_change(record)
        except Exception as exc:  # noqa: BLE001 - the record stands
            (warn or log_warning)(
                mirror_failed("MLflow copy of the audit record", exc, "the audit log holds it")
            )

    def _state(self) -> dict[str, Filed]:
        """name -> what the log says of it (one read of the log)."""
        last: dict[str, Record] = {}
        statuses: dict[str, set[str]] = {}
        for r in self.lifecycle.records():
            last[r.name] = r
            statuses.setdefault(r.name, set()).add(r.to_status)
        return {n: Filed(r, frozenset(statuses[n])) for n, r in last.items()}

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


def _pinned(pin: str, skill: Skill) -> bool:
    """Whether the log's pin is this file: its record hash, or (a skill filed before record
    hashes) its content hash."""
    return pin in (skill.record_hash, skill.content_hash)


def _metadata(skill: Skill) -> dict[str, Any]:
    return {"kind": skill.kind, "status": skill.status, "family": skill.family, "hash": skill.content_hash}


def _acts_alike(a: Skill, b: Skill) -> bool:
    """Two rules or two constraints are one only if they act alike (their names may differ),
    two exemplar sets only if they show the same solved tasks; other kinds carry none."""
    return (
        a.exemplars == b.exemplars
        and _data(a.rule) == _data(b.rule)
        and _data(a.constraint) == _data(b.constraint)
    )


def _data(spec: RuleSpec | ConstraintSpec | None) -> dict[str, Any] | None:
    """What a rule or a constraint does, without the name it was filed under."""
    return None if spec is None else spec.model_dump(exclude={"name"})


def _union(a: list[str], b: list[str]) -> list[str]:
    return list(dict.fromkeys([*a, *b]))
