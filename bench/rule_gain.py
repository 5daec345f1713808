"""Do mined action rules move the shipped model? One round, measured on held-out test tasks.

For each family: the real `explore` stage (the shipped SmolLM2-135M, sampled, epsilon 0.1,
own successes only: no expert trajectories) on `--train` train tasks × `--rollouts`, the
real `diagnose` stage (signals and attribution; no judge: rules do not read the cause), then
`skills.rule_mining.mine_rules` on that evidence, exactly as `distill` calls it. Then the
real `evaluate` stage, greedy, on the first `--test` test tasks: the base policy, the base
policy with every mined rule, and with each rule alone (same tasks, same seeds), each rule
arm compared with the base task by task (repairs, regressions, exact McNemar p). The
random valid-action level on the same tasks is printed beside (the bar).

This is not the gate: nothing here decides anything, and the test split is never evidence
(the rules are mined from train only). It answers one question, whether the candidate kind
can move a policy that ignores its prompt, before paying for whole evolutions.

    .venv/bin/python -m bench rule_gain [--families textworld-express:coin ...] [--train 12]
        [--rollouts 4] [--test 30] [--out bench/results/rule_gain.json]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import (
    RESULTS,
    bench_settings,
    embedded_server,
    fresh_data_dir,
    option,
    paired,
    write_result,
)

FAMILIES = ["textworld-express:coin", "textworld-express:mapreader"]


@dataclass
class Options:
    families: list[str] = option(FAMILIES)
    train: int = option(12, "train tasks explored per family")
    rollouts: int = option(4, "explore rollouts per train task")
    test: int = option(30, "held-out test tasks per family")
    min_tasks: int = option(3, "distinct train tasks a rule needs")
    top: int = option(3, "rules per family")
    seeds: int = option(5, "random-policy episodes per test task")
    concurrency: int = option(8)
    out: Path = option(RESULTS / "rule_gain.json")


def run_family(family: str, args: Options, url: str, data: Path) -> dict[str, Any]:
    from prefect import flow

    from ratchet.flows.diagnose import diagnose_stage
    from ratchet.flows.evaluate import evaluate_stage
    from ratchet.flows.explore import explore_stage
    from ratchet.flows.runtime import open_runtime
    from ratchet.skills.rule_mining import mine_rules

    settings = bench_settings(
        data / family.replace(":", "-"),
        {
            "suite": family,
            "splits.train": args.train,
            "splits.test": args.test,
            "explore.rollouts_per_task": args.rollouts,
            "explore.experts": False,
            "diagnose.judge": False,
            "evaluate.baseline_seeds": args.seeds,
            "concurrency": args.concurrency,
        },
    )

    @flow(name="rule-gain", validate_parameters=False)
    def one_family() -> dict[str, Any]:
        timings: dict[str, float] = {}
        with open_runtime(settings, url) as rt:
            started = time.perf_counter()
            base = rt.live_policy()
            explored = explore_stage(rt, 1, base)
            diagnose_stage(rt, 1)
            timings["explore_and_diagnose_s"] = time.perf_counter() - started
            trajectories = rt.store.query(evolution=settings.evolution, generation=1, split="train")
            diagnoses = rt.store.diagnoses(settings.evolution, 1)
            mined = mine_rules(family, trajectories, diagnoses, min_tasks=args.min_tasks, top=args.top)
            arms: dict[str, Any] = {"base": base}
            if mined:
                arms["all rules"] = base.model_copy(update={"rules": tuple(m.spec for m in mined)})
                if len(mined) > 1:
                    arms |= {m.name: base.model_copy(update={"rules": (m.spec,)}) for m in mined}
            results: dict[str, Any] = {}
            for generation, (name, policy) in enumerate(arms.items(), start=10):
                started = time.perf_counter()
                r = evaluate_stage(rt, generation, policy)
                timings[f"evaluate {name}_s"] = time.perf_counter() - started
                results[name] = r
            base_result = results["base"]
            rows = []
            for name, r in results.items():
                rep = r.report
                row = {
                    "arm": name,
                    "successes": rep.successes,
                    "n": rep.n,
                    "rate": rep.success_rate,
                    "ci95": list(rep.ci95),
                    "policy_version": r.policy_version,
                }
                if name != "base":
                    row |= paired(base_result.report.by_task, rep.by_task)
                rows.append(row)
            levels = base_result.baselines
            return {
                "family": family,
                "explore_success": explored.report.success_rate,
                "explore_rollouts": explored.report.n,
                "diagnoses": len(diagnoses),
                "mined": [
                    {
                        "name": m.name,
                        "kind": m.kind,
                        "support": m.support,
                        "spec": m.spec.model_dump(mode="json"),
                        "description": m.description,
                    }
                    for m in mined
                ],
                "arms": rows,
                "random": None
                if levels is None or levels.random is None
                else {"rate": levels.random.rate, "ci95": list(levels.random.ci95)},
                "seconds": {k: round(v, 1) for k, v in timings.items()},
            }

    return one_family()


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| family | arm | test success [95% CI] | vs base: repairs / regressions, p | random |",
        "|---|---|---|---|---|",
    ]
    for fam in rows:
        rnd = fam["random"]
        rnd_cell = "n/a" if rnd is None else f"{rnd['rate']:.0%} ({rnd['ci95'][0]:.0%}–{rnd['ci95'][1]:.0%})"
        for a in fam["arms"]:
            vs = (
                "—"
                if "repairs" not in a
                else f"+{a['repairs']} / −{a['regressions']}, p = {a['p_value']:.2g}"
            )
            cell = f"{a['successes']}/{a['n']} = {a['rate']:.0%} ({a['ci95'][0]:.0%}–{a['ci95'][1]:.0%})"
            lines.append(f"| {fam['family']} | {a['arm']} | {cell} | {vs} | {rnd_cell} |")
    return "\n".join(lines)


def run(args: Options) -> None:
    data = fresh_data_dir("ratchet-rule-gain-")
    rows = []
    started = time.perf_counter()
    with embedded_server(data / "logs") as url:
        for family in args.families:
            rows.append(run_family(family, args, url, data))
            print(f"{family}: done at {time.perf_counter() - started:.0f} s", flush=True)
    print(table(rows))
    write_result("rule_gain", {"families": rows}, args, path=args.out)
