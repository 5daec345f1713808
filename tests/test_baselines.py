"""The random policy and the gold path on real suites, and the paired test against random."""

from __future__ import annotations

import random

import pytest

from ratchet.agents.baselines import baselines, play_gold, play_random, versus_random
from ratchet.flows.journal import GenerationRow
from ratchet.flows.loop import stage
from ratchet.suites import get_suite


@pytest.fixture(scope="module")
def coin():  # type: ignore[no-untyped-def]
    suite = get_suite("textworld-express:coin")
    yield suite
    suite.close()


def test_random_and_gold_levels_on_textworld_express_are_real_and_repeatable(coin) -> None:  # type: ignore[no-untyped-def]
    tasks = coin.tasks("test", 8)
    first = baselines(coin, tasks, seeds=4)
    assert first.random is not None and first.gold is not None
    assert first.random.tasks == 8 and first.random.rollouts == 32
    assert set(first.random.by_task) == {t.id for t in tasks}
    # coin with 4 locations: random play wins some episodes and loses others (measured ~50%)
    assert 0.1 < first.random.rate < 0.9
    assert first.random.ci95[0] <= first.random.rate <= first.random.ci95[1]
    assert first.gold.rate >= 0.75  # the reference path nearly always fits the step budget
    again = baselines(coin, tasks, seeds=4)
    assert again.random == first.random  # same tasks and seeds: same episodes


def test_random_play_respects_the_step_budget(coin) -> None:  # type: ignore[no-untyped-def]
    tasks = coin.tasks("test", 6)
    rng_wins = [play_random(coin, t, random.Random(f"x{t.id}"), max_steps=1) for t in tasks]
    assert rng_wins == [False] * 6  # no coin game is won in a single move
    assert all(play_gold(coin, t, max_steps=1) is False for t in tasks)


def test_a_suite_without_valid_actions_has_no_random_level() -> None:
    suite = get_suite("reasoning-gym:chain_sum")
    levels = baselines(suite, suite.tasks("test", 3), seeds=3)
    assert levels.random is None  # nothing to choose uniformly from: free-text answers
    assert levels.gold is not None and levels.gold.rate == 1.0  # the reference answers


def test_versus_random_is_an_exact_sign_test_over_tasks() -> None:
    champion = {f"t{i}": 1.0 for i in range(10)}
    rand = {f"t{i}": 0.6 for i in range(10)}
    vs = versus_random(champion, rand)
    assert (vs.better, vs.worse, vs.ties) == (10, 0, 0) and vs.p_value == pytest.approx(1 / 1024)
    assert vs.beats()
    # random level: a champion that only matches random's rate never "beats" it
    level = versus_random({"a": 1.0, "b": 0.0, "c": 0.6}, {"a": 0.6, "b": 0.6, "c": 0.6})
    assert (level.better, level.worse, level.ties) == (1, 1, 1) and not level.beats()
    assert versus_random({"a": 1.0}, {"b": 0.0}).p_value == 1.0  # no shared task: no evidence


def test_the_journal_row_carries_both_levels_and_old_journals_still_read() -> None:
    summary = {"n": 10, "successes": 6, "ci95": [0.3, 0.8], "policy_version": "p"}
    old = GenerationRow(0)
    stage("evaluate").fill(old, summary)
    assert old.random_success is None and old.gold_success is None
    new = GenerationRow(1)
    levels = {"random": {"rate": 0.5, "ci95": [0.3, 0.7]}, "gold": {"rate": 1.0, "ci95": [0.7, 1.0]}}
    stage("evaluate").fill(new, summary | {"baselines": levels, "vs_random": {"p_value": 0.2}})
    assert (new.random_success, new.random_ci95, new.gold_success, new.vs_random_p) == (
        0.5,
        (0.3, 0.7),
        1.0,
        0.2,
    )
