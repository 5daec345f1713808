"""Rollouts per minute with MLflow tracing (LangGraph autolog) at some sample rates vs off,
interleaved in one run against one embedded server.

    .venv/bin/python bench/trace_overhead.py [--rates 0.25 1.0] [--rollouts 12] [--rounds 3]

Every trial plays the same slots (same tasks, same seeds) through the real path: a Prefect
flow, mapped `rollout` tasks, `flows/traces.py` sampling by trajectory id, traces written
to the data dir's sqlite MLflow store under one generation run. Only the rate differs; the
order of the arms rotates every round. Besides wall time it reports this process's CPU
seconds per rollout (the tracer runs here, the model in the server process) and the size of
a trace. Goal: <= 5% lower throughput than off at the default `trace_sample_rate`.
Writes bench/results/trace_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="textworld-express:coin")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 1.0])
    p.add_argument("--rollouts", type=int, default=12, help="rollouts per trial")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()

    from _setup import bench_settings, write_result

    settings = bench_settings(
        "ratchet-bench-trace-",
        suite=args.suite,
        concurrency=args.concurrency,
        max_steps=args.max_steps,
        trace_sample_rate=1.0,
    )

    import mlflow
    from mlflow.tracking import MlflowClient
    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from ratchet.agents.actor import ActorSettings
    from ratchet.agents.rollout import RolloutSlot
    from ratchet.flows import agent_versions, traces, tracking
    from ratchet.flows.rollouts import derive_seed, run_slots
    from ratchet.flows.runtime import open_runtime

    arms = ["off", *(f"{r:g}" for r in args.rates)]
    rates: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    traced: dict[str, int] = dict.fromkeys(arms, 0)
    with open_runtime(settings) as rt, tracking.generation_run(settings, 0) as run_id:
        tasks = rt.suite.tasks("train", args.rollouts)
        policy = rt.base_policy()
        model_id = agent_versions.sync(settings, rt.library, policy, run_id, 0, by="bench")

        def settings_for(slot: RolloutSlot) -> ActorSettings:
            return ActorSettings(
                max_steps=args.max_steps,
                temperature=0.8,
                epsilon=0.0,
                history_window=settings.history_window,
                seed=derive_seed(slot.task.id),  # the same game and seed in every arm
            )

        @flow(name="bench-trace", task_runner=ThreadPoolTaskRunner(max_workers=args.concurrency))
        def trial(evolution: str, rate: float) -> int:
            slots = [RolloutSlot(evolution, 0, t, 0) for t in tasks]
            if rate > 0:
                traces.enable_autolog(settings.mlflow_uri)
                s = settings.model_copy(update={"trace_sample_rate": rate})
                target = traces.target(s, "explore", 0, policy.version, run_id, model_id)
            else:
                traces.disable_autolog()  # what trace_sample_rate = 0 does
                target = None
            run_slots(rt, slots, policy, settings_for, "bench", target)
            return sum(target is not None and target.wants(sl) for sl in slots)

        trial("warmup-1", 1.0)  # first flow run starts Prefect's API; first trace loads the tracer
        trial("warmup-0", 0.0)
        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                rate = 0.0 if arm == "off" else float(arm)
                cpu0, started = time.process_time(), time.perf_counter()
                traced[arm] += trial(f"{arm}-{r}", rate)
                wall = time.perf_counter() - started
                rates[arm].append(len(tasks) / (wall / 60))
                cpu[arm].append((time.process_time() - cpu0) / len(tasks))
            print(f"round {r + 1}: " + ", ".join(f"{a} {rates[a][-1]:.1f}/min" for a in arms), flush=True)

    mlflow.flush_trace_async_logging()
    client = MlflowClient(settings.mlflow_uri)
    exp = client.get_experiment_by_name(tracking.experiment_name(settings.evolution))
    found = [
        t
        for t in client.search_traces(locations=[exp.experiment_id], include_spans=False, max_results=1000)
        if traces.TRAJECTORY in t.info.tags
    ]
    sizes = [int(t.info.trace_metadata.get("mlflow.trace.sizeBytes", 0)) for t in found]
    spans = [
        json.loads(t.info.trace_metadata.get("mlflow.trace.sizeStats", "{}")).get("num_spans", 0)
        for t in found
    ]
    med = {a: statistics.median(v) for a, v in rates.items()}
    summary = {
        "suite": args.suite,
        "rollouts_per_trial": len(tasks),
        "max_steps": args.max_steps,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "rollouts_per_min": {a: [round(x, 2) for x in v] for a, v in rates.items()},
        "median_rollouts_per_min": {a: round(v, 2) for a, v in med.items()},
        "throughput_vs_off": {a: round(med[a] / med["off"], 3) for a in arms},
        "client_cpu_s_per_rollout": {a: round(statistics.median(v), 3) for a, v in cpu.items()},
        "traced_rollouts": traced,
        "traces_stored": len(found),
        "median_trace_kb": round(statistics.median(sizes) / 1024, 1) if sizes else None,
        "median_spans_per_trace": statistics.median(spans) if spans else None,
    }
    write_result("trace_overhead", summary)


if __name__ == "__main__":
    main()
