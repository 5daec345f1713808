"""Adapters as MLflow registered model versions, in the one candidate lifecycle.

One registered model per evolution (`ratchet-<evolution>-adapter`). Each trained adapter is
a model version whose source is the training run's `adapter` artifact, tagged with its
sha256, dataset version and LoRA config hash; a copy lives under `data_dir/adapters/<sha[:16]>`
for the model server to load.

Status is the candidate lifecycle's (`ratchet.lifecycle`, the same store skills use), kept
in `data_dir/adapters/audit.jsonl` under its lock: candidate → verified (gate) → promoted →
retired, or rejected. Adapters are exclusive: of the promoted versions only the newest is
live, the *champion*. A rollback (`Lifecycle.rollback`, the same as a skill's) retires the
champion (and every later promotion), so the version promoted before it is champion again,
or none is (the base model). Adapters are the candidate kind `adapter` (`ADAPTER`,
registered in `ratchet.kinds`: it serves a policy through the adapter). The log is the
truth; the version's `status` tags and the registered model's `champion` alias mirror it and
are rewritten after each change (a process killed in between, or MLflow failing there, leaves
them stale until the next decision brings every version's tags and the alias in line: a
warning, never an error, since the change happened). Before an adapter goes live or is
served, its files are hashed again; a mismatch is refused before anything is recorded.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ratchet import faults
from ratchet.config import Settings
from ratchet.errors import AdapterError, AdapterStateError
from ratchet.files import atomic_dir
from ratchet.kinds import CandidateKind, register
from ratchet.lifecycle import (
    Lifecycle,
    Record,
    Status,
    Warn,
    batch,
    check_input,
    latest_evidence,
    log_warning,
    mirror_failed,
    promoted_order,
)
from ratchet.types import Policy

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
CHAMPION = "champion"
MIRROR = "MLflow registry mirror (status tags, `champion` alias)"


def served_name(sha256: str) -> str:
    """The name a model server knows an adapter by (content-addressed: no two adapters share one)."""
    return f"adapter-{sha256[:12]}"


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


def may_have_adapters(settings: Settings) -> bool:
    """Whether an adapter can have been registered in this data dir (its MLflow store exists):
    readers that must not create state ask this before opening the registry."""
    return (settings.data_dir / "mlflow.db").is_file()


def registered_name(evolution: str) -> str:
    return f"ratchet-{evolution}-adapter"


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
    evidence: dict[str, Any] = field(default_factory=dict)  # of its latest gate decision

    @property
    def served_name(self) -> str:
        """The name the model server knows it by (content-addressed: no two adapters share one)."""
        return served_name(self.sha256)

    @property
    def name(self) -> str:
        """Its name in the lifecycle (and in `ratchet adapters …` commands)."""
        return str(self.version)

    @property
    def kind(self) -> str:
        """Its candidate kind (`ratchet.kinds`): what it does to a policy is `ADAPTER.apply`."""
        return ADAPTER.name


def use_adapter(policy: Policy, adapters: Sequence[AdapterVersion]) -> Policy:
    """An adapter's policy: the same policy served through the adapter. Exclusive: of several,
    the last (the newest promotion) is the one served."""
    if not adapters:
        return policy
    v = adapters[-1]
    return policy.model_copy(update={"adapter": v.served_name, "adapter_hash": v.sha256})


def adapter_template(v: AdapterVersion) -> str:
    return f"LoRA adapter {v.served_name} (sha256 {v.sha256})"


def adapter_label(name: str) -> str:
    return f"adapter v{name}"


ADAPTER = register(
    CandidateKind(
        "adapter",
        "adapters",
        use_adapter,
        adapter_template,
        adapter_label,
        description="a LoRA adapter the server loads",
    )
)


class AdapterRegistry:
    """The adapters of one evolution: MLflow holds what they are, the lifecycle what they are worth."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.name = registered_name(settings.evolution)
        self.root = settings.adapters_dir
        self.lifecycle = Lifecycle(self.root, "adapter version", AdapterStateError, "ratchet adapters list")
        mlflow.set_tracking_uri(settings.mlflow_uri)
        self.client = MlflowClient()

    # -- reads

    def list(self) -> list[AdapterVersion]:
        """Every filed version, oldest first (a version MLflow has but the lifecycle never
        filed was registered by a run killed in between: `register` files it on the rerun)."""
        records = self.lifecycle.records()
        last = {r.name: r for r in records}
        evidence = latest_evidence(records)
        champion = self._champion(records)
        return [
            self._version(mv, last[str(mv.version)], evidence, champion)
            for mv in self._model_versions()
            if str(mv.version) in last
        ]

    def get(self, version: int) -> AdapterVersion:
        found = next((v for v in self.list() if v.version == version), None)
        if found is None:
            raise AdapterStateError(
                f"adapter version {version} is not in the registry {self.name}", "see `ratchet adapters list`"
            )
        return found

    def champion(self) -> AdapterVersion | None:
        """The live adapter: the newest promotion still promoted (None: the base model)."""
        name = self._champion(self.lifecycle.records())
        return None if name is None else self.get(int(name))

    def find(self, dataset: str, config: str) -> AdapterVersion | None:
        """The version already trained on this dataset with this config (training is skipped)."""
        return next((v for v in self.list() if (v.dataset, v.config) == (dataset, config)), None)

    def audit(self) -> list[Record]:
        """Every status change, oldest first (a damaged log is one StateFileError line)."""
        return self.lifecycle.records()

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
        """A new candidate version for the adapter in `adapter_dir` (copied under the registry root)."""
        sha = adapter_sha256(adapter_dir)
        home = self.local_dir(sha)
        if adapter_dir.resolve() != home.resolve():
            with atomic_dir(home) as tmp:
                for name in ADAPTER_FILES:
                    shutil.copy2(adapter_dir / name, tmp / name)
        with self.lifecycle.locked():
            mv = next(
                (
                    m
                    for m in self._model_versions()
                    if (m.tags or {}).get("dataset") == dataset and (m.tags or {}).get("config") == config
                ),
                None,
            )  # a rerun after a kill between registering and filing, or between filing and moving on
            if mv is None:
                try:
                    self.client.create_registered_model(self.name, description="LoRA adapters of the policy")
                except MlflowException as exc:
                    if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                        raise
                tags = {"sha256": sha, "dataset": dataset, "config": config, "status": "candidate"}
                mv = self.client.create_model_version(self.name, source, run_id=run_id, tags=tags)
                faults.point("adapter.created")
            if self.lifecycle.status(str(mv.version)) is None:
                self.lifecycle.file(str(mv.version), who, "trained", content_hash=sha)
        return self.get(int(mv.version))

    def transition(
        self,
        name: str,
        to: Status,
        who: str,
        why: str,
        evidence: dict[str, Any] | None = None,
        expect: Status | None = None,
        warn: Warn | None = None,
    ) -> Record:
        """Move version `name` along the lifecycle; the MLflow tags and alias follow. Raises
        only before the record; MLflow failing after it goes to `warn` (default: the log)."""
        check_input(name, who, why, "adapter version")
        warn = warn or log_warning
        with batch(warn), self.lifecycle.locked():  # the lifecycle's listeners hear of it last
            v = self.get(_number(name))
            if to == "promoted":
                self.checked_path(v)  # never make live files that do not match
            record = self.lifecycle.transition(
                v.name, to, who, why, evidence=evidence, expect=expect, content_hash=v.sha256
            )
            faults.point("adapter.recorded")
            self.mirror(warn, names={record.name})
        return record

    def rollback(self, name: str, who: str, why: str, warn: Warn | None = None) -> list[str]:
        """Retire version `name` and every later promotion; the version promoted before it is
        the champion again (checked first: a rollback must not go live on changed files)."""

        def check(undone: list[str]) -> None:
            back = [n for n in self.lifecycle.promoted() if n not in undone]
            if back:
                self.checked_path(self.get(int(back[-1])))
            for n in undone:
                self.get(int(n))  # every one is a version MLflow still has, before the first record

        def key(n: str) -> str:
            return str(_number(n))  # "03" is version 3

        retire = partial(self.transition, warn=warn)
        return self.lifecycle.rollback(name, who, why, retire, check, key, warn)

    def mirror(self, warn: Warn = log_warning, names: set[str] | None = None) -> None:
        """Bring MLflow in line with the log: the tags of each version (`names` only, if given)
        whose tags disagree with its latest record, and the `champion` alias. Never raises: a
        failure goes to `warn`, and the next decision tries again."""
        try:
            with self.lifecycle.locked():
                records = self.lifecycle.records()
                last = {r.name: r for r in records}
                found = self.client.search_model_versions(f"name = '{self.name}'")
                for mv in found:
                    record = last.get(str(mv.version))
                    if record is None or (names is not None and record.name not in names):
                        continue
                    tags = _tags(record)
                    for key, value in tags.items():
                        if (mv.tags or {}).get(key) != value:
                            self.client.set_model_version_tag(self.name, record.name, key, value)
                if not found:
                    return  # nothing registered yet: no alias to keep
                champion = self._champion(records)
                aliases = self.client.get_registered_model(self.name).aliases
                if champion is not None and str(aliases.get(CHAMPION)) != champion:
                    self.client.set_registered_model_alias(self.name, CHAMPION, champion)
                elif champion is None and CHAMPION in aliases:  # the base model is live
                    self.client.delete_registered_model_alias(self.name, CHAMPION)
        except Exception as exc:  # noqa: BLE001 - the record stands
            warn(mirror_failed(MIRROR, exc))

    # -- internals

    def _model_versions(self) -> list[Any]:
        try:
            found = self.client.search_model_versions(f"name = '{self.name}'")
        except MlflowException:
            return []
        return sorted(found, key=lambda mv: int(mv.version))

    @staticmethod
    def _champion(records: list[Record]) -> str | None:
        return next(reversed(promoted_order(records)), None)

    def _version(
        self, mv: Any, last: Record, evidence: dict[str, dict[str, Any]], champion: str | None
    ) -> AdapterVersion:
        tags = dict(mv.tags or {})
        return AdapterVersion(
            version=int(mv.version),
            sha256=last.content_hash or tags.get("sha256", ""),  # the log's, as filed: a tag can be edited
            dataset=tags.get("dataset", ""),
            config=tags.get("config", ""),
            status=last.to_status,
            run_id=mv.run_id or "",
            source=mv.source or "",
            champion=champion == last.name,
            evidence=evidence.get(last.name, {}),
        )

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


def _tags(record: Record) -> dict[str, str]:
    """The MLflow tags that mirror a version's latest record."""
    return {
        "status": record.to_status,
        "who": record.who,
        "why": record.why[:4000],
        "at": record.at.isoformat(),
        "evidence": json.dumps(record.evidence)[:5000],
    }


def _number(name: str) -> int:
    try:
        return int(name)
    except ValueError:
        raise AdapterStateError(
            f"{name!r} is not an adapter version number", "see `ratchet adapters list`"
        ) from None
