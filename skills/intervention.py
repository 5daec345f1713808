"""The verify gate: is a candidate a real net gain, judged by a paired A/B intervention?

Both arms (the champion with and without the candidate) run on the same dev tasks with the
same seeds. Per task the pair is a *repair* (fail -> success), a *regression* (success ->
fail) or *unchanged*; only the discordant pairs (repairs and regressions) carry information.
H0 is "the candidate is no better": a task is no more likely repaired than regressed.

`sequential_gate` is an exact group-sequential design with alpha spending on the discordant
pairs (McNemar's exact test made sequential). The flow asks after every `look_every` tasks.
Given the discordant counts seen at each look, the signs of the discordant pairs are, under
H0, fair coins (or worse for the candidate), so the null distribution of the repair count at
every look is an exact binomial random walk. At look k (tasks t of `max_tasks`) the boundary
is the fewest repairs r_k such that P0(crossed at any look up to k) <= alpha * (t /
max_tasks) ** spending_rho, computed exactly by integer path counting; alpha a look cannot
use (discreteness) carries to the next. The last look is at `max_tasks` with all of alpha.
The probability of admitting a candidate that does not help is therefore <= alpha, however
many looks there are; repeated naive peeking at the fixed-n p-value would not be. Alpha is
spent by tasks run, not by discordant pairs, because the final number of those is unknown;
any spending fixed in advance is valid. Linear spending (rho = 1, Pocock-like) lets 8
repairs in the first 8 of 64 tasks (p = 2**-8 <= alpha/8) stop at once; rho 0.75-3 moved
the bench's agreement with fixed-n by under 2 points. The reported p-value orders outcomes
stagewise (crossing at an earlier look is more extreme): a look admits exactly when p <= the
alpha spent by then, so at the last look, when p <= alpha.

Why this and not an always-valid e-value (a mixture likelihood ratio with Ville's
inequality, which allows stopping at any time without a budget): with a budget of ~64 tasks
and ~20 discordant pairs the e-value pays heavily for its unlimited horizon. Prototyped on
the bench's grid (bench/gate_efficiency.py) it admitted 76% of the helpful candidates the
fixed-n test admits 89% of, agreeing with it on 78-86%; this design, without futility stops,
admits 90% and agrees on 97-99%. The price: the guarantee needs a fixed budget and looks.

Stops besides acceptance only turn acceptances into rejections, so they keep the guarantee
(the boundaries ignore them: they are non-binding):

* the regression cap: a candidate is admitted only with regressions <= floor(max_regressions
  * tasks seen); once regressions exceed floor(max_regressions * max_tasks), no later look can
  admit it, so it is rejected at once;
* curtailment: not significant at any later look even if every remaining task is a repair;
* predictive futility: the chance, under a uniform Dirichlet prior on the per-task rates of
  repair / regression / unchanged, that the exact fixed-n test would be significant (within
  the cap) at `max_tasks` is below `futility`. The fixed-n test stands in for the gate's own
  last look (close to it, and cheap to predict); earlier crossings are not counted, so the
  rule is a little eager: it trades some power for rollouts, never the error rate. At 0.05
  the bench's helpful candidates are admitted 84% of the time (fixed-n 88%); 0.1 saves ~8%
  more rollouts for ~4 points less power.

`fixed_n_gate` is the comparison design: all `max_tasks`, then the exact one-sided McNemar
test on the discordant pairs at alpha, with the same cap.

What these statistics do *not* give:

* The guarantee holds for the tasks and seeds drawn, if tasks are independent given the two
  policies and the look schedule is fixed in advance. Dev tasks picked or ordered after
  seeing results, near-duplicate tasks, or state shared between rollouts (caches, a skill
  fitted to these very dev tasks) make a gain look surer than it is.
* Unequal task difficulty is absorbed, not modelled: the test asks whether repairs outnumber
  regressions, not by how much success rises over the task distribution; a gain on a rare
  task type is not found, and one on an over-represented type is over-counted.
* With greedy decoding and fixed seeds a task's pair is fixed: "significant" means "would
  hold on more tasks drawn like these", not "would hold on a rerun".
* The regression cap is a rule, not a test: 1 regression in 8 tasks is not evidence of a
  12% regression rate, and a candidate admitted early at 2 regressions in 24 tasks might
  have shown 8 in 64. It bounds what is seen, not the true regression rate.
* The gate controls false admissions, not misses: a small gain is often missed, by this
  design and the fixed-n one alike, and the futility rule stops some weak real gains early.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from ratchet.config import GateSettings

Kind = Literal["repair", "regression", "unchanged"]
Decision = Literal["accept", "reject", "continue"]


@dataclass(frozen=True)
class PairedOutcome:
    """One dev task run in both arms (same seed): did the baseline and the candidate succeed?"""

    task_id: str
    baseline: bool
    candidate: bool

    @property
    def kind(self) -> Kind:
        if self.baseline == self.candidate:
            return "unchanged"
        return "repair" if self.candidate else "regression"


@dataclass(frozen=True)
class GateDecision:
    decision: Decision
    reason: str  # one line for a person
    repairs: int
    regressions: int
    unchanged: int
    tasks: int  # tasks the decision rests on (a stop at an earlier look ignores later tasks)
    p_value: float  # one-sided; sequential: stagewise-ordered, design-adjusted; fixed-n: exact McNemar
    statistic: float  # repairs needed for significance at this look (the boundary)
    looks: int


@dataclass(frozen=True)
class Summary:
    repairs: int
    regressions: int
    unchanged: int

    @property
    def tasks(self) -> int:
        return self.repairs + self.regressions + self.unchanged

    @property
    def discordant(self) -> int:
        return self.repairs + self.regressions

    def __str__(self) -> str:
        def n(k: int, word: str) -> str:
            return f"{k} {word}{'' if k == 1 else 's'}"

        return f"{n(self.repairs, 'repair')}, {n(self.regressions, 'regression')} in {n(self.tasks, 'task')}"


def summarize(outcomes: Sequence[PairedOutcome]) -> Summary:
    kinds = [o.kind for o in outcomes]
    return Summary(kinds.count("repair"), kinds.count("regression"), kinds.count("unchanged"))


@lru_cache(maxsize=16384)
def binomial_p_value(repairs: int, discordant: int) -> float:
    """Exact one-sided McNemar: P(Bin(discordant, 1/2) >= repairs), in integers."""
    if repairs <= 0:
        return 1.0
    return sum(math.comb(discordant, i) for i in range(repairs, discordant + 1)) / 2**discordant


def _fmt_p(p: float) -> str:
    return f"{p:.2g}" if p < 0.01 else f"{p:.3f}".rstrip("0").rstrip(".")


# -- sequential gate


@dataclass(frozen=True)
class _Look:
    """The exact null distribution at one look, given the discordant counts at every look so
    far. Under H0 each sign sequence of the n discordant pairs has probability 2**-n; these are
    integer counts of sequences, so the boundaries carry no rounding error."""

    paths: tuple[int, ...]  # paths[r]: sequences with r repairs now that crossed at no earlier look
    crossed: int  # sequences that crossed at an earlier look
    boundary: int  # fewest repairs that cross at this look (n + 1: none can)

    @property
    def n(self) -> int:
        return len(self.paths) - 1

    def p_value(self, repairs: int) -> float:
        """Stagewise order: crossed at an earlier look, or now with at least this many repairs."""
        return (self.crossed + sum(self.paths[repairs:])) / 2**self.n


@lru_cache(maxsize=4096)
def _design(counts: tuple[int, ...], cfg: GateSettings) -> _Look:
    """The look after looks with these discordant counts (one per look, in order)."""
    if not counts:
        return _Look((1,), 0, 1)  # before any pair: the empty sequence, nothing crossed
    prev = _design(counts[:-1], cfg)
    paths = list(prev.paths[: prev.boundary]) + [0] * (prev.n + 1 - prev.boundary)  # close prev
    crossed = prev.crossed + sum(prev.paths[prev.boundary :])
    step = counts[-1] - prev.n
    for _ in range(step):  # one more discordant pair: a regression keeps r, a repair adds 1
        paths = [a + b for a, b in zip([*paths, 0], [0, *paths], strict=True)]
    crossed <<= step
    n = len(paths) - 1
    budget = cfg.alpha_spent(cfg.look_ends()[len(counts) - 1]) * 2.0**n  # exact: times a power of 2
    r, tail = n + 1, crossed
    while r > 0 and tail + paths[r - 1] <= budget:
        r -= 1
        tail += paths[r]
    return _Look(tuple(paths), crossed, r)


def _reachable_by_repairs(counts: tuple[int, ...], s: Summary, cfg: GateSettings) -> bool:
    """Curtailment: could a later look admit if every remaining task were a repair?"""
    ends = cfg.look_ends()
    future = counts
    for end in ends[len(counts) :]:
        added = end - s.tasks
        future = (*future, s.discordant + added)
        if s.repairs + added >= _design(future, cfg).boundary and s.regressions <= cfg.regression_cap(end):
            return True
    return False


@lru_cache(maxsize=65536)
def _predictive_success(repairs: int, regressions: int, unchanged: int, cfg: GateSettings) -> float:
    """P(fixed-n exact test significant, within the cap, at max_tasks | data so far).

    Dirichlet(1, 1, 1) prior on the per-task rates of repair, regression, unchanged; the
    remaining counts are then Dirichlet-multinomial."""
    m = cfg.max_tasks - (repairs + regressions + unchanged)
    ar, ag, au = 1 + repairs, 1 + regressions, 1 + unchanged
    lg = math.lgamma
    const = lg(m + 1) + lg(ar + ag + au) - lg(ar + ag + au + m) - lg(ar) - lg(ag) - lg(au)
    total = 0.0
    for g in range(min(m, cfg.regression_cap(cfg.max_tasks) - regressions) + 1):
        # the p-value falls with each added repair, so successes are r >= the first one found
        first = next(
            (
                r
                for r in range(m - g + 1)
                if binomial_p_value(repairs + r, repairs + r + regressions + g) <= cfg.alpha
            ),
            None,
        )
        if first is None:
            continue
        for r in range(first, m - g + 1):
            u = m - g - r
            total += math.exp(
                const + lg(ar + r) + lg(ag + g) + lg(au + u) - lg(r + 1) - lg(g + 1) - lg(u + 1)
            )
    return min(1.0, total)


def _check(outcomes: Sequence[PairedOutcome], cfg: GateSettings) -> None:
    if len(outcomes) > cfg.max_tasks:
        raise ValueError(
            f"{len(outcomes)} outcomes for a budget of max_tasks={cfg.max_tasks}: stop at the budget"
        )
    seen: set[str] = set()
    for o in outcomes:
        if o.task_id in seen:
            raise ValueError(f"task {o.task_id!r} appears twice: each dev task counts once per candidate")
        seen.add(o.task_id)


def _verdict(counts: tuple[int, ...], s: Summary, cfg: GateSettings) -> tuple[Decision, str, _Look]:
    """The decision at one look (the last of `counts`), its reason and the null distribution."""
    end = cfg.look_ends()[len(counts) - 1]
    look = _design(counts, cfg)
    r_k, p, spent = look.boundary, look.p_value(s.repairs), cfg.alpha_spent(end)
    cap = cfg.regression_cap(cfg.max_tasks)
    if s.regressions > cap:
        return "reject", f"too many regressions: {s}, over the cap of {cap} in {cfg.max_tasks}", look
    if s.repairs >= r_k and s.regressions <= cfg.regression_cap(end):
        why = f"p={_fmt_p(p)} <= {_fmt_p(spent)}, the alpha spent by task {end} of {cfg.max_tasks}"
        return "accept", f"significant net gain: {s}, {why} (group-sequential)", look
    if end == cfg.max_tasks:
        return (
            "reject",
            f"no significant net gain in the budget: {s}, p={_fmt_p(p)} > {_fmt_p(spent)}",
            look,
        )
    if not _reachable_by_repairs(counts, s, cfg):
        why = f"not significant by task {cfg.max_tasks} even if every remaining task is a repair"
        return "reject", f"futile: {s}; {why}", look
    if cfg.futility > 0:
        chance = _predictive_success(s.repairs, s.regressions, s.unchanged, cfg)
        if chance < cfg.futility:
            why = f"predicted chance of a significant gain by task {cfg.max_tasks} is {chance:.0%}"
            return "reject", f"futile: {s}, p={_fmt_p(p)}; {why} < {cfg.futility:.0%}", look
    return "continue", f"continue: {s}, p={_fmt_p(p)}; significance here needed {r_k} repairs", look


def sequential_gate(outcomes: Sequence[PairedOutcome], cfg: GateSettings) -> GateDecision:
    """The gate's decision after the outcomes so far, in the order they were run.

    The looks are replayed from the start, so the answer is a pure function of the history:
    a candidate stopped at look 2 stays stopped whatever is appended (the decision reports
    look 2's counts). Tasks after the last complete look are not a look and wait for the
    group to fill; the last look is at `max_tasks`."""
    _check(outcomes, cfg)
    decision = GateDecision("continue", "continue: no look yet", 0, 0, 0, 0, 1.0, 1.0, 0)
    counts: tuple[int, ...] = ()
    for end in (e for e in cfg.look_ends() if e <= len(outcomes)):
        s = summarize(outcomes[:end])
        counts = (*counts, s.discordant)
        verdict, reason, look = _verdict(counts, s, cfg)
        decision = GateDecision(
            verdict,
            reason,
            s.repairs,
            s.regressions,
            s.unchanged,
            s.tasks,
            look.p_value(s.repairs),
            float(look.boundary),
            len(counts),
        )
        if verdict != "continue":
            break
    return decision


def fewest_repairs(cfg: GateSettings) -> int:
    """The fewest repairs on which any look of the gate can admit: r with P(r of r) <= alpha
    (5 at alpha 0.05), or `max_tasks + 1` when even a full budget of repairs cannot.

    Every look spends at most alpha, and fewer repairs than this are not significant at
    alpha even with no regression and no unchanged task, so no history of outcomes with
    fewer repairs is admitted (tested against `sequential_gate` in tests/test_intervention.py).
    A gate whose tasks hold fewer champion failures than this cannot admit anything."""
    repairs = range(1, cfg.max_tasks + 1)
    return next((r for r in repairs if binomial_p_value(r, r) <= cfg.alpha), cfg.max_tasks + 1)


def grown_budget(dev: int, known: Sequence[bool], cfg: GateSettings, min_failures: int) -> int:
    """Dev tasks (per family) a gate against the champion plays: `dev`, grown a look at a time,
    up to `cfg.max_tasks`, until the tasks the champion is expected to fail reach
    `min_failures`; `known` is its outcome on each dev task it has already played.

    Only a task the champion fails can be repaired. A champion at 89% leaves about 3.5 failed
    tasks in 32, under the 5 repairs without a regression the gate needs, so on a fixed
    32-task split no gain over a strong champion can pass, however real. The budget is fixed
    before the candidate plays and reads the champion's outcomes only (known before the gate
    or not, under greedy decoding they are the same); that the false-admission rate stays at
    most alpha this way is measured, not proved (bench/dev_budget.py). With fewer than a
    look of known outcomes, or `min_failures` 0, the budget is `dev`."""
    if min_failures <= 0 or len(known) < cfg.look_every or cfg.max_tasks <= dev:
        return dev
    failures = sum(not won for won in known)
    need = cfg.max_tasks if failures == 0 else math.ceil(min_failures * len(known) / failures)
    need = math.ceil(need / cfg.look_every) * cfg.look_every
    return max(dev, min(cfg.max_tasks, need))


# -- fixed-n comparison design


def fixed_n_gate(outcomes: Sequence[PairedOutcome], cfg: GateSettings) -> GateDecision:
    """Exact one-sided McNemar on all `max_tasks` pairs at alpha, with the same regression cap.

    Before the budget is spent the answer is "continue": this design may not peek. `statistic`
    is the fewest repairs that would be significant with this many discordant pairs."""
    _check(outcomes, cfg)
    s = summarize(outcomes)
    p = binomial_p_value(s.repairs, s.discordant)
    need = next(
        (r for r in range(s.discordant + 1) if binomial_p_value(r, s.discordant) <= cfg.alpha),
        s.discordant + 1,
    )

    def decide(decision: Decision, reason: str) -> GateDecision:
        return GateDecision(
            decision, reason, s.repairs, s.regressions, s.unchanged, s.tasks, p, float(need), 1
        )

    if s.tasks < cfg.max_tasks:
        return decide("continue", f"continue: fixed-n design, {s.tasks} of {cfg.max_tasks} tasks run")
    cap = cfg.regression_cap(s.tasks)
    if s.regressions > cap:
        return decide("reject", f"too many regressions: {s}, over the cap of {cap}")
    if p <= cfg.alpha:
        return decide("accept", f"significant net gain: {s}, p={_fmt_p(p)} (exact McNemar, fixed n)")
    return decide("reject", f"no significant net gain: {s}, p={_fmt_p(p)} (exact McNemar, fixed n)")
