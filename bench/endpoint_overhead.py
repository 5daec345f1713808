"""What the intervention endpoint adds to a model call: the same agent-like requests sent to
the embedded server directly and through the endpoint, at 1 and 8 in flight.

Three sides: `direct`; `endpoint`, a keyed rollout whose policy changes nothing in the
request (the endpoint's own cost: the hop, parsing, recording); `constrained`, a policy with
an argument constraint (what a live constraint costs on top: a schema with an enum of the
question's words, a grammar the server compiles per question).

Each request is one step of the units example's agent: its system prompt, a question, the
`convert` tool, `tool_choice` required. Every request has its own question (no two share a
prompt past the system message, so the server's prefix cache favours neither side), and
the two sides alternate within each round, in turn order. Reports the median seconds per
request and requests per second per side, and the overhead as a share of a step's time.

    .venv/bin/python -m bench endpoint_overhead [--requests 48] [--rounds 3]
    .venv/bin/python -m bench endpoint_overhead --hop   # the hop alone, no model (seconds)

`--hop` times the hop alone: the same request to a fake upstream that answers at once,
directly and through the endpoint, with the fake's socket with and without TCP_NODELAY
(without it, a reply written as headers then body waits for the client's delayed ACK).
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.harness import ROOT, embedded_server, fresh_data_dir, option, write_result

EXAMPLE = ROOT / "examples" / "units"


@dataclass
class Options:
    requests: int = option(48, "requests per side, per concurrency, per round")
    rounds: int = option(3, "rounds (3: each side goes first once)")
    concurrency: list[int] = option([1, 8], nargs="*")
    hop: bool = option(False, "time the hop alone against a fake upstream (no model)")
    name: str = option("endpoint_overhead", "results file name under bench/results")


def questions(n: int, offset: int) -> list[str]:
    lines = (EXAMPLE / "tasks.jsonl").read_text().splitlines()
    return [json.loads(lines[(offset + i) % len(lines)])["input"] for i in range(n)]


def body(question: str) -> dict[str, Any]:
    import sys

    sys.path.insert(0, str(EXAMPLE))
    from openai_agent import MODEL, SYSTEM, TOOLS  # the example agent's own request

    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 64,
        "temperature": 0,
    }


def side(client: httpx.Client, url: str, qs: list[str], concurrency: int) -> tuple[list[float], float]:
    """Seconds of each request, and the wall time of all of them."""

    def one(q: str) -> float:
        started = time.perf_counter()
        got = client.post(url, json=body(q))
        got.raise_for_status()
        return time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        seconds = list(pool.map(one, qs))
    return seconds, time.perf_counter() - started


def hop(n: int = 200) -> dict[str, float]:
    """Median milliseconds of one small request to an instant fake upstream, directly and
    through the endpoint, with the fake's socket with and without TCP_NODELAY."""
    import asyncio
    import socket
    import threading

    import uvicorn
    from fastapi import FastAPI

    from ratchet.endpoint.recording import Arm
    from ratchet.endpoint.serve import InterventionEndpoint
    from ratchet.types import Policy

    app = FastAPI()
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}], "usage": {}}

    @app.post("/v1/chat/completions")
    async def chat() -> dict[str, Any]:
        return reply

    out: dict[str, float] = {}
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for nodelay in (False, True):
        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(nodelay))
        sock.bind(("127.0.0.1", 0))
        upstream = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        fake = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=lambda s=sock, f=fake: asyncio.run(f.serve(sockets=[s])), daemon=True).start()
        while not fake.started:
            time.sleep(0.01)
        with InterventionEndpoint(upstream) as ep, httpx.Client() as client:
            rec = ep.rollouts.open(Arm(Policy(model="m"), max_steps=10**6))
            urls = {
                "direct": f"{upstream}/chat/completions",
                "endpoint": f"{ep.rollout_url(rec.key)}/chat/completions",
            }
            for which, url in urls.items():
                seconds = []
                for _ in range(n):
                    started = time.perf_counter()
                    client.post(url, json=request).raise_for_status()
                    seconds.append(time.perf_counter() - started)
                key = f"{which}_ms_upstream_{'nodelay' if nodelay else 'nagle'}"
                out[key] = 1000 * statistics.median(seconds)
                print(f"{key}: {out[key]:.1f}", flush=True)
        fake.should_exit = True
    return out


def run(opts: Options) -> None:
    if opts.hop:
        write_result(f"{opts.name}_hop", hop(), opts)
        return
    from ratchet.endpoint.recording import Arm
    from ratchet.endpoint.serve import InterventionEndpoint
    from ratchet.types import ArgConstraint, ConstraintSpec, Policy

    data = fresh_data_dir("ratchet-endpoint-overhead-")
    units = {"from_unit": ArgConstraint(from_context=True), "to_unit": ArgConstraint(from_context=True)}
    policies = {
        "endpoint": Policy(model="smollm2-135m-instruct"),
        "constrained": Policy(
            model="smollm2-135m-instruct",
            constraints=(ConstraintSpec(name="units", tools={"convert": units}),),
        ),
    }
    sides = ("direct", *policies)
    rows: list[dict[str, Any]] = []
    with (
        embedded_server(data / "logs") as url,
        InterventionEndpoint(url) as ep,
        httpx.Client(timeout=600) as client,
    ):
        side(client, f"{url}/chat/completions", questions(8, 0), 8)  # warm up: compile, first batch
        offset = 8
        for r in range(opts.rounds):
            for c in opts.concurrency:
                order = sides[r % 3 :] + sides[: r % 3]  # each side first once in three rounds
                for which in order:
                    qs = questions(opts.requests, offset)
                    offset += opts.requests
                    if which == "direct":
                        target = f"{url}/chat/completions"
                    else:
                        rec = ep.rollouts.open(Arm(policies[which], max_steps=10**6))
                        target = f"{ep.rollout_url(rec.key)}/chat/completions"
                    seconds, wall = side(client, target, qs, c)
                    if which != "direct":
                        ep.rollouts.close(rec)
                    rows.append(
                        {
                            "round": r,
                            "concurrency": c,
                            "side": which,
                            "median_s": statistics.median(seconds),
                            "requests_per_s": len(qs) / wall,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
    summary: dict[str, Any] = {}
    for c in opts.concurrency:
        per = {w: [x for x in rows if x["concurrency"] == c and x["side"] == w] for w in sides}
        summary[str(c)] = {f"{w}_median_s": statistics.median(x["median_s"] for x in per[w]) for w in sides}
        summary[str(c)] |= {f"{w}_rps": statistics.median(x["requests_per_s"] for x in per[w]) for w in sides}
        for w in policies:  # paired by round: the same load, the same minute
            ratios = [e["median_s"] / d["median_s"] for d, e in zip(per["direct"], per[w], strict=True)]
            summary[str(c)][f"{w}_overhead_share"] = statistics.median(ratios) - 1
            summary[str(c)][f"{w}_ratio_per_round"] = ratios
        line = ", ".join(f"{w} {summary[str(c)][f'{w}_overhead_share']:+.1%}" for w in policies)
        print(f"{c} in flight: direct {summary[str(c)]['direct_median_s']:.3f} s per request; {line}")
    write_result(opts.name, {"rows": rows, "summary": summary, "data": str(Path(data))}, opts)
