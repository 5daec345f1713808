"""The shipped model's one-time conversion: two processes starting on one fresh models dir."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ratchet.server import weights


def test_two_starts_on_a_fresh_models_dir_convert_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the lock the second start would convert again and replace the copy the first
    was already loading (two test workers share one models dir)."""
    calls: list[str] = []
    entered = threading.Event()

    def slow_convert(target: Path) -> None:  # writes what a conversion writes, slowly
        calls.append(threading.current_thread().name)
        entered.set()
        time.sleep(0.5)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(weights, "_convert", slow_convert)
    got: list[Path] = []
    first = threading.Thread(target=lambda: got.append(weights.ensure_hf_copy(tmp_path)), name="first")
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=lambda: got.append(weights.ensure_hf_copy(tmp_path)), name="second")
    second.start()  # waits on the lock while the first converts, then finds the copy complete
    first.join(60)
    second.join(60)
    assert calls == ["first"]
    assert got == [tmp_path / weights.BASE_MODEL_NAME] * 2
    assert (tmp_path / weights.BASE_MODEL_NAME / "model.safetensors").read_bytes() == b"weights"


def test_a_complete_copy_is_used_without_taking_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / weights.BASE_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"w")
    monkeypatch.setattr(weights, "_convert", lambda t: pytest.fail("converted a complete copy"))
    assert weights.ensure_hf_copy(tmp_path) == target
    assert not (tmp_path / f".{weights.BASE_MODEL_NAME}.lock").exists()
