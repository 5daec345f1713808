"""The adapter registry on a real MLflow store: lifecycle, alias, rollback, races, integrity."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from ratchet.config import load_settings
from ratchet.errors import AdapterError, AdapterStateError
from ratchet.training.registry import AdapterRegistry, adapter_sha256


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
    registry.decide(v.version, "verified", who="gate", why="significant", evidence=evidence)
    return v.version


def test_the_alias_moves_only_for_a_version_that_passed_the_gate(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    v = registry.register(_adapter(tmp_path, 1), "", "file:///x", "d1", "c", who="test")
    assert (v.status, v.champion) == ("candidate", False)
    assert registry.find("d1", "c") == v and registry.find("d1", "other") is None
    with pytest.raises(AdapterStateError, match="candidate"):
        registry.promote(v.version, who="me", why="looks good")
    registry.decide(v.version, "rejected", who="gate", why="no gain", evidence={"decision": "reject"})
    with pytest.raises(AdapterStateError, match="rejected"):
        registry.promote(v.version, who="me", why="anyway")
    assert registry.champion() is None
    good = _passed(registry, tmp_path, 2)
    promoted = registry.promote(good, who="me", why="passed")
    assert promoted.champion and promoted.status == "promoted"
    assert registry.champion() == promoted
    trail = [(r["version"], r["from"], r["to"], r["who"]) for r in registry.audit()]
    assert trail == [
        (1, "", "candidate", "test"),
        (1, "candidate", "rejected", "gate"),
        (2, "", "candidate", "test"),
        (2, "candidate", "verified", "gate"),
        (2, "verified", "promoted", "me"),
    ]


def test_rollback_restores_the_previous_champion_then_the_base_model(
    registry: AdapterRegistry, tmp_path: Path
) -> None:
    first, second = _passed(registry, tmp_path, 1), _passed(registry, tmp_path, 2)
    registry.promote(first, who="me", why="gen 1")
    registry.promote(second, who="me", why="gen 2")
    assert registry.champion().version == second
    back = registry.rollback(who="me", why="regressed in production")
    assert back is not None and back.version == first and registry.champion().sha256 == back.sha256
    assert registry.get(second).status == "retired"
    assert registry.rollback(who="me", why="again") is None and registry.champion() is None
    with pytest.raises(AdapterStateError, match="no champion"):
        registry.rollback(who="me", why="nothing left")


def test_two_concurrent_promotions_one_wins(registry: AdapterRegistry, tmp_path: Path) -> None:
    version = _passed(registry, tmp_path, 1)
    outcomes: list[str] = []

    def promote() -> None:
        try:
            AdapterRegistry(registry.settings).promote(
                version, who=threading.current_thread().name, why="race"
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
    assert all("already the champion" in o for o in outcomes if o != "won")
    assert sum(1 for r in registry.audit() if r["to"] == "promoted") == 1


def test_an_adapter_whose_files_changed_is_refused(registry: AdapterRegistry, tmp_path: Path) -> None:
    version = _passed(registry, tmp_path, 1)
    v = registry.get(version)
    path = registry.checked_path(v)
    assert adapter_sha256(path) == v.sha256
    (path / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(AdapterError, match="sha256"):
        registry.checked_path(v)
    with pytest.raises(AdapterError, match="sha256"):
        registry.promote(version, who="me", why="tampered")
    assert registry.champion() is None  # nothing moved
