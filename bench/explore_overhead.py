"""Rollouts per minute through Prefect (flow + mapped `rollout` tasks) vs the same rollouts in
a plain thread pool, interleaved in one run against one embedded server.

    .venv/bin/python bench/explore_overhead.py [--tasks 8] [--rounds 2] [--max-steps 6]

Both paths play the same slots with the same seeds and concurrency and write to the same
store; only the orchestration differs. Goal: Prefect >= 0.9x the plain loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="textworld-express:coin")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()

    from _setup import bench_settings, write_result

    settings = bench_settings(
        "ratchet-bench-", suite=args.suite, concurrency=args.concurrency, max_steps=args.max_steps
    )

    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from ratchet.agents.actor import ActorSettings
    from ratchet.agents.rollout import RolloutSlot, run_rollout
    from ratchet.flows.rollouts import derive_seed, run_slots
    from ratchet.flows.runtime import open_runtime

    with open_runtime(settings) as rt:
        tasks = rt.suite.tasks("train", args.tasks)
        policy = rt.base_policy()

        def slots(evolution: str) -> list[RolloutSlot]:
            return [RolloutSlot(evolution, 0, t, 0) for t in tasks]

        def settings_for(slot: RolloutSlot) -> ActorSettings:
            return ActorSettings(
                max_steps=args.max_steps,
                temperature=0.8,
                epsilon=0.0,
                history_window=settings.history_window,
                seed=derive_seed(slot.task.id),
            )

        def plain(evolution: str) -> None:
            def one(slot: RolloutSlot) -> None:
                rt.store.put(run_rollout(rt.actor, rt.suite, slot, policy, settings_for(slot)))

            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(one, slots(evolution)))

        @flow(name="bench-explore", task_runner=ThreadPoolTaskRunner(max_workers=args.concurrency))
        def through_prefect(evolution: str) -> None:
            run_slots(rt, slots(evolution), policy, settings_for, "bench")

        through_prefect("warmup-prefect")  # first flow run starts Prefect's ephemeral API
        plain("warmup-plain")
        rates: dict[str, list[float]] = {"plain": [], "prefect": []}
        for r in range(args.rounds):
            for name, fn in (("plain", plain), ("prefect", through_prefect)):
                started = time.perf_counter()
                fn(f"{name}-{r}")
                rates[name].append(len(tasks) / ((time.perf_counter() - started) / 60))
            print(
                f"round {r + 1}: plain {rates['plain'][-1]:.1f}/min, prefect {rates['prefect'][-1]:.1f}/min",
                flush=True,
            )

    med = {k: statistics.median(v) for k, v in rates.items()}
    summary = {
        "suite": args.suite,
        "rollouts_per_trial": len(tasks),
        "max_steps": args.max_steps,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "median_rollouts_per_min": {k: round(v, 2) for k, v in med.items()},
        "prefect_over_plain": round(med["prefect"] / med["plain"], 3),
    }
    write_result("explore_overhead", summary)


if __name__ == "__main__":
    main()
