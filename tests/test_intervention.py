"""The verify gate's statistics: decisions on clear cases, the regression cap, the error rate
of candidates that do not help (exactly, and by simulation against naive peeking), the
fixed-n comparison against scipy, determinism."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import pytest

from ratchet.skills.intervention import (
    GateDecision,
    GateSettings,
    PairedOutcome,
    binomial_p_value,
    fewest_repairs,
    fixed_n_gate,
    sequential_gate,
    summarize,
)

KIND_TO_PAIR = {"+": (False, True), "-": (True, False), "=": (True, True), "0": (False, False)}


def _outs(pattern: str) -> list[PairedOutcome]:
    """'+' repair, '-' regression, '=' both succeed, '0' both fail; spaces ignored."""
    kinds = pattern.replace(" ", "")
    return [PairedOutcome(f"t{i}", *KIND_TO_PAIR[k]) for i, k in enumerate(kinds)]


def _look_by_look(outcomes: list[PairedOutcome], cfg: GateSettings) -> Iterator[GateDecision]:
    """What the verify flow does: run a group of tasks, ask the gate, stop when it decides."""
    for end in cfg.look_ends():
        d = sequential_gate(outcomes[:end], cfg)
        yield d
        if d.decision != "continue":
            return


def _aa(rng: np.random.Generator, n: int, discordance: float) -> list[PairedOutcome]:
    """An A/A candidate: a task is repaired or regressed equally often."""
    u = rng.random(n)
    return [
        PairedOutcome(f"t{i}", bool(x < discordance / 2), bool(discordance / 2 <= x < discordance))
        for i, x in enumerate(u)
    ]


def test_kinds() -> None:
    assert [o.kind for o in _outs("+-=0")] == ["repair", "regression", "unchanged", "unchanged"]
    assert summarize(_outs("++-=0")).__dict__ == {"repairs": 2, "regressions": 1, "unchanged": 2}


def test_clear_winner_is_accepted_at_the_first_look() -> None:
    cfg = GateSettings()
    d = sequential_gate(_outs("+" * 8), cfg)
    assert (d.decision, d.looks, d.tasks) == ("accept", 1, 8)
    assert d.p_value == pytest.approx(2**-8) and d.p_value <= cfg.alpha_spent(8)
    assert "8 repairs, 0 regressions in 8 tasks" in d.reason
    # the fixed-n design has to spend the whole budget on the same candidate
    assert fixed_n_gate(_outs("+" * 8), cfg).decision == "continue"


def test_one_regression_short_of_the_first_boundary_continues() -> None:
    d = sequential_gate(_outs("+" * 7 + "="), GateSettings())
    assert d.decision == "continue" and d.statistic == 8  # 7/7 has p = 2**-7 > alpha/8


def test_clear_loser_over_the_regression_cap_is_rejected_early() -> None:
    cfg = GateSettings()  # cap: 10% of 64 tasks = 6 regressions
    d = sequential_gate(_outs("-" * 7 + "=" * 9), cfg)
    assert (d.decision, d.tasks) == ("reject", 8) and d.reason.startswith("too many regressions")


def test_harmful_trend_is_rejected_for_futility_before_the_budget() -> None:
    d = sequential_gate(_outs("-+-=" * 4), GateSettings())
    assert d.decision == "reject" and d.tasks < 64 and d.reason.startswith("futile")


def test_on_a_32_task_split_a_candidate_that_changes_nothing_stops_at_the_first_look() -> None:
    """The default budget (32 dev tasks): most distilled candidates change no outcome, and each
    must cost one look, not two; a first repair, or a first repair after a regression, goes on."""
    cfg = GateSettings(max_tasks=32)
    for nothing in ("0" * 8, "=" * 2 + "0" * 6, "+-" + "0" * 6):
        d = sequential_gate(_outs(nothing), cfg)
        assert (d.decision, d.tasks) == ("reject", 8) and d.reason.startswith("futile"), nothing
    assert sequential_gate(_outs("+" + "0" * 7), cfg).decision == "continue"
    # coin's no-repeat rule on the README's dev tasks: 5 repairs in the first 16, then more
    outs = _outs("0+00+000" + "0+00+0+0" + "00+00+00")
    assert [d.decision for d in _look_by_look(outs + _outs("0" * 8), cfg)] == ["continue"] * 2 + ["accept"]


def test_cap_blocks_a_significant_gain_until_regressions_are_within_it() -> None:
    cfg = GateSettings()
    outs = _outs("+" * 7 + "-" + "+" * 7 + "-" + "=" * 8)
    blocked = sequential_gate(outs[:16], cfg)  # 14 vs 2: significant, but 2 > floor(0.1 * 16)
    assert blocked.decision == "continue" and blocked.p_value <= cfg.alpha_spent(16)
    d = sequential_gate(outs, cfg)  # 2 <= floor(0.1 * 24)
    assert (d.decision, d.tasks) == ("accept", 24)


@pytest.mark.parametrize("futility", [0.05, 0.0])
def test_no_discordant_pairs_is_never_accepted(futility: float) -> None:
    cfg = GateSettings(futility=futility)
    outs = _outs("=0" * 32)
    decisions = list(_look_by_look(outs, cfg))
    assert all(d.decision != "accept" for d in decisions)
    assert decisions[-1].decision == "reject"
    if futility:  # the predictive rule stops it early
        assert decisions[-1].tasks < 64 and "futile" in decisions[-1].reason
    else:  # 8 repairs in the last 8 tasks could still win, so it runs to the budget
        assert decisions[-1].tasks == 64 and "budget" in decisions[-1].reason


def test_curtailment_when_even_all_repairs_cannot_win() -> None:
    cfg = GateSettings(futility=0.0, max_regressions=1.0)
    d = sequential_gate(_outs("-" * 40), cfg)
    assert d.decision == "reject" and d.tasks < 40 and "every remaining task is a repair" in d.reason


@pytest.mark.parametrize(
    ("max_tasks", "look_every", "discordance", "at_least"), [(12, 4, 1.0, 0.07), (8, 3, 0.5, 0.03)]
)
def test_exact_false_accept_rate_is_at_most_alpha(
    max_tasks: int, look_every: int, discordance: float, at_least: float
) -> None:
    """Enumerate every A/A history (each task a repair, a regression or unchanged with
    probability d/2, d/2, 1-d): the exact probability of admission is within alpha, without
    the cap and futility stops that could only lower it, and not wastefully below it (a design
    that double-counted crossed paths would spend only half; discreteness costs the rest)."""
    cfg = GateSettings(
        alpha=0.1, max_tasks=max_tasks, look_every=look_every, max_regressions=1.0, futility=0.0
    )
    probs = {"+": discordance / 2, "-": discordance / 2, "=": 1 - discordance}
    total = 0.0
    for kinds in itertools.product("+-=" if discordance < 1 else "+-", repeat=max_tasks):
        if sequential_gate(_outs("".join(kinds)), cfg).decision == "accept":
            total += math.prod(probs[k] for k in kinds)
    assert at_least < total <= cfg.alpha


@pytest.mark.parametrize("discordance", [0.3, 1.0])
def test_sequential_gate_holds_alpha_where_naive_peeking_does_not(discordance: float) -> None:
    cfg = GateSettings(max_regressions=1.0, futility=0.0)  # no cap, no futility: the hardest case
    rng = np.random.default_rng(7)
    sims = 3000
    gate_accepts = peek_accepts = 0
    for _ in range(sims):
        outs = _aa(rng, cfg.max_tasks, discordance)
        gate_accepts += list(_look_by_look(outs, cfg))[-1].decision == "accept"
        peek_accepts += any(
            binomial_p_value(s.repairs, s.discordant) <= cfg.alpha
            for s in (summarize(outs[:end]) for end in cfg.look_ends())
        )
    se = (cfg.alpha * (1 - cfg.alpha) / sims) ** 0.5
    assert gate_accepts / sims <= cfg.alpha + 2 * se
    assert peek_accepts / sims > cfg.alpha + 2 * se  # why the design matters


def test_fixed_n_gate_agrees_with_scipy_binomtest() -> None:
    stats = pytest.importorskip("scipy.stats")
    cfg = GateSettings(max_tasks=40, max_regressions=1.0)
    for repairs, regressions in itertools.product(range(0, 25, 3), range(0, 16, 3)):
        outs = _outs("+" * repairs + "-" * regressions + "=" * (40 - repairs - regressions))
        d = fixed_n_gate(outs, cfg)
        want = (
            stats.binomtest(repairs, repairs + regressions, 0.5, alternative="greater").pvalue
            if repairs + regressions
            else 1.0
        )
        assert d.p_value == pytest.approx(want, rel=1e-9, abs=1e-15)
        assert d.decision == ("accept" if want <= cfg.alpha else "reject")


def test_fixed_n_gate_applies_the_cap_and_waits_for_the_budget() -> None:
    cfg = GateSettings(max_tasks=40)  # cap 4
    assert fixed_n_gate(_outs("+" * 20 + "-" * 5 + "=" * 15), cfg).reason.startswith("too many regressions")
    assert fixed_n_gate(_outs("+" * 20 + "-" * 4 + "=" * 16), cfg).decision == "accept"
    assert fixed_n_gate(_outs("+" * 20), cfg).decision == "continue"


def test_decisions_are_deterministic_and_a_stop_is_final() -> None:
    cfg = GateSettings()
    rng = np.random.default_rng(3)
    for _ in range(50):
        outs = _aa(rng, cfg.max_tasks, 0.4)
        full = sequential_gate(outs, cfg)
        assert full == sequential_gate(list(outs), cfg)
        assert full == list(_look_by_look(outs, cfg))[-1]  # appending after a stop changes nothing
    # order matters: the same tasks, the winner's run first or last
    first, last = _outs("+" * 8 + "-" * 6 + "=" * 50), _outs("=" * 50 + "-" * 6 + "+" * 8)
    assert summarize(first) == summarize(last)
    assert sequential_gate(first, cfg).decision == "accept"
    assert sequential_gate(last, cfg).decision == "reject"


def test_a_partial_group_is_not_a_look() -> None:
    d = sequential_gate(_outs("=" * 8 + "+" * 4), GateSettings())
    assert (d.decision, d.looks, d.tasks) == ("continue", 1, 8)
    assert sequential_gate(_outs("+" * 5), GateSettings()).looks == 0


def test_reason_is_one_readable_line() -> None:
    cfg = GateSettings()
    cases = ["+" * 8, "-" * 7 + "=", "=" * 64, "+=" * 32, "+-" * 32, "=" * 8, "+" * 3]
    for pattern in cases:
        for d in (sequential_gate(_outs(pattern), cfg), fixed_n_gate(_outs(pattern), cfg)):
            assert d.reason and "\n" not in d.reason and len(d.reason) < 200, d.reason


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        sequential_gate([PairedOutcome("a", False, True)] * 2, GateSettings())
    with pytest.raises(ValueError, match="budget"):
        sequential_gate(_outs("=" * 65), GateSettings())
    with pytest.raises(ValueError, match="alpha"):
        GateSettings(alpha=0)


def test_the_dev_budget_grows_only_where_the_champion_fails_few_tasks() -> None:
    from ratchet.skills.intervention import grown_budget

    cfg = GateSettings(max_tasks=64, look_every=8)
    won = [True] * 28 + [False] * 4  # 87.5% on 32: 4 failures, 8 wanted -> 64 tasks
    assert grown_budget(32, won, cfg, 8) == 64
    assert grown_budget(32, won, cfg, 5) == 40  # 5 * 32 / 4 = 40, a whole number of looks
    assert grown_budget(32, [True] * 7 + [False] * 3, cfg, 5) == 32  # enough failures already
    assert grown_budget(32, [True] * 8, cfg, 8) == 64  # no failure known: the whole cap
    assert grown_budget(32, [True] * 7, cfg, 8) == 32  # under a look known: nothing to go by
    assert grown_budget(32, won, cfg, 0) == 32  # switched off
    assert grown_budget(32, won, GateSettings(max_tasks=32), 8) == 32  # the cap holds
    assert grown_budget(32, [True] * 30 + [False] * 2, cfg.model_copy(update={"look_every": 5}), 3) == 50


def test_a_grown_budget_admits_no_null_candidate_more_often_than_alpha() -> None:
    """The budget reads the champion's outcomes on the very tasks the gate then plays (the
    worst case). Simulated A/A candidates over strong champions, where the budget grows most:
    admitted at most alpha of the time, and a real gain is admitted more often than
    on the fixed 32 tasks."""
    from ratchet.skills.intervention import grown_budget

    rng = np.random.default_rng(7)
    cfg = GateSettings(max_tasks=64)
    sims = 1500
    for base in (0.8, 0.9):
        d = (1 - base) / 2  # noisy arms: repairs and regressions each half the failure rate
        admitted = {"fixed": 0, "grown": 0}
        gain = {"fixed": 0, "grown": 0}
        for _ in range(sims):
            b = rng.random(64) < base
            u = rng.random(64)
            for effect, (fix, brk) in {"null": (d / (1 - base), d / base), "gain": (0.65, 0.012)}.items():
                c = np.where(b, u >= brk, u < fix)
                outs = [
                    PairedOutcome(f"t{i}", bool(x), bool(y))
                    for i, (x, y) in enumerate(zip(b, c, strict=True))
                ]
                for design, n in {"fixed": 32, "grown": grown_budget(32, list(b[:32]), cfg, 8)}.items():
                    accepted = (
                        sequential_gate(outs[:n], cfg.model_copy(update={"max_tasks": n})).decision
                        == "accept"
                    )
                    (admitted if effect == "null" else gain)[design] += accepted
        assert admitted["grown"] <= cfg.alpha * sims, (base, admitted)  # measured: ~1.5%
        assert gain["grown"] > gain["fixed"] + sims * 0.08, (base, gain)


@pytest.mark.parametrize(
    "cfg",
    [
        GateSettings(max_tasks=16),
        GateSettings(max_tasks=64),
        GateSettings(max_tasks=40, futility=0.0, spending_rho=0.5),
        GateSettings(max_tasks=32, alpha=0.1, look_every=4),
        GateSettings(max_tasks=24, alpha=0.01),
    ],
)
def test_no_history_with_fewer_repairs_than_fewest_repairs_is_admitted(cfg: GateSettings) -> None:
    """What the verify stage's foreclosure rests on: a gate whose tasks hold fewer champion
    failures than `fewest_repairs` cannot admit, wherever the repairs fall and whatever the
    unchanged tasks are. Exhaustive over where one short of that many repairs sit in the
    first 16 tasks, random over the whole budget; and the bound is tight for a fixed budget."""
    need = fewest_repairs(cfg)
    assert need == {0.05: 5, 0.1: 4, 0.01: 7}[cfg.alpha]

    def history(repairs: set[int]) -> list[PairedOutcome]:
        return [
            PairedOutcome(f"t{i}", i % 3 == 0 and i not in repairs, i in repairs or i % 3 == 0)
            for i in range(cfg.max_tasks)
        ]

    for spots in itertools.combinations(range(16), need - 1):
        assert sequential_gate(history(set(spots)), cfg).decision != "accept"
    rng = np.random.default_rng(0)
    for _ in range(300):
        spots = rng.choice(cfg.max_tasks, size=need - 1, replace=False)
        for end in range(1, cfg.max_tasks + 1):
            assert sequential_gate(history(set(spots.tolist()))[:end], cfg).decision != "accept"
    fixed = [PairedOutcome(f"t{i}", i >= need, True) for i in range(cfg.max_tasks)]
    assert fixed_n_gate(fixed, cfg).decision == "accept"  # `need` repairs alone pass a fixed-n test
