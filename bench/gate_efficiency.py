"""Verify gate: the sequential gate against the fixed-n exact McNemar gate (simulated).

The sequential (group-sequential) gate against the fixed-n exact McNemar gate, on simulated
candidates whose true effect is known: rollouts used, agreement of decisions, and the
false-promotion rate of candidates that do not help.

    .venv/bin/python -m bench gate_efficiency [--sims 10000] [--seed 0] [--baseline 0.5]
        [--max-tasks 64] [--futility 0.05 0.1] [--name gate_efficiency]

Several `--futility` levels run side by side on the same simulated outcome sequences, so their
power and rollouts compare paired. `--max-tasks` is the gate's budget, which the dev split caps
(32 in the README default and in the headline). Each simulated candidate gets
`max_tasks` dev tasks. Per task the baseline succeeds with
probability `--baseline`; the candidate then repairs a baseline failure with probability `fix`
and breaks a baseline success with probability `break`. Both gates see the same outcome
sequence (the sequential one only the prefix it asks for), so their decisions are paired.
No model is run: this measures the statistics, not the agent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bench.harness import clopper_pearson, option, write_result
from ratchet.skills.intervention import (
    GateSettings,
    PairedOutcome,
    binomial_p_value,
    fixed_n_gate,
    sequential_gate,
)

# name -> (P(candidate succeeds | baseline failed), P(candidate fails | baseline succeeded)),
# written for a baseline success of 0.5; the null row is recomputed so repairs = regressions.
EFFECTS: dict[str, tuple[float, float]] = {
    "helpful": (0.30, 0.02),
    "slightly helpful": (0.20, 0.04),
    "helps but breaks (cap)": (0.45, 0.25),
    "A/A, identical arms": (0.0, 0.0),
    "A/A, noisy (up to 30% discordant)": (0.30, 0.30),
    "harmful": (0.05, 0.15),
}
NULLS = ("A/A, identical arms", "A/A, noisy (up to 30% discordant)")


def simulate(rng: np.random.Generator, n: int, base: float, fix: float, brk: float) -> list[PairedOutcome]:
    b = rng.random(n) < base
    u = rng.random(n)
    c = np.where(b, u >= brk, u < fix)
    return [PairedOutcome(f"t{i}", bool(x), bool(y)) for i, (x, y) in enumerate(zip(b, c, strict=True))]


def naive_peeking(outcomes: list[PairedOutcome], cfg: GateSettings) -> bool:
    """The wrong design, for contrast: the fixed-n p-value checked at every look."""
    for end in range(cfg.look_every, cfg.max_tasks + 1, cfg.look_every):
        kinds = [o.kind for o in outcomes[:end]]
        r, g = kinds.count("repair"), kinds.count("regression")
        if binomial_p_value(r, r + g) <= cfg.alpha and g <= cfg.regression_cap(end):
            return True
    return False


@dataclass
class Options:
    sims: int = option(10000, "simulated candidates per effect")
    seed: int = option(0)
    baseline: float = option(0.5, "baseline success rate on dev tasks")
    max_tasks: int = option(64)
    look_every: int = option(8)
    alpha: float = option(0.05)
    max_regressions: float = option(0.1)
    futility: list[float] = option(
        [GateSettings.model_fields["futility"].default],
        "predictive-futility levels, run side by side on the same outcomes (0 = off)",
    )
    spending_rho: float = option(GateSettings.model_fields["spending_rho"].default)
    name: str = option("gate_efficiency", "result file: bench/results/NAME.json")


def run(args: Options) -> None:

    cfgs = [
        GateSettings(
            alpha=args.alpha,
            max_tasks=args.max_tasks,
            look_every=args.look_every,
            max_regressions=args.max_regressions,
            futility=f,
            spending_rho=args.spending_rho,
        )
        for f in args.futility
    ]
    cfg = cfgs[0]
    rng = np.random.default_rng(args.seed)
    s = args.baseline
    started = time.perf_counter()
    rows = []
    for name, (fix, brk) in EFFECTS.items():
        if name == "A/A, noisy (up to 30% discordant)":  # repairs and regressions each 15% of tasks
            d = min(0.15, s, 1 - s)  # (fewer where the baseline leaves less room, still equal)
            fix, brk = d / (1 - s), d / s
        fix_acc = peek_acc = 0
        seq_acc, agree, seq_tasks = [0] * len(cfgs), [0] * len(cfgs), [0] * len(cfgs)
        reasons: list[dict[str, int]] = [{} for _ in cfgs]
        for _ in range(args.sims):
            outs = simulate(rng, cfg.max_tasks, s, fix, brk)
            d_fix = fixed_n_gate(outs, cfg)
            assert d_fix.decision != "continue"
            fix_acc += d_fix.decision == "accept"
            peek_acc += naive_peeking(outs, cfg)
            for i, c in enumerate(cfgs):
                d_seq = sequential_gate(outs, c)
                assert d_seq.decision != "continue"
                seq_acc[i] += d_seq.decision == "accept"
                agree[i] += d_seq.decision == d_fix.decision
                seq_tasks[i] += d_seq.tasks
                if d_seq.decision != d_fix.decision:
                    key = f"seq {d_seq.reason.split(':')[0]} / fixed {d_fix.reason.split(':')[0]}"
                    reasons[i][key] = reasons[i].get(key, 0) + 1
        n = args.sims
        for i, c in enumerate(cfgs):
            mean_tasks = seq_tasks[i] / n
            rows.append(
                {
                    "effect": name,
                    "futility": c.futility,
                    "fix": round(fix, 3),
                    "break": round(brk, 3),
                    "p_repair": round((1 - s) * fix, 3),
                    "p_regression": round(s * brk, 3),
                    "sims": n,
                    "accept_fixed": fix_acc / n,
                    "accept_fixed_ci95": clopper_pearson(fix_acc, n),
                    "accept_sequential": seq_acc[i] / n,
                    "accept_sequential_ci95": clopper_pearson(seq_acc[i], n),
                    "accept_naive_peeking": peek_acc / n,
                    "agreement": agree[i] / n,
                    "disagreements": dict(sorted(reasons[i].items(), key=lambda kv: -kv[1])),
                    "mean_tasks_sequential": mean_tasks,
                    "rollouts_fixed": 2 * cfg.max_tasks,
                    "rollouts_sequential": 2 * mean_tasks,
                    "candidate_rollouts_fixed": cfg.max_tasks,
                    "candidate_rollouts_sequential": mean_tasks,
                    "rollout_ratio": mean_tasks / cfg.max_tasks,
                }
            )
    seconds = time.perf_counter() - started

    print(
        f"\nalpha {cfg.alpha}, {cfg.max_tasks} tasks, look every {cfg.look_every}, cap "
        f"{cfg.max_regressions:.0%}, futility {args.futility}, baseline success {s}, "
        f"{args.sims} sims/effect\n"
    )
    print(
        "| effect | P(repair) / P(regr.) per task | futility | accept: fixed-n | sequential (95% CI) "
        "| naive peeking | agreement | rollouts seq / fixed (cand. arm) | ratio |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        lo, hi = r["accept_sequential_ci95"]
        print(
            f"| {r['effect']} | {r['p_repair']:.3f} / {r['p_regression']:.3f} | {r['futility']} "
            f"| {r['accept_fixed']:.1%} "
            f"| {r['accept_sequential']:.1%} ({lo:.2%}–{hi:.2%}) | {r['accept_naive_peeking']:.1%} "
            f"| {r['agreement']:.1%} | {r['rollouts_sequential']:.1f} / {r['rollouts_fixed']} "
            f"({r['candidate_rollouts_sequential']:.1f} / {r['candidate_rollouts_fixed']}) "
            f"| {r['rollout_ratio']:.2f} |"
        )
    overall = {}
    for c in cfgs:
        mine = [r for r in rows if r["futility"] == c.futility]
        overall[str(c.futility)] = {
            "agreement": float(np.mean([r["agreement"] for r in mine])),
            "rollout_ratio": float(np.mean([r["rollout_ratio"] for r in mine])),
        }
        print(
            f"\nfutility {c.futility}, overall (effects weighted equally): agreement "
            f"{overall[str(c.futility)]['agreement']:.1%}, rollout ratio "
            f"{overall[str(c.futility)]['rollout_ratio']:.2f}"
        )
        for r in mine:
            if r["disagreements"]:
                top = "; ".join(f"{k}: {v}" for k, v in list(r["disagreements"].items())[:3])
                print(f"  {r['effect']} disagreements — {top}")
    print(f"{seconds:.1f} s")

    doc = {
        "config": cfg.model_dump(exclude={"futility"}) | {"futility": args.futility},
        "baseline_success": s,
        "seed": args.seed,
        "overall": overall,
        "seconds": seconds,
        "rows": rows,
    }
    write_result(args.name, doc, args)
