"""The bar: random valid action, the shipped model (greedy) and the gold path, on the same tasks.

For each target: the first `--test` tasks of its held-out test split, played by
* the random policy: a uniformly random valid action each step, `--seeds` episodes per task,
  the suite's step budget (suites that list no valid actions have no random row);
* the shipped SmolLM2-135M-Instruct through the real `evaluate` flow: greedy, no skills, no
  adapter, no exploration, no experts (generation 0 of every evolution);
* the gold path: the suite's reference solution within the same step budget (the ceiling).

and the paired sign test of the model against random, task by task. Every gain benchmark
prints the same random row for its own test tasks; this one shows the bar on its own.

    .venv/bin/python bench/baseline.py [--test 30] [--seeds 10] [--no-model [--split dev] [--max-steps 8]]
        [--targets textworld-express:coin textworld-express:mapreader ...] [--out FILE]

Writes bench/results/baseline.json (`--no-model`: baseline_levels.json, random and gold only:
the bar for any other bench's task set, e.g. a gate bench's dev tasks and step budget).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = [
    "textworld-express:coin",
    "textworld-express:mapreader",
    "textworld-express:sorting",
    "reasoning-gym:propositional_logic",
]


def pct(rate: float | None, ci: Any = None) -> str:
    if rate is None:
        return "n/a"
    return f"{rate:.0%}" + (f" ({ci[0]:.0%}–{ci[1]:.0%})" if ci is not None else "")


def row_for(target: str, levels: Any, model: Any, vs: Any, seconds: float) -> dict[str, Any]:
    """One target's numbers as plain JSON."""
    out: dict[str, Any] = {"target": target, "seconds": round(seconds, 1), "seeds": levels.seeds}
    for name, level in (("random", levels.random), ("gold", levels.gold)):
        out[name] = (
            None if level is None else {"rate": level.rate, "ci95": list(level.ci95), "tasks": level.tasks}
        )
    if model is not None:
        out["model"] = {
            "successes": model.successes,
            "n": model.n,
            "rate": model.success_rate,
            "ci95": list(model.ci95),
            "by_task": model.by_task,
        }
    if vs is not None:
        out["model_vs_random"] = {
            "better": vs.better,
            "worse": vs.worse,
            "ties": vs.ties,
            "p_value": vs.p_value,
        }
    return out


def table(rows: list[dict[str, Any]], tasks: int, seeds: int) -> str:
    """The markdown table for RESULTS.md and the README."""
    lines = [
        f"| target | tasks | random valid action ({seeds} seeds/task) | shipped model, greedy | gold path "
        "| model vs random (sign test) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rnd, model, vs = r["random"], r.get("model"), r.get("model_vs_random")
        random_cell = "n/a (no valid actions)" if rnd is None else pct(rnd["rate"], rnd["ci95"])
        model_cell = (
            "—"
            if model is None
            else f"{model['successes']}/{model['n']} = {pct(model['rate'], model['ci95'])}"
        )
        gold_cell = "n/a" if r["gold"] is None else pct(r["gold"]["rate"])
        vs_cell = (
            "—"
            if vs is None
            else f"better on {vs['better']}, worse on {vs['worse']}, p = {vs['p_value']:.2g}"
        )
        lines.append(f"| {r['target']} | {tasks} | {random_cell} | {model_cell} | {gold_cell} | {vs_cell} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--targets", nargs="+", default=TARGETS)
    p.add_argument("--test", type=int, default=30, help="test tasks per target")
    p.add_argument("--seeds", type=int, default=10, help="random-policy episodes per task")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--no-model", action="store_true", help="random and gold only (seconds, no model server)")
    p.add_argument(
        "--split", choices=["test", "dev", "train"], default="test", help="with --no-model: which split"
    )
    p.add_argument("--max-steps", type=int, default=None, help="with --no-model: override the step budget")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/baseline*.json)")
    args = p.parse_args()

    from ratchet.agents.baselines import baselines
    from ratchet.config import load_settings
    from ratchet.runtime_env import prepare_environment
    from ratchet.suites import get_suite

    data = Path(tempfile.mkdtemp(prefix="ratchet-baseline-"))
    rows = []

    def settings_for(target: str) -> Any:
        s = load_settings(
            {
                "data_dir": data / target.replace(":", "-"),
                "suite": target,
                "splits.test": args.test,
                "concurrency": args.concurrency,
                "evaluate.baseline_seeds": args.seeds,
            }
        )
        prepare_environment(s)
        return s

    if args.no_model:
        for target in args.targets:
            started = time.perf_counter()
            suite = get_suite(target)
            levels = baselines(suite, suite.tasks(args.split, args.test), args.seeds, args.max_steps)
            suite.close()
            rows.append(row_for(target, levels, None, None, time.perf_counter() - started))
    else:
        from ratchet.flows.evaluate import evaluate
        from ratchet.flows.launch import run_flow
        from ratchet.server.launcher import EmbeddedServer

        with EmbeddedServer(ROOT / ".ratchet" / "models", data / "logs") as url:
            for target in args.targets:
                started = time.perf_counter()
                result = run_flow(evaluate, settings_for(target), base_url=url)
                rows.append(
                    row_for(
                        target,
                        result.baselines,
                        result.report,
                        result.vs_random,
                        time.perf_counter() - started,
                    )
                )
                print(f"{target}: {time.perf_counter() - started:.0f} s", flush=True)

    print(table(rows, args.test, args.seeds))
    out = args.out or ROOT / "bench" / "results" / (
        "baseline_levels.json" if args.no_model else "baseline.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
