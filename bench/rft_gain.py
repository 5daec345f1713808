"""One round of rejection-sampling fine-tuning (RFT): held-out test success before and after.

    .venv/bin/python -m bench rft_gain [--targets textworld-express:coin reasoning-gym:basic_arithmetic]
                                       [--train 40] [--k 4] [--test 30] [--epochs 3] [--experts]

For each target (one suite subset), on one embedded server:

1. evaluate the shipped model on the test split (greedy, fixed seeds): *before*;
2. explore the train split (k sampled rollouts per task, epsilon-random valid actions);
3. build the training set exactly as the `finetune` stage does (quality filter, shortest
   successes per task, per-call examples) and train a LoRA adapter with the shipped config;
4. load the adapter into the server by name and evaluate the same test tasks: *after*.

Reports success with 95% Wilson intervals, the paired repairs/regressions on the same test
tasks with an exact one-sided McNemar p-value, the random valid-action policy's level on the
same tasks with the sign test of *after* against it (the bar: beat random, then approach the
gold path), and the cost of each phase. Without
`--experts` only the agent's own successes are learned (the headline); with it, the suite's
expert trajectories are added and the result says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import (
    MODELS,
    RESULTS,
    bench_settings,
    embedded_server,
    fresh_data_dir,
    option,
    write_result,
)


@dataclass
class Options:
    targets: list[str] = option(["textworld-express:coin", "reasoning-gym:basic_arithmetic"])
    train: int = option(40, "train tasks per target")
    k: int = option(4, "explore rollouts per train task")
    test: int = option(30, "held-out test tasks per target")
    epochs: int = option(3)
    experts: bool = option(False, "also train on expert trajectories")
    data: Path | None = option(None, "data dir to reuse (finished rollouts are not played again)")
    out: Path = option(RESULTS / "rft_gain.json")


def run_target(target: str, args: Options, url: str, data: Path) -> dict[str, Any]:
    from prefect import flow
    from scipy.stats import binomtest

    from ratchet.flows.evaluate import evaluate_stage
    from ratchet.flows.explore import explore_stage
    from ratchet.flows.finetune import train_successes, training_dataset
    from ratchet.flows.launch import run_flow
    from ratchet.flows.runtime import open_runtime
    from ratchet.server.launcher import ensure_adapter
    from ratchet.training.lora import fit_adapter
    from ratchet.training.registry import adapter_sha256

    settings = bench_settings(
        data / target.replace(":", "-"),
        {
            "suite": target,
            "splits.train": args.train,
            "splits.test": args.test,
            "explore.rollouts_per_task": args.k,
            "explore.experts": args.experts,
            "finetune.experts": args.experts,
            "finetune.lora.epochs": args.epochs,
            "concurrency": 8,
        },
    )
    timings: dict[str, float] = {}

    @flow(name="rft-before-and-explore", validate_parameters=False)
    def before_and_explore(settings: Any) -> tuple[Any, Any, Any]:
        with open_runtime(settings, url) as rt:
            base = rt.base_policy()
            t0 = time.perf_counter()
            before = evaluate_stage(rt, 0, base)
            timings["evaluate_before_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            explored = explore_stage(rt, 0, base)
            timings["explore_s"] = time.perf_counter() - t0
            successes = train_successes(rt.settings, rt.store)
            return before, explored, training_dataset(rt.settings, successes)  # the stage's data

    before, explored, dataset = run_flow(before_and_explore, settings)
    found = f"{explored.report.successes}/{explored.report.n}"
    print(f"{target}: explore {found} successes; dataset {dict(dataset.counts)}", flush=True)
    adapter_dir = settings.adapters_dir / f"rft-{dataset.version}"
    row: dict[str, Any] = {
        "target": target,
        "experts_used": args.experts,
        "test_tasks": before.report.n,
        "before": before.report.successes,
        "before_ci95": [round(x, 3) for x in before.report.ci95],
        "explore_rollouts": explored.report.n,
        "explore_successes": explored.report.successes,
        "dataset": dict(dataset.counts) | {"version": dataset.version},
    }
    if not dataset.examples:  # RFT cannot start from zero: nothing to learn, nothing to evaluate
        row["note"] = "no clean success to learn from: no adapter trained"
        print(json.dumps(row), flush=True)
        return row
    t0 = time.perf_counter()
    if not (adapter_dir / "adapter_model.safetensors").is_file():  # a rerun with --data reuses it
        trained, too_long = fit_adapter(
            MODELS,  # the server's copy: converted once
            dataset.examples,
            adapter_dir,
            settings.finetune.lora,
            on_step=lambda i, n, loss: print(f"  step {i}/{n} loss {loss:.3f}", flush=True),
        )
        row |= {
            "too_long": too_long,
            "train_steps": trained.steps,
            "train_tokens": trained.tokens,
            "final_loss": round(sum(trained.losses[-5:]) / min(5, len(trained.losses)), 4),
        }
        timings["train_s"] = time.perf_counter() - t0
    name = f"rft-{dataset.version}"
    sha = adapter_sha256(adapter_dir)
    ensure_adapter(url, name, adapter_dir)

    @flow(name="rft-after", validate_parameters=False)
    def after(settings: Any) -> Any:
        with open_runtime(settings, url) as rt:
            policy = rt.base_policy().model_copy(update={"adapter": name, "adapter_hash": sha})
            t0 = time.perf_counter()
            result = evaluate_stage(rt, 1, policy)
            timings["evaluate_after_s"] = time.perf_counter() - t0
            return result

    after_result = run_flow(after, settings)
    b, a = before.report.by_task, after_result.report.by_task
    repairs = sum(1 for t in b if b[t] == 0 and a.get(t, 0) > 0)
    regressions = sum(1 for t in b if b[t] > 0 and a.get(t, 0) == 0)
    p = (
        binomtest(repairs, repairs + regressions, 0.5, alternative="greater").pvalue
        if repairs + regressions
        else 1.0
    )
    levels, vs = after_result.baselines, after_result.vs_random  # the same test tasks
    if levels is not None and levels.random is not None:
        row["random"] = {"rate": levels.random.rate, "ci95": [round(x, 3) for x in levels.random.ci95]}
    if levels is not None and levels.gold is not None:
        row["gold"] = levels.gold.rate
    if vs is not None:
        row["after_vs_random"] = {"better": vs.better, "worse": vs.worse, "p_value": round(vs.p_value, 4)}
    row |= {
        "after": after_result.report.successes,
        "after_ci95": [round(x, 3) for x in after_result.report.ci95],
        "gain_points": round(100 * (after_result.report.success_rate - before.report.success_rate), 1),
        "repairs": repairs,
        "regressions": regressions,
        "mcnemar_p": round(p, 4),
        **{k: round(v, 1) for k, v in timings.items()},
    }
    print(json.dumps(row), flush=True)
    return row


def _random_cell(r: dict[str, Any]) -> str:
    rnd = r.get("random")
    return "n/a" if rnd is None else f"{rnd['rate']:.0%} {rnd['ci95']}"


def _vs_cell(r: dict[str, Any]) -> str:
    vs = r.get("after_vs_random")
    return "—" if vs is None else f"better {vs['better']} / worse {vs['worse']}, p = {vs['p_value']}"


def run(args: Options) -> None:
    data = args.data or fresh_data_dir("ratchet-rft-")  # a rerun with --data resumes
    rows = []
    with embedded_server(data / "logs") as url:
        for target in args.targets:
            rows.append(run_target(target, args, url, data))
    print(
        "\n| target | experts | before | after | gain | repairs / regressions | p | random (same tasks) "
        "| after vs random |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["test_tasks"]
        if "after" not in r:
            experts = "yes" if r["experts_used"] else "no"
            print(f"| {r['target']} | {experts} | {r['before']}/{n} | - | - | {r['note']} | |")
            continue
        print(
            f"| {r['target']} | {'yes' if r['experts_used'] else 'no'} "
            f"| {r['before']}/{n} {r['before_ci95']} "
            f"| {r['after']}/{n} {r['after_ci95']} | {r['gain_points']:+} pts | {r['repairs']} / "
            f"{r['regressions']} | {r['mcnemar_p']} | {_random_cell(r)} | {_vs_cell(r)} |"
        )
    write_result("rft_gain", {"rows": rows}, args, path=args.out)
