"""Agent traffic through the embedded engine with prefill grouped by width, and without.

The workload is what a generation sends: 8 coin rollouts at once, each step's prompt the
exact one the actor built (replayed from real episodes, `training/examples.replay`; the
episodes are played by random valid actions, so no model is needed to make them), each
rollout sending its next step when the last is answered, rollouts starting as others end.
Each request decodes `--tokens` tokens (about an action's length) under the step's own
tool grammar, greedy. The two engines run interleaved, `--rounds` times each, in one
process; the result is the ratio of wall times and of prefill slots (rows x width of every
prefill forward: what the padded forwards computed).

    .venv/bin/python bench/prefill_groups.py [--rollouts 16] [--steps 15] [--rounds 2]

Writes bench/results/prefill_groups.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from queue import Queue
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _setup import write_result  # noqa: E402


def episodes(n: int, steps: int) -> list[list[dict[str, Any]]]:
    """`n` coin episodes played by random valid actions: per episode, each step's request."""
    from ratchet.agents.actor import ActorSettings, build_actor
    from ratchet.agents.rollout import RolloutSlot, run_rollout
    from ratchet.agents.testing import ScriptedChatModel, call
    from ratchet.suites import get_suite
    from ratchet.training.examples import replay
    from ratchet.types import Policy

    rng = random.Random(0)

    def script(messages: list, tools: list) -> Any:
        valid = tools[0]["function"]["parameters"]["properties"]["action"]["enum"]
        return call("act", action=rng.choice(valid))

    suite = get_suite("textworld-express:coin")
    out = []
    try:
        actor = build_actor(ScriptedChatModel(script=script))
        for i, task in enumerate(suite.tasks("train", n)):
            t = run_rollout(
                actor, suite, RolloutSlot("bench", 0, task, i), Policy(model="m"), ActorSettings(steps)
            )
            out.append([{"messages": ex.messages, "tools": ex.tools} for ex in replay(t)])
    finally:
        suite.close()
    return out


def encode(engine: Any, request: dict[str, Any]) -> tuple[list[int], Any]:
    """Token ids and compiled grammar exactly as the server makes them for this request."""
    from ratchet.toolcalls import render_tools, to_chatml_messages, tool_call_schema

    turns = to_chatml_messages(request["messages"], render_tools(request["tools"]))
    ids = engine.tokenizer.apply_chat_template(
        turns, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    schema = tool_call_schema(request["tools"], allow_text=False)
    return list(ids), engine.compile_json_schema(json.dumps(schema, sort_keys=True))


def play(
    engine: Any, eps: list[list[tuple[list[int], Any]]], tokens: int, concurrency: int
) -> tuple[float, list[list[Any]]]:
    """Wall seconds for every episode's steps, `concurrency` episodes in flight, and what
    each step was answered with (per episode, the engine's `GenResult`s)."""
    from ratchet.server.engine import GenRequest

    todo: Queue[int] = Queue()
    for i in range(len(eps)):
        todo.put(i)
    answers: dict[int, list[Any]] = {}

    def worker() -> None:
        while not todo.empty():
            i = todo.get()
            answers[i] = [
                engine.generate(GenRequest(prompt_ids=ids, max_tokens=tokens, temperature=0, grammar=grammar))
                for ids, grammar in eps[i]
            ]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return time.perf_counter() - started, [answers[i] for i in range(len(eps))]


Runs = dict[str, list[dict[str, float]]]  # per variant, per round: wall seconds and engine counters


def run_variants(
    args: argparse.Namespace,
    variants: dict[str, dict[str, Any]],
    keys: tuple[str, ...],
    contexts: dict[str, Callable[[], AbstractContextManager[Any]]] | None = None,
) -> tuple[Runs, dict[str, list[list[Any]]]]:
    """Play the workload on one engine per variant (`Engine(**kwargs)`, inside the variant's
    context if it has one), interleaved `args.rounds` times in this process: each run's wall
    seconds and engine counters, and the last round's replies per variant (`GenResult`s, per
    episode). `keys` are the counters printed after each run."""
    from ratchet.server.engine import Engine
    from ratchet.server.weights import ensure_hf_copy

    model_dir = ensure_hf_copy(ROOT / ".ratchet" / "models")
    requests = episodes(args.rollouts, args.steps)
    runs: Runs = {name: [] for name in variants}
    replies: dict[str, list[list[Any]]] = {}
    for _ in range(args.rounds):
        for name, kwargs in variants.items():
            with (contexts or {}).get(name, nullcontext)():
                engine = Engine(model_dir, max_batch=args.concurrency, **kwargs)
                try:
                    eps = [[encode(engine, r) for r in e] for e in requests]
                    seconds, replies[name] = play(engine, eps, args.tokens, args.concurrency)
                    stats = dict(engine.stats)
                finally:
                    engine.close()
            runs[name].append({"seconds": seconds, **{k: float(v) for k, v in stats.items()}})
            parts = "  ".join(f"{k.removesuffix('_seconds')} {stats[k]:7.1f}" for k in keys if k in stats)
            print(f"{name:16s} {seconds:7.1f} s  {parts}", flush=True)
    return runs, replies


def medians(runs: Runs, keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per variant, the median over rounds of each of `keys`."""
    return {name: {k: statistics.median(r[k] for r in v) for k in keys} for name, v in runs.items()}


def traffic_parser(description: str | None) -> argparse.ArgumentParser:
    """The workload's knobs, shared by the engine benches that replay it."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    return p


def main() -> None:
    args = traffic_parser(__doc__.split("\n\n")[0]).parse_args()
    variants = {"grouped": {"group_prefill": True}, "one forward": {"group_prefill": False}}
    runs, _ = run_variants(args, variants, ("prefill_slots", "prefilled_tokens", "requests"))
    med = medians(runs, ("seconds", "prefill_slots"))
    summary = {
        "speedup": med["one forward"]["seconds"] / med["grouped"]["seconds"],
        "prefill_slots_ratio": med["one forward"]["prefill_slots"] / med["grouped"]["prefill_slots"],
        "median_seconds": {name: m["seconds"] for name, m in med.items()},
    }
    write_result("prefill_groups", summary, {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
