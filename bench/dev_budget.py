"""Verify gate over a strong champion: a fixed 32-task dev split against one that grows (simulated).

The dev split that grows with the champion's known success rate (`verify.min_failures`,
skills/intervention.py: grown_budget), on simulated candidates whose true effect is known.

    .venv/bin/python -m bench dev_budget [--sims 10000] [--seed 0] [--dev 32]
        [--baselines 0.5 0.8 0.85 0.9] [--min-failures 8] [--caps 64 96] [--name dev_budget]

Only a task the champion fails can be repaired: at 89% success a 32-task split holds about
3.5 of them, under the 5 repairs without a regression the gate needs, so a real gain cannot
pass there. Each design sees the same simulated outcome sequences (paired). Per dev task the
champion succeeds with probability `baseline`; the candidate repairs a failure with
probability `fix` and breaks a success with probability `break`. The grown budget reads the
champion's outcomes on the first `--dev` tasks, the same tasks the gate then plays: the worst
case for the false-admission rate, which the A/A rows measure. No model is run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bench.harness import clopper_pearson, option, write_result
from ratchet.config import GateSettings, VerifySettings
from ratchet.skills.intervention import PairedOutcome, grown_budget, sequential_gate

# name -> (P(repair | champion failed), P(regression | champion succeeded)); None: per baseline
EFFECTS: dict[str, tuple[float, float] | None] = {
    # bench/bf16_lora: a LoRA adapter over the coin rules at 89/100 held out: 96/100
    "adapter-like (+7 / -1 per 100 at 89%)": (0.65, 0.012),
    "helpful": (0.5, 0.02),
    "A/A, identical arms": (0.0, 0.0),
    "A/A, noisy": None,  # repairs = regressions = min(0.05, failure rate / 2) of tasks
    "harmful": (0.05, 0.1),
}
NULLS = ("A/A, identical arms", "A/A, noisy")


@dataclass
class Options:
    sims: int = option(10000, "simulated candidates per cell")
    seed: int = option(0)
    dev: int = option(32, "splits.dev: the fixed design's budget")
    baselines: list[float] = option([0.5, 0.8, 0.85, 0.9], "the champion's success rates")
    min_failures: int = option(VerifySettings.model_fields["min_failures"].default, "verify.min_failures")
    caps: list[int] = option([64, 96], "verify.max_tasks of the grown designs")
    name: str = option("dev_budget", "results file name under bench/results")


def run(args: Options) -> None:

    gate = GateSettings()  # alpha, looks, cap and futility as the loop uses them
    designs = {f"fixed {args.dev}": None, **{f"grown to <= {c}": c for c in args.caps}}
    longest = max(args.caps + [args.dev])
    rng = np.random.default_rng(args.seed)
    rows = []
    started = time.perf_counter()
    for base in args.baselines:
        for effect, rates in EFFECTS.items():
            if rates is None:
                d = min(0.05, (1 - base) / 2)
                rates = (d / (1 - base), d / base)
            fix, brk = rates
            accepted = dict.fromkeys(designs, 0)
            tasks = dict.fromkeys(designs, 0)
            budgets = dict.fromkeys(designs, 0)
            for _ in range(args.sims):
                b = rng.random(longest) < base
                u = rng.random(longest)
                c = np.where(b, u >= brk, u < fix)
                outs = [
                    PairedOutcome(f"t{i}", bool(x), bool(y))
                    for i, (x, y) in enumerate(zip(b, c, strict=True))
                ]
                for name, cap in designs.items():
                    if cap is None:
                        n = args.dev
                    else:
                        probe = gate.model_copy(update={"max_tasks": cap})
                        n = grown_budget(args.dev, [bool(x) for x in b[: args.dev]], probe, args.min_failures)
                    d = sequential_gate(outs[:n], gate.model_copy(update={"max_tasks": n}))
                    assert d.decision != "continue"
                    accepted[name] += d.decision == "accept"
                    tasks[name] += d.tasks
                    budgets[name] += n
            for name in designs:
                k = accepted[name]
                rows.append(
                    {
                        "baseline": base,
                        "effect": effect,
                        "design": name,
                        "fix": round(fix, 4),
                        "break": round(brk, 4),
                        "sims": args.sims,
                        "accept": k / args.sims,
                        "accept_ci95": clopper_pearson(k, args.sims),
                        "mean_tasks": tasks[name] / args.sims,
                        "mean_budget": budgets[name] / args.sims,
                    }
                )
    seconds = time.perf_counter() - started

    print(
        f"\nalpha {gate.alpha}, look every {gate.look_every}, futility {gate.futility}, dev {args.dev}, "
        f"min_failures {args.min_failures}, {args.sims} sims per cell, {seconds:.0f} s\n"
    )
    print("| champion | effect | design | admitted (95% CI) | tasks played per candidate | budget |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["accept_ci95"]
        print(
            f"| {r['baseline']:.0%} | {r['effect']} | {r['design']} | {r['accept']:.1%} ({lo:.1%}–{hi:.1%}) "
            f"| {r['mean_tasks']:.1f} | {r['mean_budget']:.1f} |"
        )
    worst = max((r for r in rows if r["effect"] in NULLS), key=lambda r: r["accept"])
    print(
        f"\nworst null admission: {worst['accept']:.2%} "
        f"({worst['design']}, {worst['baseline']:.0%}, {worst['effect']})"
    )
    write_result(args.name, {"gate": gate.model_dump(), "rows": rows, "seconds": seconds}, args)
