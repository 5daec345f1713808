"""Known effects on the real engine: the verify gate admits what helps and refuses what hurts.

The intervention with a large, known effect is a LoRA adapter that taught the shipped
SmolLM2-135M to play TextWorldExpress coin (rft_gain trains it: 0/30 → 14/30 on
the test split). On the dev split, with the same seeds in both arms:

* helps: champion = base model, candidate = base model + adapter  → must be admitted;
* hurts: champion = base model + adapter, candidate = base model  → must be refused.

Both go through `flows.verify.run_gates`, the group-sequential McNemar gate every skill,
tool and adapter passes through, against the embedded server.

    .venv/bin/python -m bench known_effect --adapter DIR [--dev 24] [--max-steps 8] [--temperature 0.8]

Sampling at T=0.8 with the pairing seeds (as in the real A/A of `aa_gate`): greedy, the
adapter solved only 3 of 16 coin dev tasks (14/30 test tasks), too few for a paired test on
16 tasks to call significant; sampled, it solves ~45% of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import fresh_data_dir, install_champion, option, write_result


def run_known_effects(
    adapter: Path,
    dev: int = 24,
    max_steps: int = 8,
    temperature: float = 0.8,
    data_dir: Path | None = None,
    base_url: str | None = None,
) -> dict[str, Any]:
    from prefect import flow

    from ratchet.config import Settings, load_settings
    from ratchet.flows.launch import run_flow
    from ratchet.flows.runtime import model_policy, open_runtime
    from ratchet.flows.verify import gate_evidence, run_gates

    data = data_dir or fresh_data_dir("ratchet-known-")
    settings = load_settings(
        {
            "data_dir": data,
            "evolution": "known-effect",
            "suite": "textworld-express:coin",
            "splits.dev": dev,
            "max_steps": max_steps,
            "evaluate.temperature": temperature,
        }
    )
    install_champion(settings, adapter)

    @flow(name="known-effect", validate_parameters=False)
    def gates(settings: Settings, base_url: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with open_runtime(settings, base_url) as rt:
            tasks = rt.suite.tasks("dev", dev)
            with_adapter, without = rt.base_policy(), model_policy(settings, None)
            cases = {"helps": (without, with_adapter), "hurts": (with_adapter, without)}
            for generation, (name, (champion, candidate)) in enumerate(cases.items()):
                started = time.perf_counter()  # one generation per case: their baseline arms differ
                g = run_gates(rt, generation, champion, {name: (candidate, tasks)}, {name: name})
                ev = gate_evidence(g.decisions[name], champion, candidate, g.outcomes[name])
                out[name] = ev | {"wall_seconds": round(time.perf_counter() - started, 1)}
        return out

    return run_flow(gates, settings, base_url=base_url) | {"data_dir": str(data)}


@dataclass
class Options:
    adapter: Path = option(help="a coin LoRA adapter (python -m bench rft_gain)")
    dev: int = option(24)
    max_steps: int = option(8)
    temperature: float = option(0.8, "both arms' sampling (seeds shared)")
    data_dir: Path | None = option(None, "reuse (resume) a previous run's state")


def run(opts: Options) -> None:
    result = run_known_effects(opts.adapter, opts.dev, opts.max_steps, opts.temperature, opts.data_dir)
    for name in ("helps", "hurts"):
        ev = result[name]
        print(
            f"{name}: {ev['decision']} ({ev['reason']}); repairs {ev['repairs']}, regressions "
            f"{ev['regressions']}, p={ev['p_value']:.4f}, {ev['tasks']} tasks, {ev['rollouts']} rollouts, "
            f"{ev['wall_seconds']:.0f} s"
        )
    write_result("known_effect", result, opts)
