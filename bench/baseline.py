"""Generation-0 baseline: success of the shipped model on the held-out test split of three
TextWorldExpress games and three reasoning-gym datasets, with 95% Wilson intervals — the
numbers every later generation is judged by.

    .venv/bin/python bench/baseline.py [--twx-tasks 10] [--rg-tasks 20]

Greedy decoding, fixed seeds, no exploration and no experts (the evaluate stage as is).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SUITES = {
    "textworld-express": ("coin", "mapreader", "sorting"),
    "reasoning-gym": ("basic_arithmetic", "chain_sum", "countdown"),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--twx-tasks", type=int, default=10, help="test tasks per game")
    p.add_argument("--rg-tasks", type=int, default=20, help="test tasks per dataset")
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()

    from flows.evaluate import evaluate
    from flows.launch import run_flow
    from flows.rollouts import summarize, wilson_interval
    from memory.trajectory_store import open_store
    from ratchet.config import load_settings
    from ratchet.runtime_env import prepare_environment
    from server.launcher import EmbeddedServer

    data = Path(tempfile.mkdtemp(prefix="ratchet-baseline-"))
    rows = []
    with EmbeddedServer(ROOT / ".ratchet" / "models", data / "logs") as url:
        for suite, subsets in SUITES.items():
            n = args.twx_tasks if suite == "textworld-express" else args.rg_tasks
            settings = load_settings(
                {
                    "data_dir": data,
                    "suite": f"{suite}:{','.join(subsets)}",
                    "splits.test": n,
                    "concurrency": args.concurrency,
                }
            )
            prepare_environment(settings)
            started = time.perf_counter()
            result = run_flow(evaluate, settings, base_url=url)
            store = open_store(settings.trajectories_db)
            trajs = store.query(evolution=settings.evolution, split="test", suite=suite)
            store.close()
            print(f"{suite}: {result.report.n} rollouts in {time.perf_counter() - started:.0f} s", flush=True)
            for subset in subsets:
                rep = summarize([t for t in trajs if t.subset == subset], "test")
                lo, hi = wilson_interval(rep.successes, rep.n)
                rows.append(
                    {
                        "suite": suite,
                        "subset": subset,
                        "tasks": rep.n,
                        "successes": rep.successes,
                        "success": round(rep.success_rate, 3),
                        "ci95": [round(lo, 3), round(hi, 3)],
                        "mean_steps": round(rep.mean_steps, 1),
                        "policy": result.policy_version,
                    }
                )

    print("\n| suite | subset | tasks | success | 95% CI | mean steps |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['suite']} | {r['subset']} | {r['tasks']} "
            f"| {r['successes']}/{r['tasks']} = {r['success']:.0%} "
            f"| {r['ci95'][0]:.0%}–{r['ci95'][1]:.0%} | {r['mean_steps']} |"
        )
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "baseline.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
