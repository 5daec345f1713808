"""SFT-only against SFT then DPO, on the same explore data: the gate's repairs and regressions, and held-out.

One explore of the base model (generation 1, `--train` tasks × `-k` sampled rollouts, own
rollouts only) is played once; its train trajectories are copied into two arms' data dirs, so
both train on exactly the same trajectories:

* **sft**: the fine-tune stage as it runs by default (LoRA on the clean successes);
* **dpo**: the same, with `finetune.dpo.enabled`: the same SFT, then DPO on the preference
  pairs at the step where a success and a failure of one task part (training/preference.py).

Each arm then runs the real fine-tune stage (train, register, the adapter's paired gate on the
dev tasks against the base model) and plays the held-out split twice: with its adapter
whatever the gate said (what the training did), and with the champion after the gate (what
`ratchet evolve` would keep). Generation 0, the base model on the same test tasks, is played
once, with the random and gold levels beside it.

    .venv/bin/python -m bench dpo_gain [--family textworld-express:coin] [--train 24] [-k 4]
        [--dev 32] [--test 30] [--set KEY=VALUE ...] [--name dpo_gain]

Writes bench/results/<name>.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.harness import RESULTS, embedded_server, fresh_data_dir, option, write_result

if TYPE_CHECKING:
    from ratchet.config import Settings

ARMS = ("sft", "dpo")


@dataclass
class Options:
    family: str = option("textworld-express:coin", "suite:subset")
    train: int = option(24, "train tasks")
    k: int = option(4, "explore rollouts per train task", flags=("-k",))
    dev: int = option(32, "dev tasks the adapter's gate may use")
    test: int = option(30)
    concurrency: int = option(8)
    overrides: list[str] = option([], "more settings", flags=("--set",), nargs="*", metavar="KEY=VALUE")
    name: str = option("dpo_gain", "results file name under bench/results")


def settings_for(data: Path, opts: Options, dpo: bool) -> Settings:
    from ratchet.config import load_settings

    return load_settings(
        {
            "data_dir": data,
            "evolution": "dpo-gain",
            "suite": opts.family,
            "splits.train": opts.train,
            "splits.dev": opts.dev,
            "splits.test": opts.test,
            "explore.rollouts_per_task": opts.k,
            "explore.experts": False,
            "concurrency": opts.concurrency,
            "finetune.dpo.enabled": dpo,
        }
        | dict(kv.split("=", 1) for kv in opts.overrides)
    )


def copy_train(source: Settings, target: Settings) -> int:
    """The explore's train trajectories into another data dir's store (the same ids)."""
    from ratchet.memory.trajectory_store import open_store

    src, dst = open_store(source.trajectories_db), open_store(target.trajectories_db)
    try:
        found = src.query(evolution=source.evolution, split="train")
        for t in found:
            dst.put(t)
    finally:
        src.close()
        dst.close()
    return len(found)


def held_out(result: Any) -> dict[str, Any]:
    rep = result.report
    out: dict[str, Any] = {"successes": rep.successes, "n": rep.n, "by_task": rep.by_task}
    if result.baselines is not None and result.baselines.random is not None:
        out["random"] = result.baselines.random.rate
        out["gold"] = result.baselines.gold.rate if result.baselines.gold else None
    if result.vs_random is not None:
        out["vs_random"] = asdict(result.vs_random)
    return out


def arm(name: str, s: Settings, url: str, base_by_task: dict[str, bool]) -> dict[str, Any]:
    """The real fine-tune stage, then held-out with the trained adapter and with the champion."""
    from prefect import flow

    from ratchet.agents.baselines import versus_random
    from ratchet.flows.evaluate import evaluate_stage
    from ratchet.flows.finetune import finetune_stage
    from ratchet.flows.runtime import open_runtime, policy_with
    from ratchet.server.launcher import ensure_adapter
    from ratchet.training.registry import AdapterRegistry

    @flow(name=f"dpo-gain-{name}", validate_parameters=False)
    def one_arm() -> dict[str, Any]:
        with open_runtime(s, url) as rt:
            started = time.perf_counter()
            base = rt.live_policy()
            ft = finetune_stage(rt, 1)
            minutes = (time.perf_counter() - started) / 60
            out: dict[str, Any] = {
                "action": ft.action,
                "status": ft.status,
                "reason": ft.reason,
                "counts": ft.counts,
                "train_seconds": round(ft.train_seconds, 1),
                "finetune_minutes": round(minutes, 2),
                "gate": None
                if ft.decision is None
                else {
                    "repairs": ft.decision.repairs,
                    "regressions": ft.decision.regressions,
                    "tasks": ft.decision.tasks,
                    "p_value": ft.decision.p_value,
                },
            }
            registry = AdapterRegistry(s)
            trained = [v for v in registry.list() if v.version == ft.version]
            if trained:
                adapter = trained[0]
                path = registry.checked_path(adapter)
                ensure_adapter(url, adapter.served_name, path, s.model.api_key.get_secret_value())
                with_adapter = evaluate_stage(rt, 2, policy_with(base, [adapter]))
                out["held_out_with_adapter"] = held_out(with_adapter)
                out["adapter_versus_base"] = asdict(versus_random(with_adapter.report.by_task, base_by_task))
            champion = evaluate_stage(rt, 1, rt.live_policy())
            out["held_out_champion"] = held_out(champion)
            out["champion_versus_base"] = asdict(versus_random(champion.report.by_task, base_by_task))
            return out

    return one_arm()


def run(opts: Options) -> None:
    from prefect import flow

    from ratchet.flows.evaluate import evaluate_stage
    from ratchet.flows.explore import explore_stage
    from ratchet.flows.runtime import open_runtime
    from ratchet.runtime_env import prepare_environment

    data = fresh_data_dir("ratchet-dpo-gain-")
    print(f"data: {data}", flush=True)
    started = time.perf_counter()
    doc: dict[str, Any] = {}
    with embedded_server(data / "logs", dtype=settings_for(data, opts, False).model.dtype) as url:
        shared = settings_for(data / "explore", opts, False)
        prepare_environment(shared)  # before the first flow starts Prefect: its home in the data dir

        @flow(name="dpo-gain-explore", validate_parameters=False)
        def explore_once() -> dict[str, Any]:
            with open_runtime(shared, url) as rt:
                base = held_out(evaluate_stage(rt, 0, rt.live_policy()))
                result = explore_stage(rt, 1, rt.live_policy())
                return {
                    "generation_0": base,
                    "explore": {"n": result.report.n, "successes": result.report.successes},
                }

        doc |= explore_once()
        print(f"base and explore: {doc}", flush=True)
        for name in ARMS:
            s = settings_for(data / name, opts, name == "dpo")
            doc[f"copied_{name}"] = copy_train(shared, s)
            doc[name] = arm(name, s, url, doc["generation_0"]["by_task"])
            print(f"{name}: {doc[name]}", flush=True)
    doc["minutes"] = round((time.perf_counter() - started) / 60, 1)
    write_result(opts.name, doc, opts, path=RESULTS / f"{opts.name}.json")


__all__ = ["Options", "run"]
