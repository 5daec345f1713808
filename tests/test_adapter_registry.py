"""The adapter registry on a real MLflow store: lifecycle, alias, rollback, races, integrity."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException

from ratchet.config import load_settings
from ratchet.decisions import apply, decide
from ratchet.errors import AdapterError, AdapterStateError, StateFileError
from ratchet.training.registry import CHAMPION, AdapterRegistry, adapter_sha256


def _adapter(root: Path, seed: int) -> Path:
    """Files shaped like a peft adapter; the registry only hashes and copies them."""
    d = root / f"a{seed}"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16}))
    (d / "adapter_model.safetensors").write_bytes(bytes([seed]) * 64)
    return d


@pytest.fixture
def registry(tmp_path: Path) -> AdapterRegistry:
    return AdapterRegistry(load_settings({"data_dir": tmp_path / "data"}))


def _passed(registry: AdapterRegistry, tmp_path: Path, seed: int) -> int:
    v = registry.register(_adapter(tmp_path, seed), "", f"file:///x/{seed}", f"d{seed}", "c", who="test")
    evidence = {"decision": "accept", "repairs": 5, "regressions": 0, "p_value": 0.03, "rollouts": 16}
    registry.transition(v.name, "verified", who="gate", why="significant", evidence=evidence)
    return v.version


def _two_promoted(registry: AdapterRegistry, tmp_path: Path) -> tuple[int, int]:
    """Two versions promoted in turn: the second is the champion, the first still promoted."""
    first, second = _passed(registry, tmp_path, 1), _passed(registry, tmp_path, 2)
    decide(registry, str(first), "promote", who="me", why="gen 1")
    decide(registry, str(second), "promote", who="me", why="gen 2")
    return first, second


def _alias(registry: AdapterRegistry) -> int | None:
    try:
        return int(registry.client.get_model_version_by_alias(registry.name, CHAMPION).version)
    except MlflowException:
        return None


def test_the_alias_moves_only_for_a_version_that_passed_the_gate(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    v = registry.register(_adapter(tmp_path, 1), "", "file:///x", "d1", "c", who="test")
    assert (v.status, v.champion) == ("candidate", False)
    assert registry.find("d1", "c") == v and registry.find("d1", "other") is None
    with pytest.raises(AdapterStateError, match="candidate"):
        decide(registry, v.name, "promote", who="me", why="looks good")
    registry.transition(v.name, "rejected", who="gate", why="no gain", evidence={"decision": "reject"})
    with pytest.raises(AdapterStateError, match="rejected"):
        decide(registry, v.name, "promote", who="me", why="anyway")
    assert registry.champion() is None and _alias(registry) is None
    good = _passed(registry, tmp_path, 2)
    decide(registry, str(good), "promote", who="me", why="passed")
    promoted = registry.get(good)
    assert promoted.champion and promoted.status == "promoted"
    assert registry.champion() == promoted and _alias(registry) == good
    assert promoted.evidence["p_value"] == 0.03  # the gate's evidence, not the person's
    tags = registry.client.get_model_version(registry.name, str(good)).tags
    assert (tags["status"], tags["who"]) == ("promoted", "me")  # MLflow mirrors the lifecycle
    trail = [(r.name, r.from_status, r.to_status, r.who) for r in registry.audit()]
    assert trail == [
        ("1", None, "candidate", "test"),
        ("1", "candidate", "rejected", "gate"),
        ("2", None, "candidate", "test"),
        ("2", "candidate", "verified", "gate"),
        ("2", "verified", "promoted", "me"),
    ]


def test_rollback_restores_the_previous_champion_then_the_base_model(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    first, second = _two_promoted(registry, tmp_path)
    assert registry.champion().version == second and _alias(registry) == second
    assert decide(registry, str(second), "rollback", who="me", why="regressed in production") == [str(second)]
    back = registry.champion()
    assert back is not None and back.version == first and _alias(registry) == first
    assert registry.get(second).status == "retired"
    # a retired version passed the gate once: a person may make it live again
    decide(registry, str(second), "promote", who="me", why="it was the data, not the adapter")
    assert registry.champion().version == second
    # rolling back the first promotion undoes every later one too: the base model is live
    assert decide(registry, str(first), "rollback", who="me", why="start over") == [str(second), str(first)]
    assert registry.champion() is None and _alias(registry) is None
    with pytest.raises(AdapterStateError, match="not live"):
        decide(registry, str(first), "rollback", who="me", why="nothing left")


def test_two_concurrent_promotions_one_wins(registry: AdapterRegistry, tmp_path: Path) -> None:
    version = _passed(registry, tmp_path, 1)
    outcomes: list[str] = []

    def promote() -> None:
        try:
            decide(
                AdapterRegistry(registry.settings),
                str(version),
                "promote",
                who=threading.current_thread().name,
                why="race",
                expect="verified",
            )
            outcomes.append("won")
        except AdapterStateError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=promote, name=f"p{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("won") == 1
    assert all("is promoted, not verified" in o for o in outcomes if o != "won")
    assert sum(1 for r in registry.audit() if r.to_status == "promoted") == 1


def test_an_adapter_whose_files_changed_is_refused(registry: AdapterRegistry, tmp_path: Path) -> None:
    version = _passed(registry, tmp_path, 1)
    v = registry.get(version)
    path = registry.checked_path(v)
    assert adapter_sha256(path) == v.sha256
    (path / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(AdapterError, match="sha256"):
        registry.checked_path(v)
    with pytest.raises(AdapterError, match="sha256"):
        decide(registry, str(version), "promote", who="me", why="tampered")
    assert registry.champion() is None  # nothing moved
    assert [r.to_status for r in registry.audit()] == ["candidate", "verified"]  # nothing recorded


def test_a_rollback_onto_changed_files_is_refused_and_changes_nothing(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    first, second = _two_promoted(registry, tmp_path)
    (registry.local_dir(registry.get(first).sha256) / "adapter_model.safetensors").write_bytes(b"x")
    with pytest.raises(AdapterError, match="sha256"):
        decide(registry, str(second), "rollback", who="me", why="back to gen 1")
    assert registry.champion().version == second


def test_the_log_is_the_truth_when_the_mirror_was_not_written(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    """A process killed after the record and before the MLflow tags and alias: the champion
    is the log's; the next change brings the mirror back in line."""
    first, second = _passed(registry, tmp_path, 1), _passed(registry, tmp_path, 2)
    registry.lifecycle.transition(str(first), "promoted", who="me", why="killed before the mirror")
    assert _alias(registry) is None
    assert registry.champion().version == first
    decide(registry, str(second), "promote", who="me", why="next change")
    assert _alias(registry) == second


def test_an_unfiled_model_version_is_filed_by_the_rerun(registry: AdapterRegistry, tmp_path: Path) -> None:
    """Killed between creating the MLflow version and filing it: invisible until the rerun of
    the same training files it (no second version)."""
    d = _adapter(tmp_path, 1)
    registry.client.create_registered_model(registry.name)
    mv = registry.client.create_model_version(
        registry.name, "file:///x", tags={"dataset": "d1", "config": "c"}
    )
    assert registry.list() == []
    v = registry.register(d, "", "file:///x", "d1", "c", who="rerun")
    assert v.version == int(mv.version) and v.status == "candidate"
    assert len(registry.client.search_model_versions(f"name = '{registry.name}'")) == 1


def test_an_edited_sha256_tag_does_not_launder_changed_files(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    """The hash a version was filed with is the log's: rewriting the MLflow tag to match
    swapped files does not make them servable."""
    version = _passed(registry, tmp_path, 1)
    path = registry.checked_path(registry.get(version))
    (path / "adapter_model.safetensors").write_bytes(b"swapped")
    registry.client.set_model_version_tag(registry.name, str(version), "sha256", adapter_sha256(path))
    with pytest.raises(AdapterError, match="sha256"):
        registry.checked_path(registry.get(version))


def _append(registry: AdapterRegistry, name: str, from_status: str | None, to_status: str) -> int:
    """A record appended by hand to the adapter audit log; returns its line number."""
    sha = next((r.content_hash for r in registry.audit() if r.name == name), "0" * 64)
    line = {"name": name, "from_status": from_status, "to_status": to_status, "who": "mallory",
            "why": "trust me", "at": "2026-01-01T00:00:00Z", "content_hash": sha, "evidence": {}}  # fmt: skip
    log = registry.root / "audit.jsonl"
    with log.open("a") as f:
        f.write(json.dumps(line) + "\n")
    return len(log.read_text().splitlines())


@pytest.mark.parametrize(
    "start", [None, "candidate", "rejected"], ids=["never-filed", "candidate", "rejected"]
)
def test_a_hand_appended_promotion_never_makes_a_champion(
    registry: AdapterRegistry, tmp_path: Path, start: str | None
) -> None:
    good = _passed(registry, tmp_path, 1)
    decide(registry, str(good), "promote", who="me", why="passed")
    if start is None:  # an MLflow version the lifecycle never filed (created behind its back)
        version = int(registry.client.create_model_version(registry.name, "file:///evil").version)
    else:
        version = registry.register(_adapter(tmp_path, 9), "", "file:///x/9", "d9", "c", who="t").version
        if start == "rejected":
            registry.transition(str(version), "rejected", who="gate", why="no gain")
    number = _append(registry, str(version), start, "promoted")
    for read in (registry.champion, registry.list, registry.audit):
        with pytest.raises(StateFileError, match=f"line {number}.*sed -i '{number}d'"):
            read()
    with pytest.raises(StateFileError):
        decide(registry, str(good), "retire", who="me", why="nothing is appended behind it")
    subprocess.run(["sed", "-i", f"{number}d", str(registry.root / "audit.jsonl")], check=True)
    assert registry.champion().version == good


def test_an_mlflow_mirror_that_fails_after_the_record_is_a_warning_and_is_retried(
    registry: AdapterRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = _passed(registry, tmp_path, 1)

    def down(*args: object, **kw: object) -> None:
        raise MlflowException("connection refused")

    with monkeypatch.context() as m:
        m.setattr(registry.client, "set_registered_model_alias", down)
        outcome = apply(registry, str(version), "promote", who="me", why="ship")
    assert outcome.changed == [str(version)] and registry.champion().version == version  # it happened
    (warning,) = outcome.warnings
    assert "MLflow" in warning and "connection refused" in warning and "retried" in warning
    assert _alias(registry) is None  # the mirror lags ...
    again = _passed(registry, tmp_path, 2)
    apply(registry, str(again), "reject", who="me", why="no")  # ... until the next decision
    assert _alias(registry) == version


def test_a_decision_that_fails_before_its_record_changes_nothing(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    version = _passed(registry, tmp_path, 1)
    (registry.local_dir(registry.get(version).sha256) / "adapter_model.safetensors").write_bytes(b"x")
    before = registry.audit()
    with pytest.raises(AdapterError, match="sha256"):
        apply(registry, str(version), "promote", who="me", why="ship")
    assert registry.audit() == before and _alias(registry) is None
