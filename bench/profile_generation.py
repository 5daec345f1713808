"""Where a generation's wall time goes: `ratchet evolve` on a fresh data dir, profiled by part.

Runs the evolution in this process against one embedded server (the README's default
settings unless overridden) and accounts for the time three ways:

* **stages** — wall time of each stage of each generation (the evolve journal);
* **server** — the engine worker's own clocks (`server.engine`, read from `/health` around
  every stage): prefill forwards, decode forwards, grammar masks, KV bookkeeping (prefix
  cache, rows merged in and out), the rest of its busy time (sampling, Python), and idle;
  the worker is one thread, so these add up to the stage's wall time; and the server
  process's resident memory at each stage's end and its peak so far;
* **client** — thread-seconds summed over the rollout threads (8 at once, so they add up
  to more than the wall): waiting on the model (HTTP round trip, queueing included), the
  environment (reset, step, tool list), policy tools (sandbox), and the rest of a rollout
  (LangGraph, prompts, rules); plus, wherever they run, MLflow calls, the Chroma index
  (embedding included) and the trajectory store.

Prefect's own overhead was measured separately (explore_overhead in bench/RESULTS.md: ≤ 2%).

    .venv/bin/python -m bench profile_generation [--set KEY=VALUE ...] [--name profile_generation]
    .venv/bin/python -m bench profile_generation --memray /tmp/server.bin   # and the server's heap
    .venv/bin/python -m bench profile_generation --report bench/results/profile_generation.json

Writes bench/results/NAME.json and prints the tables.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import embedded_server, fresh_data_dir, option, server_stats, write_result

SERVER_PARTS = ("prefill_seconds", "decode_seconds", "grammar_seconds", "kv_seconds")
_thread = threading.local()  # in_rollout: this thread is inside run_rollout


class Clocks:
    """Thread-safe sums of seconds by part; `wrap` times a function's calls under a part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def wrap(self, owner: Any, attr: str, part: str, rollout: bool = False) -> None:
        """Time `owner.attr` under `part`; calls outside a rollout go to 'part (outside
        rollouts)' when `rollout` is set. The rollout itself: `part == "rollout"`."""
        fn: Callable[..., Any] = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            inside = getattr(_thread, "in_rollout", False)
            name = part if not rollout or inside else f"{part} (outside rollouts)"
            if part == "rollout":
                _thread.in_rollout = True
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if part == "rollout":
                    _thread.in_rollout = inside
                with self._lock:
                    self.seconds[name] += time.perf_counter() - started
                    self.calls[name] += 1

        setattr(owner, attr, timed)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.seconds)


def instrument(clocks: Clocks) -> None:
    """Time the parts at the functions every call of them goes through."""
    import mlflow
    from langchain_openai import ChatOpenAI

    from ratchet.flows import rollouts
    from ratchet.memory import vector_index
    from ratchet.memory.trajectory_store import SQLiteTrajectoryStore
    from ratchet.skills.toolbox import Toolbox
    from ratchet.suites.reasoning_gym import ReasoningGymEpisode
    from ratchet.suites.textworld_express import TextWorldExpressEpisode

    clocks.wrap(rollouts, "run_rollout", "rollout")
    clocks.wrap(ChatOpenAI, "_generate", "model", rollout=True)
    for episode in (TextWorldExpressEpisode, ReasoningGymEpisode):
        for attr in ("reset", "step", "tools", "valid_actions"):
            clocks.wrap(episode, attr, "environment", rollout=True)
    clocks.wrap(Toolbox, "call", "policy tools", rollout=True)
    for attr in ("upsert", "delete", "get", "query", "query_embedding", "nearest", "embeddings"):
        clocks.wrap(vector_index.VectorIndex, attr, "chroma")
    for attr in ("put", "get", "query", "finished_ids", "put_diagnoses"):
        if hasattr(SQLiteTrajectoryStore, attr):
            clocks.wrap(SQLiteTrajectoryStore, attr, "trajectory store")
    for attr in [a for a in dir(mlflow) if a.startswith(("log_", "set_")) or a in ("start_run", "end_run")]:
        if callable(getattr(mlflow, attr)):
            clocks.wrap(mlflow, attr, "mlflow")


@dataclass
class Options:
    overrides: list[str] = option([], "settings overrides", flags=("--set",), nargs="*", metavar="KEY=VALUE")
    server_args: list[str] = option(
        [],
        "more `python -m ratchet.server` flags, as one string (--server-args='--shape-buckets 0')",
        type=str.split,
        nargs=None,
    )
    memray: Path | None = option(
        None,
        "run the server under `memray run --aggregate` into this capture (pip install memray) "
        "and list the heap at its high-water mark by allocating line (bench/memory_breakdown.py)",
    )
    name: str = option("profile_generation", "results file name under bench/results")
    report: Path | None = option(None, "only print the tables of a results file")


def run(args: Options) -> None:
    if args.report is not None:
        print(report(json.loads(args.report.read_text())))
        return
    from ratchet.config import load_settings
    from ratchet.flows import evolve

    data = fresh_data_dir("ratchet-profile-")
    overrides: dict[str, Any] = {"data_dir": data}
    for kv in args.overrides:
        key, _, value = kv.partition("=")
        overrides[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    settings = load_settings(overrides)
    clocks = Clocks()
    instrument(clocks)
    stages: list[dict[str, Any]] = []
    run_stage = evolve.run_stage

    server = embedded_server(
        data / "logs",
        dtype=settings.model.dtype,
        server_args=args.server_args,
        memray=args.memray,
        kv_cache_mb=settings.model.kv_cache_mb,  # as flows/runtime.py starts it
        kv_dtype=settings.model.kv_dtype,
    )
    with server as url:

        def profiled(settings: Any, name: str, generation: int, url: str) -> Any:
            before, client, started = server_stats(url), clocks.snapshot(), time.perf_counter()
            try:
                return run_stage(settings, name, generation, url)
            finally:
                wall = time.perf_counter() - started
                after, now = server_stats(url), clocks.snapshot()
                server = {k: after.get(k, 0) - before.get(k, 0) for k in (*SERVER_PARTS, "busy_seconds")}
                row = {"generation": generation, "stage": name, "wall": wall, "server": server}
                row["client"] = {k: v - client.get(k, 0.0) for k, v in now.items() if v - client.get(k, 0.0)}
                row["tokens"] = {
                    k: after.get(k, 0) - before.get(k, 0)
                    for k in (
                        "prompt_tokens",
                        "prefilled_tokens",
                        "generated_tokens",
                        "requests",
                        "attended_pairs",
                        "attended_needed",
                    )
                }
                memory = ("rss_mb", "peak_rss_mb", "kv_pool_mb", "kv_in_use_mb")  # the pool: grown? held?
                row["server_memory_mb"] = {k: after[k] for k in memory if k in after}
                stages.append(row)
                print(f"gen {generation} {name:9s} {wall:7.1f} s {row['server_memory_mb']}", flush=True)

        evolve.run_stage = profiled
        started = time.perf_counter()
        journal = evolve.evolve_flow(settings=settings, base_url=url)
        wall = time.perf_counter() - started
    rows = [asdict(r) for r in journal.rows()]
    doc = {
        "settings": overrides | {"data_dir": str(data)},
        "wall_seconds": wall,
        "stages": stages,
        "rows": rows,
    }
    if args.memray is not None:  # the server has stopped: its capture is complete
        from bench.memory_breakdown import breakdown

        doc["server_heap"] = breakdown(args.memray, 12)
        for site, mb in doc["server_heap"]["sites_mb"].items():
            print(f"{mb:9.1f} MiB  {site}")
    write_result(args.name, doc, args)
    print(report(doc))


def report(doc: dict[str, Any]) -> str:
    """The profile as markdown: stages, and the server's and the clients' time by part."""
    stages = doc["stages"]
    lines = [f"whole run: {doc['wall_seconds'] / 60:.1f} min"]
    if peaks := [r["server_memory_mb"]["peak_rss_mb"] for r in stages if r.get("server_memory_mb")]:
        lines.append(f"server resident at its peak: {max(peaks) / 1024:.2f} GB")
    lines.append("")
    head = ["gen", "stage", "wall s", "prefill", "decode", "grammar", "KV", "other busy", "idle"]
    lines += ["| " + " | ".join([*head, "prompt tok", "prefilled tok"]) + " |"]
    lines += ["|---|---|---|---|---|---|---|---|---|---|---|"]
    total: dict[str, float] = defaultdict(float)
    for r in stages:
        s = r["server"]
        other = s["busy_seconds"] - sum(s[k] for k in SERVER_PARTS)
        idle = r["wall"] - s["busy_seconds"]
        cells = [s[k] for k in SERVER_PARTS] + [other, idle]
        for k, v in zip([*SERVER_PARTS, "other", "idle"], cells, strict=True):
            total[k] += v
        total["wall"] += r["wall"]
        shown = " | ".join(f"{v:.0f}" for v in cells)
        t = r["tokens"]
        tok = f"{t['prompt_tokens']:.0f} | {t['prefilled_tokens']:.0f}"
        lines.append(f"| {r['generation']} | {r['stage']} | {r['wall']:.0f} | {shown} | {tok} |")
    w = total["wall"] or 1.0
    shares = " | ".join(f"{100 * total[k] / w:.0f}%" for k in [*SERVER_PARTS, "other", "idle"])
    lines += [f"| all | share of wall | {total['wall']:.0f} | {shares} | | |", ""]
    client: dict[str, float] = defaultdict(float)
    for r in stages:
        for k, v in r["client"].items():
            client[k] += v
    rollout = client.get("rollout", 0.0)
    inside = sum(client.get(k, 0.0) for k in ("model", "environment", "policy tools"))
    client["rollout other (LangGraph, prompts, rules)"] = rollout - inside
    lines += ["| client part | thread-seconds | share of rollout time |", "|---|---|---|"]
    for k in ("model", "environment", "policy tools", "rollout other (LangGraph, prompts, rules)"):
        lines.append(f"| {k} | {client.get(k, 0.0):.0f} | {100 * client.get(k, 0.0) / (rollout or 1):.0f}% |")
    for k in ("model (outside rollouts)", "mlflow", "chroma", "trajectory store"):
        lines.append(
            f"| {k} | {client.get(k, 0.0):.0f} | (wall: {100 * client.get(k, 0.0) / w:.1f}% of the run) |"
        )
    return "\n".join(lines)
