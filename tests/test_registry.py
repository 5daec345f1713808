"""Suites are plug-ins: discovered through entry points, including a third party's."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from ratchet.errors import UnknownSuiteError
from ratchet.suites.registry import available_suites, get_suite, parse_suite_spec


def test_shipped_suites_are_registered():
    assert {"textworld-express", "reasoning-gym"} <= set(available_suites())


def test_spec_parsing():
    assert parse_suite_spec("reasoning-gym") == ("reasoning-gym", None)
    assert parse_suite_spec("reasoning-gym:chain_sum, countdown") == (
        "reasoning-gym",
        ["chain_sum", "countdown"],
    )


def test_unknown_suite_lists_the_installed_ones():
    with pytest.raises(UnknownSuiteError) as info:
        get_suite("nethack")
    assert "unknown suite 'nethack'" in str(info.value)
    assert "reasoning-gym" in str(info.value) and "textworld-express" in str(info.value)


def test_unknown_subset_lists_the_choices():
    with pytest.raises(UnknownSuiteError, match="no subset 'not_a_dataset'"):
        get_suite("reasoning-gym:chain_sum,not_a_dataset")


def test_a_third_party_suite_plugs_in_without_editing_ratchet(tmp_path: Path, monkeypatch):
    (tmp_path / "acme_suite.py").write_text(
        textwrap.dedent("""
        from ratchet.types import Task
        from ratchet.suites.base import Suite

        class AcmeSuite(Suite):
            name = "acme"
            default_subsets = ("a",)
            def make_task(self, subset, split, seed):
                return Task(id=f"acme:{subset}:{split}:{seed}", suite="acme", subset=subset,
                            split=split, seed=seed, instruction="do it", max_steps=1)
            def split_seeds(self, subset, split, n):
                return [{"train": 0, "dev": 100, "test": 200}[split] + i for i in range(n)]
            def episode(self, task):
                raise NotImplementedError
    """)
    )
    dist = tmp_path / "acme_suite-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-suite\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ratchet.suites]\nacme = acme_suite:AcmeSuite\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "acme" in available_suites()
    suite = get_suite("acme")
    task = suite.tasks("test", 2)[1]
    assert task.id == "acme:a:test:201" and suite.load(task.id) == task
    sys.modules.pop("acme_suite", None)
