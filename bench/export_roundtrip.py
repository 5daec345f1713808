"""Export round trip: the units champion through ratchet's endpoint vs. through its export's apply.py.

    .venv/bin/python -m bench export_roundtrip --data DIR [--evolution units] [--agent openai] [--test 50]
    .venv/bin/python -m bench export_roundtrip --test 8            # a fresh data dir, a planted champion

The champion of a units data dir (`python -m bench your_agent` makes one: DIR/openai) plays the
test split three ways, greedy, one task at a time from an emptied prefix cache, on one embedded
server:

* ratchet: `ratchet evaluate` through the intervention endpoint (in a copy of the data dir, as
  generation `--generation`), the nearest prompt skills and solved examples picked per task;
* export, per task: the example's agent, unchanged, against `apply.py serve` of a `ratchet
  export` of that champion, given each task's MiniLM embedding (`--embed`): what a user who
  embeds the task gets;
* export, every text: the same proxy without an embedding (system_addition.md whole).

Per task: each way's outcome, and whether the requests the model received were the same as
ratchet's (messages, tools, model; tool-call ids aside). Without `--data`, a fresh data dir gets
a planted champion (`plant_units_champion`: the units constraint and an exemplar set of
`--demos` solved train tasks, gated and promoted as the loop files them).

Writes bench/results/<name>.json.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.harness import MODELS, ROOT, embedded_server, fresh_data_dir, option, paired, write_result

EXAMPLE = ROOT / "examples" / "units"
AGENTS = {
    "openai": {"agent.entry": "openai_agent:run", "agent.kind": "function"},
    "langgraph": {"agent.entry": "langgraph_agent:build", "agent.kind": "langgraph"},
}


@dataclass
class Options:
    data: Path | None = option(None, "a data dir with a units champion (default: a fresh one, planted)")
    evolution: str = option("units", "the evolution whose champion is exported")
    agent: str = option("openai", "the example's agent", choices=sorted(AGENTS))
    test: int = option(50, "test tasks (the file has 50)")
    demos: int = option(8, "planted champion: solved train tasks in its exemplar set")
    constraint: bool = option(True, "planted champion: with the units constraint (--no-constraint: without)")
    generation: int = option(900, "ratchet's evaluate is stored as this generation, or the next unused one")
    name: str = option("export_roundtrip", "results file name under bench/results")


def units_settings(data: Path, evolution: str, agent: str, test: int) -> Any:
    """The units example's settings on `data` (as `bench your_agent` runs it), one rollout at
    a time, without MCP tools (the champion's are exported as a command, not applied)."""
    from ratchet.config import load_settings

    return load_settings(
        {
            "data_dir": data,
            "evolution": evolution,
            "tasks.file": str(EXAMPLE / "tasks.jsonl"),
            "tasks.score": "score:score",
            "tasks.max_steps": 4,
            "splits.test": test,
            "concurrency": 1,  # the same order of requests on both sides: the same prefix cache states
            "trace_sample_rate": 0.0,
            "evaluate.baseline_seeds": 0,
        }
        | AGENTS[agent]
    )


# ---------------------------------------------------------------------------- a planted champion

_QUESTION = [
    re.compile(r"How many (?P<to>.+) are in (?P<value>[\d.]+) (?P<frm>.+)\?"),
    re.compile(r"Convert (?P<value>[\d.]+) (?P<frm>.+) to (?P<to>.+)\."),
    re.compile(r"What is (?P<value>[\d.]+) (?P<frm>.+) in (?P<to>.+)\?"),
    re.compile(r"Express (?P<value>[\d.]+) (?P<frm>.+) in (?P<to>.+)\."),
    re.compile(r"I have (?P<value>[\d.]+) (?P<frm>.+)\. How much is that in (?P<to>.+)\?"),
]


def solved_call(question: str) -> dict[str, Any]:
    """The `convert` call that answers a units question (the words as the question writes them)."""
    for rx in _QUESTION:
        if m := rx.fullmatch(question):
            value = float(m["value"])
            return {
                "value": int(value) if value.is_integer() else value,
                "from_unit": m["frm"],
                "to_unit": m["to"],
            }
    raise ValueError(f"not a units question: {question!r}")


def plant_units_champion(settings: Any, demos: int = 8, constraint: bool = True) -> list[str]:
    """File the units constraint (unless not `constraint`) and an exemplar set of `demos` solved
    train tasks in the data dir's skill library, pass each through the gate's record and promote
    it, as the loop does (`verify` then `verify:auto`); returns their names."""
    from ratchet.skills.exemplars import exemplar_skill
    from ratchet.skills.format import Demo, Skill
    from ratchet.skills.library import SkillLibrary
    from ratchet.skills.rules import call_text
    from ratchet.suites import suite_from
    from ratchet.types import ArgConstraint, ConstraintSpec, ToolCall

    suite = suite_from(settings)
    family = f"{suite.name}:{suite.subsets[0]}"
    train = suite.tasks("train", min(demos, len(suite.by_split["train"])))  # type: ignore[attr-defined]
    solved = [
        Demo(
            task=t.instruction,
            actions=(call_text(ToolCall(name="convert", args=solved_call(t.instruction))),),
            trajectory=f"planted-{t.id}",
        )
        for t in train
    ]
    units = ArgConstraint(from_context=True, max_length=40)
    args = Skill(
        name="tasks-args",
        description=f"argument constraints for {family}: convert(from_unit, to_unit, value)",
        body="The units and the number are words of the question.",
        kind="constraint",
        family=family,
        evolution=settings.evolution,
        generation=1,
        provenance=[d.trajectory for d in solved],
        constraint=ConstraintSpec(
            name="tasks-args",
            tools={
                "convert": {"from_unit": units, "to_unit": units, "value": ArgConstraint(from_context=True)}
            },
        ),
    )
    exemplars = exemplar_skill(family, solved, settings.evolution, 1)
    library = SkillLibrary(settings.skills_dir, settings.index_dir)
    names = []
    planted = [(args, (5, 0, 0.031))] if constraint else []
    for skill, (repairs, regressions, p) in [*planted, (exemplars, (10, 1, 0.011))]:
        name = library.add(skill).name
        evidence = {
            "decision": "accept",
            "reason": f"significant net gain: {repairs} repairs, {regressions} regressions in 24 tasks",
            "repairs": repairs,
            "regressions": regressions,
            "unchanged": 24 - repairs - regressions,
            "p_value": p,
            "tasks": 24,
            "rollouts": 48,
            "champion": "planted",
        }
        library.transition(name, "verified", who="verify", why=evidence["reason"], evidence=evidence)
        library.transition(name, "promoted", who="verify:auto", why="promotion policy 'auto'")
        names.append(name)
    return names


# ---------------------------------------------------------------------------------- the two sides


@dataclass
class Played:
    """One task played one way: its outcome and the requests the model received."""

    success: bool
    requests: list[dict[str, Any]]
    error: str | None = None


def comparable(messages: list[dict[str, Any]], tools: list[Any] | None, model: str) -> dict[str, Any]:
    """A request as the model reads it: messages (tool-call ids aside: the server makes them
    at random and never shows them to the model), tools and model."""

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items() if k not in ("id", "tool_call_id")}
        if isinstance(x, list):
            return [plain(v) for v in x]
        return x

    return {"messages": plain(messages), "tools": tools or [], "model": model}


def ratchet_side(settings: Any, url: str, generation: int) -> dict[str, Played]:
    """The champion through ratchet's intervention endpoint: `evaluate`, one rollout at a time."""
    from ratchet.flows.evaluate import evaluate
    from ratchet.flows.launch import run_flow
    from ratchet.memory.trajectory_store import open_store
    from ratchet.server.launcher import reset_prefix_cache

    reset_prefix_cache(url)
    result = run_flow(evaluate, settings, generation=generation, base_url=url)
    if result.report.skipped:  # rollouts stored before (another agent's, perhaps) were not played
        raise RuntimeError(
            f"generation {generation} of {settings.evolution} was evaluated before: pick another"
        )
    store = open_store(settings.trajectories_db)
    try:
        played = [t for i in result.slot_ids if (t := store.get(i)) is not None]
    finally:
        store.close()
    out = {}
    for t in played:
        requests, messages, tools = [], [], None
        for s in t.steps:
            if s.call is None:
                continue
            messages = [*messages, *s.call.messages] if s.call.continues else list(s.call.messages)
            tools = s.call.tools if s.call.tools is not None else tools
            requests.append(comparable(messages, tools, settings.model.name))
        out[t.task_id] = Played(t.success and t.status == "finished", requests, t.error)
    return out


def unused_generation(settings: Any, wanted: int) -> int:
    """`wanted`, or the first generation after it with no stored rollout of the evolution."""
    from ratchet.memory.trajectory_store import open_store

    store = open_store(settings.trajectories_db)
    try:
        while store.count(evolution=settings.evolution, generation=wanted):
            wanted += 1
    finally:
        store.close()
    return wanted


def load_apply(export_dir: Path) -> ModuleType:
    """The export's own apply.py, loaded from its file (not ratchet's copy of it)."""
    spec = importlib.util.spec_from_file_location(f"export_apply_{id(export_dir)}", export_dir / "apply.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_side(
    settings: Any, export_dir: Path, url: str, embed: Callable[[str], list[float]] | None
) -> dict[str, Played]:
    """The same agent against `apply.py serve` of the export in front of the same server,
    greedy (`--set temperature=0`), one task at a time in evaluate's order."""
    from ratchet.endpoint.agent import give_answer
    from ratchet.endpoint.entry import YourAgent, task_input
    from ratchet.server.launcher import reset_prefix_cache
    from ratchet.suites import suite_from

    apply = load_apply(export_dir)
    export = apply.Export(export_dir)
    sent: list[dict[str, Any]] = []
    applied = export.apply

    def recording(body: dict[str, Any], query_vector: Any = None) -> dict[str, Any]:
        out = applied(body, query_vector)
        sent.append(comparable(out["messages"], out.get("tools"), out["model"]))
        return out

    export.apply = recording
    proxy = apply.serve(export, url, port=0, embed=embed, overrides={"temperature": 0})
    base = f"http://127.0.0.1:{proxy.server_address[1]}/v1"
    suite, agent = suite_from(settings), YourAgent(settings.agent)
    out = {}
    reset_prefix_cache(url)
    try:
        for task in suite.tasks("test", settings.splits.test):
            sent.clear()
            try:
                answer = agent.run(task_input(task), base, settings.tasks.max_steps)
                with suite.episode(task) as episode:
                    episode.reset()
                    out[task.id] = Played(give_answer(episode, answer).success, list(sent))
            except Exception as exc:  # noqa: BLE001 - a failed task, as the endpoint's runner counts it
                out[task.id] = Played(False, list(sent), f"{type(exc).__name__}: {exc}")
    finally:
        proxy.shutdown()
        suite.close()
    return out


def task_embedding(text: str) -> list[float]:
    """The task's MiniLM embedding, as a user computes it (ratchet's copy of all-MiniLM-L6-v2)."""
    from ratchet.memory.vector_index import embed

    return [float(x) for x in embed([text])[0]]


def roundtrip(settings: Any, url: str, generation: int, out: Path, every_text: bool = True) -> dict[str, Any]:
    """Export the champion of `settings`' data dir to `out`, then play its test split the
    three ways (module docstring; the third only with `every_text`); per task and in total."""
    from ratchet.flows.export import export_champion

    exported = export_champion(settings, out, by="bench")
    started = time.perf_counter()
    ours = ratchet_side(settings, url, generation)
    ratchet_s = time.perf_counter() - started
    per_task = export_side(settings, out, url, task_embedding)
    every = export_side(settings, out, url, None) if every_text else per_task
    tasks = list(ours)
    rows = [
        {
            "task": t,
            "ratchet": ours[t].success,
            "export_per_task": per_task[t].success,
            "export_every_text": every[t].success,
            "same_requests": ours[t].requests == per_task[t].requests,
            "calls": len(ours[t].requests),
            "errors": [e for e in (ours[t].error, per_task[t].error, every[t].error) if e],
        }
        for t in tasks
    ]
    score = {
        k: {t: float(r[k]) for t, r in zip(tasks, rows, strict=True)}
        for k in ("ratchet", "export_per_task", "export_every_text")
    }
    return {
        "policy_version": exported.policy_version,
        "candidates": exported.candidates,
        "tasks": len(rows),
        "ratchet": sum(r["ratchet"] for r in rows),
        "export_per_task": sum(r["export_per_task"] for r in rows),
        "export_every_text": sum(r["export_every_text"] for r in rows),
        "same_outcome_per_task": all(r["ratchet"] == r["export_per_task"] for r in rows),
        "same_requests": sum(r["same_requests"] for r in rows),
        "every_text_vs_per_task": paired(score["export_per_task"], score["export_every_text"]),
        "ratchet_evaluate_seconds": round(ratchet_s, 1),
        "rows": rows,
    }


def run(opts: Options) -> int:
    import os

    from ratchet.runtime_env import prepare_environment

    os.chdir(EXAMPLE)  # the agents and the scorer are imported from the example's folder
    sys.path.insert(0, str(EXAMPLE))
    work = Path(tempfile.mkdtemp(prefix="ratchet-export-roundtrip-"))
    if opts.data is None:
        data = fresh_data_dir("ratchet-export-roundtrip-data-")
        settings = units_settings(data, opts.evolution, opts.agent, opts.test)
        prepare_environment(settings)
        names = plant_units_champion(settings, opts.demos, opts.constraint)
        print(f"planted {', '.join(names)} in {data}")
    else:  # ratchet's evaluate writes rollouts: into a copy, never the run's own data dir
        data = work / "data"
        shutil.copytree(
            opts.data, data, symlinks=True, ignore=shutil.ignore_patterns("prefect", "logs", "run")
        )
        settings = units_settings(data, opts.evolution, opts.agent, opts.test)
        prepare_environment(settings)
    models = settings.models_dir if settings.models_dir.is_dir() else MODELS
    generation = unused_generation(settings, opts.generation)
    with embedded_server(work / "logs", models=models) as url:
        result = roundtrip(settings, url, generation, work / "export")
    result["data"] = str(opts.data or data)
    write_result(opts.name, result, opts)
    print(
        f"{result['tasks']} test tasks: ratchet {result['ratchet']}, export with the per-task choice "
        f"{result['export_per_task']} (same outcome on every task: {result['same_outcome_per_task']}, "
        f"same requests on {result['same_requests']}), export with every text {result['export_every_text']}"
    )
    return 0 if result["same_outcome_per_task"] else 1
