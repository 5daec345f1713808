"""The champion at work: the units example's agents, unchanged, through `ratchet gateway`, score
what the loop's evaluate measured for that champion.

    .venv/bin/python -m bench gateway_units --data DIR [--evolution default] [--agents openai langgraph]

`DIR` is a data dir whose evolution has a champion (e.g. `ratchet --config openai.toml
--data-dir DIR evolve` in examples/units). On one embedded server, for each agent and each of
the test split's tasks, one at a time from an emptied prefix cache:

* ratchet: `ratchet evaluate` through the intervention endpoint, in a copy of the data dir (the
  loop's evaluate, greedy, the same tasks and seeds);
* gateway: the example's agent, unchanged but for its base URL, against `ratchet gateway
  --temperature 0` (its own process, in front of the same server), scored by the task file's
  scorer as the endpoint's runner scores it.

Per task: both outcomes and whether they agree; in total, both scores, the paired sign test
between them, and the policy version the gateway named against the champion's. Writes
bench/results/<name>.json.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.export_roundtrip import AGENTS, EXAMPLE, Played, ratchet_side, units_settings
from bench.gateway_overhead import GatewayProcess
from bench.harness import MODELS, embedded_server, option, paired, write_result


@dataclass
class Options:
    data: Path = option(Path(".ratchet/units-champion"), "a data dir with a units champion")
    evolution: str = option("default", "the evolution whose champion is served")
    agents: list[str] = option(["openai", "langgraph"], "the example's agents", choices=sorted(AGENTS))
    test: int = option(50, "test tasks (the file has 50)")
    generation: int = option(900, "the generation ratchet's evaluate is stored as (in the copy)")
    name: str = option("gateway_units", "results file name under bench/results")


def gateway_side(settings: Any, gateway_url: str, url: str) -> tuple[dict[str, Played], set[str]]:
    """The agent against the gateway, one task at a time in evaluate's order; and every policy
    version the gateway's `/health` named while it played."""
    from ratchet.endpoint.agent import give_answer
    from ratchet.endpoint.entry import YourAgent, task_input
    from ratchet.server.launcher import reset_prefix_cache
    from ratchet.suites import suite_from

    suite, agent = suite_from(settings), YourAgent(settings.agent)
    health = gateway_url.removesuffix("/v1") + "/health"
    versions: set[str] = set()
    out: dict[str, Played] = {}
    reset_prefix_cache(url)
    try:
        for task in suite.tasks("test", settings.splits.test):
            versions.add(httpx.get(health, timeout=30).json()["policy"])
            try:
                answer = agent.run(task_input(task), gateway_url, settings.tasks.max_steps)
                with suite.episode(task) as episode:
                    episode.reset()
                    out[task.id] = Played(give_answer(episode, answer).success, [])
            except Exception as exc:  # noqa: BLE001 - a failed task, as the endpoint's runner counts it
                out[task.id] = Played(False, [], f"{type(exc).__name__}: {exc}")
    finally:
        suite.close()
    return out, versions


def run(opts: Options) -> int:
    from ratchet.flows.runtime import champion_policy
    from ratchet.runtime_env import prepare_environment
    from ratchet.skills.library import SkillLibrary

    os.chdir(EXAMPLE)  # the agents and the scorer are imported from the example's folder
    sys.path.insert(0, str(EXAMPLE))
    work = Path(tempfile.mkdtemp(prefix="ratchet-gateway-units-"))
    data = work / "data"  # ratchet's evaluate writes rollouts: into a copy, never the run's own data dir
    source = opts.data if opts.data.is_absolute() else EXAMPLE.parents[1] / opts.data
    shutil.copytree(source, data, symlinks=True, ignore=shutil.ignore_patterns("prefect", "logs", "run"))
    result: dict[str, Any] = {"data": str(source), "agents": {}}
    all_agree = True
    with embedded_server(work / "logs", models=MODELS) as url:
        for name in opts.agents:
            settings = units_settings(data, opts.evolution, name, opts.test)
            prepare_environment(settings)
            version = champion_policy(settings, SkillLibrary(settings.skills_dir, settings.index_dir)).version
            started = time.perf_counter()
            ours = ratchet_side(settings, url, opts.generation + len(result["agents"]))
            ratchet_s = time.perf_counter() - started
            gw = GatewayProcess(
                data, url, work / "logs" / f"gateway-{name}.log", extra=["--temperature", "0"]
            )
            try:
                started = time.perf_counter()
                theirs, named = gateway_side(settings, gw.url, url)
                gateway_s = time.perf_counter() - started
            finally:
                gw.stop()
            tasks = list(ours)
            rows = [
                {
                    "task": t,
                    "ratchet": ours[t].success,
                    "gateway": theirs[t].success,
                    "errors": [e for e in (ours[t].error, theirs[t].error) if e],
                }
                for t in tasks
            ]
            agree = all(r["ratchet"] == r["gateway"] for r in rows)
            all_agree &= agree
            result["agents"][name] = {
                "champion": version,
                "gateway_named": sorted(named),
                "tasks": len(rows),
                "ratchet": sum(r["ratchet"] for r in rows),
                "gateway": sum(r["gateway"] for r in rows),
                "same_outcome_per_task": agree,
                "gateway_vs_ratchet": paired(
                    {r["task"]: float(r["ratchet"]) for r in rows},
                    {r["task"]: float(r["gateway"]) for r in rows},
                ),
                "ratchet_evaluate_seconds": round(ratchet_s, 1),
                "gateway_seconds": round(gateway_s, 1),
                "rows": rows,
            }
            a = result["agents"][name]
            print(
                f"{name}: {a['tasks']} test tasks, ratchet's evaluate {a['ratchet']}, through the gateway "
                f"{a['gateway']} (same outcome on every task: {agree}); "
                f"the gateway named {a['gateway_named']}, the champion is {version}",
                flush=True,
            )
            write_result(opts.name, result, opts)  # after each agent: a cut run keeps the agents it played
    return 0 if all_agree else 1
