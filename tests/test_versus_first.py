"""Where a split has no random level (a task file), each generation is read against generation 0:
the generation table and the dashboard show the paired sign test (better / worse / p) beside it,
from per-task outcomes the journal keeps. Scripted outcomes, a real journal file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from ratchet.cli import evolve as evolve_cli
from ratchet.config import load_settings
from ratchet.flows.journal import Journal
from ratchet.skills.intervention import binomial_p_value


def _evaluate(by_task: dict[str, float], **extra: Any) -> dict[str, Any]:
    n, k = len(by_task), int(sum(by_task.values()))
    return {"n": n, "successes": k, "ci95": [0.0, 1.0], "policy_version": "p", "by_task": by_task} | extra


def _journal(tmp_path: Path) -> Journal:
    """Generation 0 solves t0-t4; generation 1 also t5-t20 and loses t4 (16 better, 1 worse);
    generation 2 is generation 0 again."""
    settings = load_settings({"data_dir": tmp_path, "tasks.file": "tasks.jsonl", "tasks.score": "s:s"})
    journal = Journal.load(settings)
    first = {f"t{i}": float(i < 5) for i in range(30)}
    later = {f"t{i}": float(i < 21 and i != 4) for i in range(30)}
    journal.record(0, "evaluate", _evaluate(first), 1.0)
    journal.record(1, "evaluate", _evaluate(later), 1.0)
    journal.record(2, "evaluate", _evaluate(dict(first)), 1.0)
    return Journal.load(settings)  # as read back from the file


def test_each_generation_is_paired_with_generation_0_by_the_exact_sign_test(tmp_path: Path) -> None:
    rows = _journal(tmp_path).rows()
    assert rows[0].vs_first_p is None  # generation 0 is the bar
    assert (rows[1].vs_first_better, rows[1].vs_first_worse) == (16, 1)
    assert rows[1].vs_first_p == binomial_p_value(16, 17) and rows[1].beats_first
    assert (rows[2].vs_first_better, rows[2].vs_first_worse, rows[2].vs_first_p) == (0, 0, 1.0)
    assert not rows[2].beats_first


def test_the_table_puts_the_sign_test_where_random_would_be(tmp_path: Path, monkeypatch: Any) -> None:
    out = Console(width=300, record=True)
    monkeypatch.setattr(evolve_cli, "console", out)
    journal = _journal(tmp_path)
    evolve_cli.print_evolution(load_settings({"data_dir": tmp_path}), journal)
    text = out.export_text()
    assert "vs gen 0" in text and "random/gold" not in text.splitlines()[1]
    line = next(ln for ln in text.splitlines() if ln.lstrip("│ ").startswith("1 "))
    assert f"▲ +16 −1 p={binomial_p_value(16, 17):.2g}" in line
    assert "+0 −0 p=1" in next(ln for ln in text.splitlines() if ln.lstrip("│ ").startswith("2 "))
    assert "paired sign test" in text


def test_a_suite_with_a_random_level_keeps_its_random_column(tmp_path: Path, monkeypatch: Any) -> None:
    settings = load_settings({"data_dir": tmp_path})
    journal = Journal.load(settings)
    level = {"random": {"rate": 0.5, "ci95": [0.3, 0.7]}, "gold": {"rate": 1.0, "ci95": [0.9, 1.0]}}
    journal.record(0, "evaluate", _evaluate({"a": 1.0, "b": 0.0}, baselines=level), 1.0)
    out = Console(width=300, record=True)
    monkeypatch.setattr(evolve_cli, "console", out)
    evolve_cli.print_evolution(settings, journal)
    assert "random/gold" in out.export_text() and "vs gen 0" not in out.export_text()


def test_an_old_journal_without_per_task_outcomes_reads_as_before(tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path})
    journal = Journal.load(settings)
    for g in (0, 1):
        journal.record(g, "evaluate", {"n": 2, "successes": g, "ci95": [0, 1], "policy_version": "p"}, 1.0)
    assert [r.vs_first_p for r in Journal.load(settings).rows()] == [None, None]


def test_the_dashboard_shows_it_beside_each_generation(tmp_path: Path) -> None:
    from ratchet.dashboard.app import create_dashboard
    from tests.test_dashboard import authorized, rows_of

    _journal(tmp_path)
    html = authorized(create_dashboard(load_settings({"data_dir": tmp_path}))).get("/").text
    gens = rows_of(html, "generation-table")
    assert "vs gen 0" not in gens[0]
    assert f"vs gen 0: +16 −1, p = {binomial_p_value(16, 17):.2g} ▲" in gens[1]
    assert "vs gen 0: +0 −0, p = 1</span>" in gens[2]
