"""Your own agent evolved: `ratchet evolve` on the units example's plain openai agent and
LangGraph agent (examples/units), each unchanged but for its base URL.

Each agent is a target of its own (its own data dir), played from the shipped model on the
example's task file; the table is evolve_gain's, and each generation is compared with
generation 0 on the same test tasks by the paired sign test (a task file has no random
level: nothing to enumerate; generation 0 is your agent as it came).

    .venv/bin/python -m bench your_agent [--targets openai langgraph] [--generations 2]
        [--set explore.temperature=0.3] [--name your_agent]

Writes bench/results/<name>.json, its plot, and `versus_generation_0`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench._evolve import EvolveOptions, run_settings
from bench._evolve import run as evolve_run
from bench.desk_gain import add_versus
from bench.harness import ROOT, option

if TYPE_CHECKING:
    from ratchet.config import Settings

EXAMPLE = ROOT / "examples" / "units"
AGENTS = {
    "openai": {"agent.entry": "openai_agent:run", "agent.kind": "function", "agent.mcp": True},
    "langgraph": {"agent.entry": "langgraph_agent:build", "agent.kind": "langgraph"},
}


@dataclass
class Options(EvolveOptions):
    targets: list[str] = option(["openai", "langgraph"], "the example's agents", choices=sorted(AGENTS))
    generations: int = option(2)
    train: int = option(24, "train tasks (the file has 50)")
    k: int = option(2, "explore rollouts per train task", flags=("-k",))
    dev: int = option(32, "dev tasks (the file has 50)")
    test: int = option(50, "test tasks (the file has 50)")
    name: str = option("your_agent", "results file name under bench/results")


def agent_settings(target: str, data: Path, opts: EvolveOptions) -> Settings:
    from ratchet.config import load_settings

    return load_settings(
        {
            "data_dir": data / target,
            "evolution": "units",
            "tasks.file": str(EXAMPLE / "tasks.jsonl"),
            "tasks.score": "score:score",
            "tasks.max_steps": 4,
        }
        | AGENTS[target]
        # as the example's own settings: sampled at 0.8 the agent solves ~8% of train tasks
        | run_settings(opts, **{"explore.temperature": 0.3})
    )


def run(opts: Options) -> None:
    os.chdir(EXAMPLE)  # the agents and the scorer are imported from the example's folder
    evolve_run(opts, agent_settings)
    if not opts.redraw:
        add_versus(opts, agent_settings)
