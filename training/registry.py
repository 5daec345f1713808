"""Adapters as MLflow registered model versions; the alias `champion` is the live one.

One registered model per evolution (`ratchet-<evolution>-adapter`). Each trained adapter is
a model version whose source is the training run's `adapter` artifact, tagged with its
sha256, dataset version and LoRA config hash; a copy lives under `data_dir/adapters/<sha[:16]>`
for the model server to load. Lifecycle, as version tags:

    candidate ─(gate passes)→ verified ─(auto, or a person)→ promoted ─(rollback)→ retired
        └──(gate fails)→ rejected

Only a promoted version carries the `champion` alias, and it moves only on a passed gate
or a person's decision; `rollback` moves it back to the previously promoted version (or
removes it: the base model). Changes happen under an exclusive `flock` with an expected
status, so two concurrent promotions cannot both win, and each appends an audit record
(who, when, why, evidence) to `data_dir/adapters/audit.jsonl` and to the version's tags.
Before an adapter is served, its files are hashed again; a mismatch is refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ConfigDict, Field

from ratchet.config import Settings
from ratchet.errors import AdapterError, AdapterStateError
from ratchet.files import append_line, atomic_dir, exclusive, read_jsonl

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
CHAMPION = "champion"
STATUSES = ("candidate", "verified", "rejected", "promoted", "retired")


def adapter_sha256(adapter_dir: Path) -> str:
    """sha256 over the files that define an adapter (config and weights), in a fixed order."""
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        path = adapter_dir / name
        if not path.is_file():
            raise AdapterError(f"{adapter_dir} is not a complete adapter (no {name})", "train it again")
        h.update(name.encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def registered_name(evolution: str) -> str:
    return f"ratchet-{evolution}-adapter"


class AdapterAuditRecord(BaseModel):
    """One line of `adapters/audit.jsonl`: a status change of an adapter version."""

    model_config = ConfigDict(populate_by_name=True)

    version: int
    from_: str = Field(alias="from")
    to: str
    who: str
    why: str
    at: str
    evidence: dict[str, Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class AdapterVersion:
    version: int
    sha256: str
    dataset: str
    config: str
    status: str
    run_id: str
    source: str
    champion: bool = False
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def served_name(self) -> str:
        """The name the model server knows it by (content-addressed: no two adapters share one)."""
        return f"adapter-{self.sha256[:12]}"

    @property
    def evidence(self) -> dict[str, Any]:
        return json.loads(self.tags.get("evidence", "{}"))


class AdapterRegistry:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.name = registered_name(settings.evolution)
        self.root = settings.adapters_dir
        mlflow.set_tracking_uri(settings.mlflow_uri)
        self.client = MlflowClient()

    # -- reads

    def list(self) -> list[AdapterVersion]:
        try:
            found = self.client.search_model_versions(f"name = '{self.name}'")
        except MlflowException:
            return []
        champion = self._champion_version()
        return sorted((self._version(mv, champion) for mv in found), key=lambda v: v.version)

    def get(self, version: int) -> AdapterVersion:
        try:
            mv = self.client.get_model_version(self.name, str(version))
        except MlflowException:
            raise AdapterStateError(
                f"adapter version {version} is not in the registry {self.name}", "see `ratchet adapters list`"
            ) from None
        return self._version(mv, self._champion_version())

    def champion(self) -> AdapterVersion | None:
        v = self._champion_version()
        return None if v is None else self.get(v)

    def find(self, dataset: str, config: str) -> AdapterVersion | None:
        """The version already trained on this dataset with this config (training is skipped)."""
        return next((v for v in self.list() if (v.dataset, v.config) == (dataset, config)), None)

    def local_dir(self, sha: str) -> Path:
        return self.root / sha[:16]

    def checked_path(self, v: AdapterVersion) -> Path:
        """The adapter's directory, its files hashed again: a copy that changed is refused."""
        path = self.local_dir(v.sha256)
        if not path.is_dir():
            self._restore(v, path)
        actual = adapter_sha256(path)
        if actual != v.sha256:
            raise AdapterError(
                f"adapter version {v.version} at {path} has sha256 {actual[:12]}…, its registry tag says "
                f"{v.sha256[:12]}… (the files changed)",
                f"delete {path} to restore it from the MLflow artifact, or roll back",
            )
        return path

    # -- writes

    def register(
        self, adapter_dir: Path, run_id: str, source: str, dataset: str, config: str, who: str
    ) -> AdapterVersion:
        """A new candidate version for the adapter in `adapter_dir` (moved under the registry root)."""
        sha = adapter_sha256(adapter_dir)
        home = self.local_dir(sha)
        if adapter_dir.resolve() != home.resolve():
            with atomic_dir(home) as tmp:
                for name in ADAPTER_FILES:
                    shutil.copy2(adapter_dir / name, tmp / name)
        with self._locked():
            existing = self.find(dataset, config)
            if existing is not None:  # a rerun after a kill between registering and moving on
                return existing
            try:
                self.client.create_registered_model(self.name, description="LoRA adapters of the policy")
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            tags = {"sha256": sha, "dataset": dataset, "config": config, "status": "candidate"}
            mv = self.client.create_model_version(self.name, source, run_id=run_id, tags=tags)
            self._audit(int(mv.version), "", "candidate", who, "trained", {})
        return self.get(int(mv.version))

    def decide(self, version: int, to: str, who: str, why: str, evidence: dict[str, Any]) -> AdapterVersion:
        """The gate's verdict on a candidate: verified or rejected, with its evidence."""
        if to not in ("verified", "rejected"):
            raise ValueError(to)
        with self._locked():
            v = self._expect(version, ("candidate",))
            self._set(v, to, who, why, evidence)
        return self.get(version)

    def promote(self, version: int, who: str, why: str) -> AdapterVersion:
        """Make a verified (or formerly promoted) version the champion."""
        with self._locked():
            v = self._expect(version, ("verified", "retired", "promoted"))
            if v.champion:
                raise AdapterStateError(f"adapter version {version} is already the champion")
            if v.status == "retired" and not v.evidence.get("decision") == "accept":
                raise AdapterStateError(f"adapter version {version} never passed the gate")
            self.checked_path(v)  # never point the alias at files that do not match
            seq = 1 + max((int(x.tags.get("promoted_seq", 0)) for x in self.list()), default=0)
            self.client.set_model_version_tag(self.name, str(version), "promoted_seq", str(seq))
            self._set(v, "promoted", who, why, v.evidence)
            self.client.set_registered_model_alias(self.name, CHAMPION, str(version))
        return self.get(version)

    def rollback(self, who: str, why: str) -> AdapterVersion | None:
        """Retire the champion; the alias goes back to the previously promoted version (or away)."""
        with self._locked():
            current = self.champion()
            if current is None:
                raise AdapterStateError("there is no champion adapter to roll back", "nothing to do")
            earlier = [
                v
                for v in self.list()
                if v.status == "promoted"
                and v.version != current.version
                and int(v.tags.get("promoted_seq", 0)) < int(current.tags.get("promoted_seq", 0))
            ]
            previous = max(earlier, key=lambda v: int(v.tags.get("promoted_seq", 0)), default=None)
            if previous is None:
                self.client.delete_registered_model_alias(self.name, CHAMPION)
            else:
                self.checked_path(previous)
                self.client.set_registered_model_alias(self.name, CHAMPION, str(previous.version))
            self._set(current, "retired", who, why, current.evidence)
        return None if previous is None else self.get(previous.version)

    def audit(self) -> list[dict[str, Any]]:
        """Every status change, oldest first (a damaged log is one StateFileError line)."""
        records = read_jsonl(self.root / "audit.jsonl", AdapterAuditRecord, "the adapter audit log")
        return [r.model_dump(by_alias=True) for r in records]

    # -- internals

    def _champion_version(self) -> int | None:
        try:
            return int(self.client.get_model_version_by_alias(self.name, CHAMPION).version)
        except MlflowException:
            return None

    def _version(self, mv: Any, champion: int | None) -> AdapterVersion:
        tags = dict(mv.tags or {})
        return AdapterVersion(
            version=int(mv.version),
            sha256=tags.get("sha256", ""),
            dataset=tags.get("dataset", ""),
            config=tags.get("config", ""),
            status=tags.get("status", "candidate"),
            run_id=mv.run_id or "",
            source=mv.source or "",
            champion=champion == int(mv.version),
            tags=tags,
        )

    def _expect(self, version: int, allowed: tuple[str, ...]) -> AdapterVersion:
        v = self.get(version)
        if v.status not in allowed:
            raise AdapterStateError(
                f"adapter version {version} is {v.status}, not {' or '.join(allowed)}",
                "see `ratchet adapters show " + str(version) + "`",
            )
        return v

    def _set(self, v: AdapterVersion, to: str, who: str, why: str, evidence: dict[str, Any]) -> None:
        for key, value in {
            "status": to,
            "who": who,
            "why": why[:4000],
            "at": datetime.now(UTC).isoformat(),
            "evidence": json.dumps(evidence)[:5000],
        }.items():
            self.client.set_model_version_tag(self.name, str(v.version), key, value)
        self._audit(v.version, v.status, to, who, why, evidence)

    def _audit(
        self, version: int, before: str, to: str, who: str, why: str, evidence: dict[str, Any]
    ) -> None:
        record = {
            "version": version,
            "from": before,
            "to": to,
            "who": who,
            "why": why,
            "at": datetime.now(UTC).isoformat(),
            "evidence": evidence,
        }
        append_line(self.root / "audit.jsonl", json.dumps(record))

    def _restore(self, v: AdapterVersion, path: Path) -> None:
        """Bring back a local copy from the MLflow artifact (the data dir was moved or pruned)."""
        try:
            got = Path(
                mlflow.artifacts.download_artifacts(artifact_uri=v.source, dst_path=str(self.root / ".dl"))
            )
        except Exception as exc:  # noqa: BLE001 - any failure means the adapter is gone
            raise AdapterError(
                f"adapter version {v.version} has no local copy and {v.source} cannot be read ({exc})",
                "roll back to another version or train again",
            ) from None
        path.parent.mkdir(parents=True, exist_ok=True)
        got.rename(path)
        shutil.rmtree(self.root / ".dl", ignore_errors=True)

    def _locked(self) -> AbstractContextManager[None]:
        return exclusive(self.root / ".lock")
