"""Decode tokens/s beside a busy neighbour process: OpenMP spinning (ACTIVE) vs PASSIVE.

The embedded server's decode throughput with and without a busy neighbour process, for
OpenMP's default (spinning) wait policy vs PASSIVE, interleaved in one run.

    .venv/bin/python -m bench server_contention [--rounds 2]

Why: on 2 shared cores, a second CPU-bound process slowed explore ~4x. Each configuration
starts a fresh server (the policy is read at process start), 8 concurrent 48-token greedy
requests, median aggregate tokens/s over `--rounds`.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness import ROOT, embedded_server, option, write_result


def throughput(url: str, n: int = 8, tokens: int = 48, rounds: int = 2) -> float:
    def one(i: int, r: int) -> None:
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": f"Tell story {i}.{r} about a robot and a garden."}],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        httpx.post(url + "/chat/completions", json=body, timeout=600).raise_for_status()

    rates = []
    for r in range(rounds):
        started = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, range(n), [r] * n))
        rates.append(n * tokens / (time.perf_counter() - started))
    return statistics.median(rates)


@dataclass
class Options:
    rounds: int = option(2)
    models_dir: Path = option(ROOT / ".ratchet" / "test-models")


def run(args: Options) -> None:
    results: dict[str, float] = {}
    for neighbour in ("quiet", "busy"):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour == "busy" else None
        try:
            for policy in ("ACTIVE", "PASSIVE"):
                os.environ["OMP_WAIT_POLICY"] = policy
                server = embedded_server(ROOT / ".ratchet" / "bench-logs", models=args.models_dir)
                url = server.start()
                try:
                    throughput(url, n=2, tokens=8, rounds=1)  # warm-up
                    rate = results[f"{neighbour}/{policy}"] = round(throughput(url, rounds=args.rounds), 1)
                    print(f"{neighbour:>5} neighbour, OMP_WAIT_POLICY={policy:<7} {rate} tok/s")
                finally:
                    server.stop()
        finally:
            if hog is not None:
                hog.kill()
    write_result("server_contention", results, args)
